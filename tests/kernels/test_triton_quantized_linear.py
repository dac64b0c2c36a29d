"""The Triton quantized linear layer (the CUDA path, kernels/triton/quantized_linear.py) against a float64
product with the format's own dequantized weight: run by the Triton interpreter on CPU tensors, or compiled
on a GPU with LLMSERVE_TEST_DEVICE=cuda (the values drawn on the CPU alike). Then the layer that holds it
(quantization/kernels.py TritonKernel) and a GGUF model served on it, greedy and logits as the float
weights give them."""

import pytest

from tests.triton_interpreter import TEST_DEVICE, triton_loop_bounds, use_interpreter  # noqa: F401

use_interpreter()  # before the kernels are imported: on the CPU they run interpreted

pytest.importorskip("triton", reason="the Triton kernels need triton")

import torch  # noqa: E402

from llmserve import LLM, SamplingParams  # noqa: E402
from llmserve.kernels.triton import quantized_linear as ql  # noqa: E402
from llmserve.quantization import kernels  # noqa: E402
from llmserve.quantization.formats import Int4Weight, Int8Weight, quantize_int4, quantize_int8  # noqa: E402
from tests.e2e.conftest import teacher_forced_logits  # noqa: E402

DEVICE = torch.device(TEST_DEVICE)
if DEVICE.type == "cuda" and not torch.cuda.is_available():
    pytest.skip("LLMSERVE_TEST_DEVICE=cuda but this machine has no CUDA device", allow_module_level=True)

BF16_ON_GPU = pytest.mark.skipif(
    DEVICE.type == "cpu", reason="the Triton interpreter's bfloat16 dot is wrong; compiled on a GPU only"
)
DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=BF16_ON_GPU)]
# the product of x and W rounded to x's dtype, then rounded once more as the output is stored
TOLERANCE = {
    torch.float32: {"atol": 1e-4, "rtol": 1e-5},
    torch.float16: {"atol": 2e-2, "rtol": 2e-3},
    torch.bfloat16: {"atol": 1e-1, "rtol": 1e-2},
}


def weight_of(kind: str, rows: int, cols: int, group: int, seed: int = 0):
    """A format's weight: RTN int8 or int4 of a random matrix; `int5`: random 5-bit codes under int4's
    scales and offsets (GGUF Q5_0/Q5_K's form)."""
    gen = torch.Generator().manual_seed(seed)
    dense = torch.randn(rows, cols, generator=gen)
    if kind == "int8":
        return quantize_int8(dense, group)
    weight = quantize_int4(dense, group)
    if kind == "int5":
        codes = torch.randint(0, 32, weight.shape, generator=gen, dtype=torch.uint8)
        return Int4Weight(codes, weight.scales, weight.offsets, group, bits=5)
    return weight


def layout(weight):
    """(codes, fifths, scales, offsets) as quantized_linear takes them, on DEVICE."""
    if isinstance(weight, Int8Weight):
        parts = (weight.qweight, None, weight.scales, None)
    else:
        parts = (*ql.pack_int4(weight.qweight, weight.bits), weight.scales, weight.offsets)
    return [None if part is None else part.to(DEVICE) for part in parts]


def reference(x: torch.Tensor, weight, dtype: torch.dtype) -> torch.Tensor:
    """x W^T in float64, W the format's float32 weight rounded once to x's dtype (what a tile holds)."""
    return x.double() @ weight.dequantize(torch.float32).to(dtype).double().T


@pytest.mark.parametrize("kind", ["int4", "int5"])
def test_packing_round_trips(kind):
    weight = weight_of(kind, 24, 96, 32)
    nibbles, fifths = ql.pack_int4(weight.qweight, weight.bits)
    assert nibbles.shape == (24, 48) and nibbles.dtype == torch.uint8
    assert (fifths is None) == (kind == "int4")
    if fifths is not None:
        assert fifths.shape == (24, 12)
    assert torch.equal(ql.unpack_int4(nibbles, fifths), weight.qweight)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("kind", "group", "in_features"),
    [
        ("int8", 32, 160),
        ("int8", 16, 160),
        ("int8", None, 160),
        ("int4", 32, 160),
        ("int4", 128, 384),
        ("int5", 32, 160),
    ],
    ids=["int8-g32", "int8-g16", "int8-channel", "int4-g32", "int4-g128", "int5-g32"],
)
@pytest.mark.parametrize("rows", [1, 7, 70])
def test_the_product_is_the_formats_weights(dtype, kind, group, in_features, rows):
    """Row counts of one, part of and more than one tile; 72 outputs (a tile and a part); 160 inputs,
    not a multiple of a loop step (masked tails)."""
    out_features = 72
    group = group or in_features
    weight = weight_of(kind, out_features, in_features, group)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(1)).to(dtype)
    out = ql.quantized_linear(x.to(DEVICE), *layout(weight), group, weight.bits)
    assert out.dtype == dtype and out.shape == (rows, out_features)
    torch.testing.assert_close(out.cpu().double(), reference(x, weight, dtype), **TOLERANCE[dtype])


