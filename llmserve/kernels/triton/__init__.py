"""Triton kernels for CUDA devices (tested on CPU through the Triton interpreter)."""
