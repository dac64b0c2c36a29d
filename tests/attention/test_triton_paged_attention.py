"""The Triton paged-attention kernel agrees with the reference backend: run by Triton's interpreter on
CPU tensors, or compiled on a GPU with LLMSERVE_TEST_DEVICE=cuda (the values drawn on the CPU alike).

Each case is one step over a paged cache with scrambled block tables: decodes, a speculative verify
span, a prompt chunk over cached context (a prefix hit) and a fresh prompt, in one launch. Unused
slots and blocks that left the window (pointed at one shared block) hold NaN, so a kernel that reads
any of them fails. The oracle is TorchSDPABackend with every sequence as a prefill span.
bfloat16 queries are covered only compiled on a GPU: the interpreter's bfloat16 dot is wrong (its loads
and casts are right, so a bfloat16 cache under float32 queries is covered on the CPU too).
"""

import sys
from types import SimpleNamespace

import pytest
import torch

from tests.triton_interpreter import TEST_DEVICE, triton_loop_bounds, use_interpreter  # noqa: F401

use_interpreter()  # before the kernels are imported: on the CPU they run interpreted

pytest.importorskip("triton", reason="the Triton attention kernel needs triton")

from llmserve.attention.backends.torch_sdpa import TorchSDPABackend  # noqa: E402
from llmserve.attention.backends.triton_paged import TritonPagedBackend  # noqa: E402
from llmserve.attention.kv_format import get_kv_cache_format  # noqa: E402
from llmserve.attention.registry import select_attention_backend  # noqa: E402
from llmserve.attention.window import prefill_context_positions  # noqa: E402
from llmserve.forward_context import AttentionMetadata, PrefillSpan  # noqa: E402
from llmserve.kernels.triton import paged_attention  # noqa: E402

DEVICE = torch.device(TEST_DEVICE)
if DEVICE.type == "cuda" and not torch.cuda.is_available():
    pytest.skip("LLMSERVE_TEST_DEVICE=cuda but this machine has no CUDA device", allow_module_level=True)

# (seq_len, new tokens): decodes, a verify span of 4, a chunk of 30 over 60 cached, a fresh prompt
MIXED = [(1, 1), (17, 1), (100, 1), (50, 4), (90, 30), (12, 12)]
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}
GPU_ONLY = pytest.mark.skipif(
    DEVICE.type == "cpu", reason="the Triton interpreter's bfloat16 dot is wrong; compiled on a GPU only"
)