@pytest.mark.parametrize("kind", ["int8", "int4", "int5"])
def test_a_split_k_range_sums_its_parts(kind, monkeypatch):
    """One row over few outputs and a long K: the grid splits K (the decode shape on a large device),
    the last part shorter than the others and ending inside a loop step, and the parts' float32 sums
    add up to the product."""
    cols = 2016  # 63 groups of 32
    weight = weight_of(kind, 40, cols, 32)
    launched = []
    kernel = ql._quantized_matmul_kernel
    monkeypatch.setattr(ql, "_quantized_matmul_kernel", _Recording(kernel, launched))
    x = torch.randn(1, cols, generator=torch.Generator().manual_seed(2))
    out = ql.quantized_linear(x.to(DEVICE), *layout(weight), 32, weight.bits)
    ((grid, k_per_split),) = launched
    assert grid[2] > 1 and cols % k_per_split and k_per_split % ql._BLOCK_K[weight.bits] == 0
    torch.testing.assert_close(out.cpu().double(), reference(x, weight, torch.float32), atol=1e-3, rtol=1e-5)


class _Recording:
    """The kernel, its launches' grids and K parts noted."""

    def __init__(self, kernel, launched: list) -> None:
        self.kernel, self.launched = kernel, launched

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launched.append((grid, args[12]))  # k_per_split
            return self.kernel[grid](*args, **kwargs)

        return launch


def test_no_rows_give_no_rows():
    weight = weight_of("int4", 8, 64, 32)
    kernel = kernels.TritonKernel(kernels._to_device(weight, DEVICE), torch.float32)
    assert kernel(torch.zeros(0, 64, device=DEVICE)).shape == (0, 8)
    assert kernel(torch.zeros(2, 0, 64, device=DEVICE)).shape == (2, 0, 8)


@pytest.mark.parametrize("dtype", [torch.float16, pytest.param(torch.bfloat16, marks=BF16_ON_GPU)])
def test_float32_out_is_the_unrounded_sums(dtype):
    """The output projection's logits: the float32 accumulators, not the product rounded to x's dtype."""
    weight = weight_of("int8", 72, 160, 160)
    x = torch.randn(3, 160, generator=torch.Generator().manual_seed(3)).to(dtype)
    out = ql.quantized_linear(x.to(DEVICE), *layout(weight), 160, 8, out_dtype=torch.float32)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.cpu().double(), reference(x, weight, dtype), atol=1e-4, rtol=1e-5)
    assert not torch.equal(out.cpu(), out.cpu().to(dtype).float())  # values a float16 cannot hold


def test_shapes_that_do_not_fit_are_refused():
    weight = weight_of("int4", 8, 64, 32)
    x = torch.zeros(2, 64, device=DEVICE)
    codes, fifths, scales, offsets = layout(weight)
    with pytest.raises(ValueError, match="do not fit K 96"):
        ql.quantized_linear(torch.zeros(2, 96, device=DEVICE), codes, fifths, scales, offsets, 32, 4)
    with pytest.raises(ValueError, match=r"codes \(8, 64\) do not fit"):
        ql.quantized_linear(x, codes.repeat(1, 2), fifths, scales, offsets, 32, 4)
    with pytest.raises(ValueError, match="rows contiguous"):
        ql.quantized_linear(x.t(), codes, fifths, scales, offsets, 32, 4)


