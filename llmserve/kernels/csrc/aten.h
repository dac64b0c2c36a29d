// The part of PyTorch's C++ API the kernels use: ATen's Tensor, the few ops they call, and its
// thread pool. Not <torch/extension.h>: pybind11 and the whole C++ frontend would make up most of
// every file's compile time; only module.cpp, which binds the kernels, includes it.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/full.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
