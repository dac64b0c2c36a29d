"""Weight quantization as a transform of the loaded model (docs/quantization.md).

`config.py` (the `--quantization` choice), `formats.py` (int8/int4 weights and RTN), `kernels.py`
(matmuls chosen by measurement, `QuantizedLinear`), `methods.py` (the registry: int8, int4, awq,
gptq, gguf, checkpoint; applying one is a module swap), `moe.py` (quantized experts),
`gguf_native.py`, `embedding.py` (a tied embedding read from its quantized head), `gptq.py`,
`awq.py`, `calibration.py`, `checkpoint.py`, `prequantized.py` (a pre-quantized HF checkpoint's own
codes),
`sharding.py` (each tensor-parallel rank's part). Kept import-light: `llmserve.config` imports the
config module.
"""