def paged_case(seqs, heads, kv_heads, head_dim, block, dtype, kv_dtype="auto", cache_dtype=None, **options):
    """(query, key, value, key_cache, value_cache, in-place metadata, reference metadata) of a step in
    which sequence s has seqs[s] = (seq_len, new): its last `new` positions are this step's tokens.
    Drawn on the CPU (the same numbers on every device), then moved to DEVICE."""
    window, sinks = options.get("window", 0), options.get("sinks", 0)
    gen = torch.Generator().manual_seed(options.get("seed", 0))
    fmt = get_kv_cache_format(kv_dtype)
    cache_dtype = cache_dtype or dtype
    max_blocks = max(-(-n // block) for n, _ in seqs)
    num_blocks = len(seqs) * max_blocks + 2
    nan_block = num_blocks - 1
    tables = torch.randperm(num_blocks - 1, generator=gen)[: len(seqs) * max_blocks].view(len(seqs), -1)
    caches = [torch.full((num_blocks * block, kv_heads, head_dim), float("nan")) for _ in range(2)]
    new_rows, slot_mapping, spans, start = ([], []), [], [], 0
    for seq, (n, new) in enumerate(seqs):
        positions = torch.arange(n)
        slots = tables[seq, positions // block] * block + positions % block
        for cache, rows in zip(caches, new_rows, strict=True):
            cache[slots] = torch.randn(n, kv_heads, head_dim, generator=gen)
            rows.append(cache[slots[n - new :]])
        slot_mapping.append(slots[n - new :])
        tables[seq, -(-n // block) :] = nan_block
        first_visible = n - new - window + 1 if window else 0
        tables[seq, -(-sinks // block) : max(first_visible, 0) // block] = nan_block  # left the window
        live = prefill_context_positions(n, new, sinks, window)
        live = positions if live is None else torch.from_numpy(live)
        live_slots = (tables[seq, live // block] * block + live % block).to(DEVICE)
        spans.append(PrefillSpan(start, start + new, live_slots, None if len(live) == n else live.to(DEVICE)))
        start += new
    key, value = (torch.cat(rows) for rows in new_rows)
    if fmt.is_quantized:  # NaN rows quantize to NaN scales: still poison
        caches = [fmt.quantize(cache) for cache in caches]
        key, value = key.to(dtype), value.to(dtype)
    else:
        caches = [cache.to(cache_dtype) for cache in caches]
        key, value = key.to(cache_dtype), value.to(cache_dtype)
    query = torch.randn(start + options.get("pad_rows", 0), heads, head_dim, generator=gen).to(dtype)
    query, key, value, *caches = (tensor.to(DEVICE) for tensor in (query, key, value, *caches))
    common = dict(
        slot_mapping=torch.cat(slot_mapping).to(DEVICE),
        decode_context_slots=None,
        decode_context_mask=None,
        block_size=block,
        sliding_window=window,
        attention_sinks=sinks,
    )
    lens = torch.tensor([n for n, _ in seqs])
    starts = torch.tensor([0, *(new for _, new in seqs)]).cumsum(0)
    in_place = AttentionMetadata(
        num_decode_tokens=start,
        prefills=[],
        decode_block_tables=tables.to(DEVICE),
        decode_seq_lens=lens.to(DEVICE),
        decode_query_starts=starts.to(DEVICE),
        **common,
    )
    reference = AttentionMetadata(num_decode_tokens=0, prefills=spans, **common)
    return query, key, value, *caches, in_place, reference


def run(backend, case, metadata, **options):
    query, key, value, key_cache, value_cache = case[:5]
    scale = query.shape[-1] ** -0.5
    return backend.forward(
        query, key, value, key_cache.clone(), value_cache.clone(), metadata, scale, **options
    )


def assert_matches_reference(case, kv_dtype="auto", num_splits=None, softcap=0.0):
    """The kernel's rows against the reference's (padding rows past the last sequence excluded)."""
    num_rows = case[5].num_decode_tokens
    actual = run(TritonPagedBackend(kv_dtype, num_splits), case, case[5], softcap=softcap)[:num_rows]
    expected = run(TorchSDPABackend(kv_dtype), case, case[6], softcap=softcap)[:num_rows]
    assert actual.dtype == case[0].dtype
    tolerance = TOLERANCE[case[0].dtype]
    torch.testing.assert_close(actual, expected, atol=tolerance, rtol=tolerance)
    return actual


CASES = {  # (heads, kv_heads, head_dim, block, dtype, kv_dtype, window, sinks, softcap)
    "gqa3-f32": (9, 3, 64, 16, torch.float32, "auto", 0, 0, 0.0),
    "gqa4-f16-int8-window-sinks": (8, 2, 128, 32, torch.float16, "int8", 24, 4, 0.0),
    "mha-f32-fp8-softcap": (4, 4, 64, 32, torch.float32, "fp8", 0, 0, 20.0),
    "gqa8-f16-window-softcap": (8, 1, 128, 16, torch.float16, "auto", 32, 0, 30.0),
    "gqa3-bf16-softcap": (9, 3, 64, 16, torch.bfloat16, "auto", 0, 0, 30.0),
    "gqa4-bf16-int8-window-sinks": (8, 2, 128, 32, torch.bfloat16, "int8", 24, 4, 0.0),
}


@pytest.mark.parametrize(
    "name", [pytest.param(name, marks=GPU_ONLY) if "bf16" in name else name for name in CASES]
)
def test_mixed_step_matches_reference(name):
    heads, kv_heads, head_dim, block, dtype, kv_dtype, window, sinks, softcap = CASES[name]
    case = paged_case(MIXED, heads, kv_heads, head_dim, block, dtype, kv_dtype, window=window, sinks=sinks)
    assert_matches_reference(case, kv_dtype, softcap=softcap)


def test_padded_head_dim_bfloat16_cache_and_padding_rows():
    """head_dim 80 (lanes masked up to 128), a bfloat16 cache read by float32 queries, and query rows
    past the last sequence (a padded batch): the sequences' rows are the reference's, and the very
    bits of the same step without the padding (the first rows of the padded query are the same draw)."""
    options = dict(cache_dtype=torch.bfloat16, window=24, sinks=4)
    padded = paged_case(MIXED, 9, 3, 80, 16, torch.float32, pad_rows=5, **options)
    plain = paged_case(MIXED, 9, 3, 80, 16, torch.float32, **options)
    num_rows = plain[5].num_decode_tokens
    assert padded[0].shape[0] == num_rows + 5 and torch.equal(padded[0][:num_rows], plain[0])
    rows = assert_matches_reference(padded)
    assert torch.equal(rows, assert_matches_reference(plain))


@pytest.mark.parametrize(("kv_dtype", "window", "sinks"), [("auto", 0, 0), ("int8", 40, 4)])
def test_split_kv_matches_one_pass(kv_dtype, window, sinks):
    """Decodes and a verify span over long contexts: KV split over programs (3: uneven shares, some
    empty) or not, the same output."""
    seqs = [(300, 1), (70, 1), (260, 3), (5, 1)]
    case = paged_case(seqs, 8, 2, 64, 16, torch.float32, kv_dtype, window=window, sinks=sinks, seed=1)
    one_pass = assert_matches_reference(case, kv_dtype, num_splits=1)
    split = assert_matches_reference(case, kv_dtype, num_splits=3)
    torch.testing.assert_close(split, one_pass, atol=1e-5, rtol=1e-5)


def test_split_kv_chosen_from_shapes_alone():
    """Few programs over long contexts split (a power of two, at most 16); many programs, short
    contexts or long query spans do not."""
    cpu = torch.device("cpu")  # the interpreter counts 8 multiprocessors
    assert paged_attention._num_splits(2, 8192, cpu) == 8
    assert paged_attention._num_splits(1, 1 << 20, cpu) == 16
    assert paged_attention._num_splits(64, 8192, cpu) == 1
    assert paged_attention._num_splits(2, 300, cpu) == 1
    few_rows = paged_attention._tiles(num_tokens=8, num_seqs=4, group=4, head_dim_pad=128)
    assert few_rows == (16, 4, 64, True)
    chunk = paged_attention._tiles(num_tokens=512, num_seqs=4, group=3, head_dim_pad=64)
    assert chunk == (64, 21, 64, False)


def test_auto_selects_triton_on_cuda_soft_capped_models_too(monkeypatch):
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert select_attention_backend("auto", cuda).name == "triton"
    assert select_attention_backend("auto", cuda, "int8", reference_only=True).name == "triton"
    assert select_attention_backend("auto", cpu, reference_only=True).name == "torch"
    with pytest.raises(ValueError, match="cannot soft-cap"):
        select_attention_backend("cpu_paged", cpu, reference_only=True)
    monkeypatch.setitem(sys.modules, "llmserve.kernels.triton.paged_attention", None)  # no triton
    assert select_attention_backend("auto", cuda).name == "torch"


def test_metadata_from_the_model_runner():
    """A mixed step's metadata built by the model runner's InputBuilder.attention_metadata for each
    backend (decodes batched for the reference, every row in place for Triton), through the backends'
    forward."""
    from llmserve.worker.step_inputs import InputBuilder

    window, sinks = 24, 4
    case = paged_case(MIXED, 9, 3, 64, 16, torch.float16, window=window, sinks=sinks)
    tables = case[5].decode_block_tables.cpu().numpy()  # the host arrays the runner is given
    num_new = torch.tensor([new for _, new in MIXED]).numpy()
    seq_lens = case[5].decode_seq_lens.cpu().numpy()
    starts = case[5].decode_query_starts[:-1].cpu().numpy()
    slot_mapping = case[5].slot_mapping.cpu().numpy()
    outputs = []
    for backend in (TorchSDPABackend(), TritonPagedBackend()):
        cache = SimpleNamespace(block_size=16, kv_groups=(), sliding_window=window, attention_sinks=sinks)
        builder = InputBuilder(cache, backend, DEVICE)  # what it reads of the cache config
        metadata = builder.attention_metadata(tables, num_new, seq_lens, starts, slot_mapping)
        assert bool(metadata.prefills) == (backend.max_decode_query_len == 1)
        outputs.append(run(backend, case, metadata))
    torch.testing.assert_close(outputs[1], outputs[0], atol=2e-3, rtol=2e-3)