# -- the layer: TritonKernel ------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["int8", "int4", "int5"])
def test_the_layer_holds_its_codes_size_and_gives_its_weight_back(kind):
    """Nibbles (and a plane of fifth bits) for int4, float16 parameters where exact; `dequantize` and
    `weight_rows` give the format's float32 weight bit for bit; forward multiplies by it."""
    weight = weight_of(kind, 72, 160, 32)
    if kind == "int5":  # a GGUF's: float16 d, offset -16 d
        scales = weight.scales.half().float()
        weight = Int4Weight(weight.qweight, scales, -16 * scales, 32, bits=5)
    kernel = kernels.TritonKernel(kernels._to_device(weight, DEVICE), torch.float32)
    code_bytes = {"int8": 72 * 160, "int4": 72 * 80, "int5": 72 * 80 + 72 * 20}[kind]
    assert (
        sum(t.numel() * t.element_size() for n, t in kernel.named_buffers() if n in ("codes", "fifths"))
        == code_bytes
    )
    assert kernel.scales.dtype == (torch.float16 if kind == "int5" else torch.float32)
    assert torch.equal(kernel.dequantize(torch.float32).cpu(), weight.dequantize(torch.float32))
    index = torch.tensor([[5, 71, 0], [5, 33, 64]])
    rows = kernel.weight_rows(index.to(DEVICE)).cpu()
    assert torch.equal(rows, weight.dequantize(torch.float32)[index])
    x = torch.randn(2, 3, 160, generator=torch.Generator().manual_seed(4))
    out = kernel(x.to(DEVICE)).cpu()
    assert out.shape == (2, 3, 72)
    torch.testing.assert_close(
        out.double(), reference(x.view(6, 160), weight, torch.float32).view(2, 3, 72), atol=1e-4, rtol=1e-5
    )


def test_cuda_selects_the_triton_layer():
    """On CUDA every format whose codes fill whole bytes takes the Triton layer, in every float dtype
    (it never falls back to rebuilding W each call)."""
    cuda = torch.device("cuda")
    for weight in (weight_of("int8", 8, 64, 16), weight_of("int4", 8, 64, 64), weight_of("int5", 8, 64, 32)):
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            assert kernels.TritonKernel.serves(weight, dtype, cuda)
            assert not kernels.TritonKernel.serves(weight, dtype, torch.device("cpu"))
    assert not kernels.TritonKernel.serves(weight_of("int8", 8, 36, 36), torch.float16, cuda)  # K % 8
    if DEVICE.type == "cuda":
        assert isinstance(
            kernels.select_kernel(weight_of("int4", 8, 64, 32), torch.bfloat16, cuda), kernels.TritonKernel
        )


# -- a GGUF model on it -----------------------------------------------------------------------------


def test_a_gguf_model_on_the_triton_layers_gives_the_float_weights_logits_and_tokens(tmp_path, monkeypatch):
    """A tied tiny Llama written with Q4_1, Q5_0 and Q8_0 blocks (the embedding read from the head's
    Q8_0 codes; a q/k/v of two formats) served with `--quantization gguf` twice, float32: every
    quantized layer on the Triton layer (interpreted here, as CUDA would pick it), then on the
    format's float weights rebuilt each call. Teacher-forced logits agree to float32 summation
    order; greedy tokens are equal."""
    pytest.importorskip("gguf", reason="writing the GGUF needs the gguf package (not on the device)")
    from tests.quantization.test_quantized_embedding import ENGINE, VOCAB, Q, write_tied_gguf

    monkeypatch.setenv("LLMSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = str(tmp_path / "tied.gguf")
    write_tied_gguf(path, Q.Q8_0, Q.Q4_1, {"blk.0.attn_q.weight": Q.Q5_0, "blk.1.ffn_down.weight": Q.Q8_0})
    prompt = torch.randint(3, VOCAB, (20,), generator=torch.Generator().manual_seed(1)).tolist()

    def run(kernel_cls):
        monkeypatch.setattr(kernels, "_KERNELS", [(lambda w, d, dev: True, kernel_cls)])
        llm = LLM(path, dtype="float32", device=TEST_DEVICE, **ENGINE)
        try:
            model = llm.engine.model_runner.model
            chosen = {type(m) for m in model.modules() if isinstance(m, kernels.LinearKernel)}
            logits = teacher_forced_logits(llm, prompt)
            params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
            (output,) = llm.generate([prompt[:7]], params, use_tqdm=False)
            return chosen, logits.cpu(), output.outputs[0].token_ids
        finally:
            llm.shutdown()

    chosen, logits, tokens = run(kernels.TritonKernel)
    # layer 0's Q5_0 q beside Q4_1 k and v: two parts, each on the Triton layer
    assert chosen == {kernels.TritonKernel, kernels.StackedKernel}
    _, float_logits, float_tokens = run(kernels.DequantizeKernel)
    torch.testing.assert_close(logits, float_logits, atol=1e-4, rtol=1e-4)
    assert tokens == float_tokens
