"""--kv-cache-dtype int4/int2 (KIVI): the quantizer and its packing against an independent float64 one,
the reference attention's visibility rule (window, sink, quantized blocks) against a float64 model of it,
pool capacity, the combinations refused, and greedy output unchanged by chunking, batching, prefix hits,
preemption and parallel samples."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from llmserve.attention.kv_format import get_kv_cache_format
from llmserve.attention.registry import get_attention_backend
from llmserve.config import CacheConfig, EngineArgs
from llmserve.config.kv_cache_dtype import LOW_BIT_SINK_TOKENS, LOW_BIT_WINDOW_BLOCKS
from llmserve.entrypoints.llm import LLM
from llmserve.model_loader import default_model_path, load_arch_config
from llmserve.sampling_params import SamplingParams
from llmserve.worker.recent_kv import RecentKV
from llmserve.worker.request_state import CachedRequestState
from llmserve.worker.step_inputs import InputBuilder

BLOCK = 32
BITS = {"int4": 4, "int2": 2}


def quantize64(x: np.ndarray, bits: int, axis: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes, scale, minimum) of KIVI's asymmetric quantization along `axis`, in float64, with the
    scale and minimum rounded to float16 as stored (the minimum first, the scale from it)."""
    levels = (1 << bits) - 1
    minimum = x.min(axis=axis, keepdims=True).astype(np.float16).astype(np.float64)
    top = x.max(axis=axis, keepdims=True)
    scale = (
        np.clip((top - minimum) / levels, np.finfo(np.float16).tiny, 65504)
        .astype(np.float16)
        .astype(np.float64)
    )
    # codes rounded from float32 arithmetic, as stored: float64's quotient can fall on the other side of .5
    quotient = (x.astype(np.float32) - minimum.astype(np.float32)) / scale.astype(np.float32)
    codes = np.clip(np.round(quotient), 0, levels).astype(np.float64)
    return codes, scale, minimum


def dequantize64(x: np.ndarray, bits: int, axis: int) -> np.ndarray:
    codes, scale, minimum = quantize64(x, bits, axis)
    return codes * scale + minimum


def key_pairs32(keys: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """(scale, minimum) [heads, d] of a block of keys [block, heads, d] as the format specifies: of each
    channel's range with its low end moved in by a and its high end by b of 2^(bits + 2) parts, a and b
    in 0..3, the first candidate (a-major) with the least squared error, in float32 numpy arithmetic
    one operation at a time (the sums token by token), as stored."""
    x = keys.astype(np.float32)
    levels, tiny = (1 << bits) - 1, np.finfo(np.float16).tiny
    low, high = x.min(axis=0), x.max(axis=0)
    span = high - low
    best = scale = minimum = None
    for a in range(4):
        for b in range(4):
            lo = low + np.float32(a / 2 ** (bits + 2)) * span
            hi = high - np.float32(b / 2 ** (bits + 2)) * span
            m = np.clip(lo, -65504, 65504).astype(np.float16)
            s = np.clip((hi - m.astype(np.float32)) / np.float32(levels), tiny, 65504).astype(np.float16)
            s32, m32 = s.astype(np.float32), m.astype(np.float32)
            error = np.clip(np.round((x - m32) / s32), 0, levels) * s32 + m32 - x
            total = np.zeros_like(low)
            for square in error * error:
                total = total + square
            if best is None:
                best, scale, minimum = total, s, m
            else:
                better = total < best
                best = np.where(better, total, best)
                scale, minimum = np.where(better, s, scale), np.where(better, m, minimum)
    return scale.astype(np.float64), minimum.astype(np.float64)


def key_block64(keys: np.ndarray, bits: int) -> np.ndarray:
    """A block of keys [block, heads, d] as stored: per channel over the block's tokens, each channel's
    pair chosen by key_pairs32, the codes from float32 arithmetic."""
    scale, minimum = key_pairs32(keys, bits)
    quotient = (keys.astype(np.float32) - minimum.astype(np.float32)) / scale.astype(np.float32)
    return np.clip(np.round(quotient), 0, (1 << bits) - 1) * scale + minimum


def values64(values: np.ndarray, bits: int) -> np.ndarray:
    """Value rows [..., d] as stored: per row, in groups of 32 channels."""
    grouped = values.reshape(*values.shape[:-1], -1, 32)
    return dequantize64(grouped, bits, axis=-1).reshape(values.shape)


@pytest.mark.parametrize("name", ["int4", "int2"])
def test_quantizer_and_packing_match_an_independent_float64_one(name):
    fmt, bits = get_kv_cache_format(name), BITS[name]
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(3, BLOCK, 2, 64, generator=generator) * torch.linspace(0.1, 8, 64)  # outlier channels
    values = torch.randn(3, BLOCK, 2, 64, generator=generator)
    packed_keys, packed_values = fmt.quantize_key_blocks(keys), fmt.quantize_values(values)
    assert (
        packed_keys.shape[-1] == packed_values.shape[-1] == 64 * bits // 8 + 8
    )  # codes, then 4 (scale, min) pairs
    # codes from the low bits up: element d at bit (d * bits) % 8 of byte d * bits // 8
    raw = packed_values[..., : 64 * bits // 8].numpy()
    unpacked = np.stack(
        [(raw[..., d * bits // 8] >> ((d * bits) % 8)) & ((1 << bits) - 1) for d in range(64)], -1
    )
    expected_codes = quantize64(values.double().numpy().reshape(3, BLOCK, 2, 2, 32), bits, -1)[0].reshape(
        unpacked.shape
    )
    np.testing.assert_array_equal(unpacked, expected_codes)
    expected_keys = np.stack([key_block64(block, bits) for block in keys.double().numpy()])
    np.testing.assert_allclose(
        fmt.dequantize_key_blocks(packed_keys).numpy(), expected_keys, rtol=0, atol=1e-5
    )
    np.testing.assert_allclose(
        fmt.dequantize_values(packed_values).numpy(), values64(values.double().numpy(), bits), atol=1e-5
    )
    # no channel's squared error above its full range's, and lower where a few tokens stand out
    stored = fmt.dequantize_key_blocks(packed_keys).double().numpy()
    full = np.stack([dequantize64(block, bits, axis=0) for block in keys.double().numpy()])
    stored_error = ((stored - keys.double().numpy()) ** 2).sum(axis=1)
    full_error = ((full - keys.double().numpy()) ** 2).sum(axis=1)
    assert (stored_error <= full_error * (1 + 1e-5) + 1e-9).all()
    assert (stored_error < 0.9 * full_error).mean() > 0.3


@pytest.mark.parametrize(
    ("name", "outlier", "bound"), [("int4", 3.0, 0.95), ("int2", 4.0, 0.8), ("int2", 12.0, 0.8)]
)
def test_a_lone_outlying_key_moves_its_channels_range_in(name, outlier, bound):
    """One token far out in every channel: the block comes back spanning less than its full range, and
    its other 31 keys closer than the full range's pair would bring them."""
    fmt, bits = get_kv_cache_format(name), BITS[name]
    keys = torch.linspace(-1, 1, BLOCK).view(1, BLOCK, 1, 1).repeat(1, 1, 2, 64)
    keys[0, 7] = outlier
    stored = fmt.dequantize_key_blocks(fmt.quantize_key_blocks(keys))[0]
    assert (stored.amax(0) - stored.amin(0) < (outlier + 1) * (1 - 2.0 ** -(bits + 3))).all()  # half a part
    full = torch.from_numpy(dequantize64(keys[0].double().numpy(), bits, axis=0)).float()
    rest = [t for t in range(BLOCK) if t != 7]
    assert ((stored[rest] - keys[0, rest]) ** 2).sum() < bound * ((full[rest] - keys[0, rest]) ** 2).sum()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["int4", "int2"])
def test_compiled_block_quantizer_writes_the_formats_bytes(name, dtype):
    """The pool's writes go through the compiled quantizer on a CPU: byte for byte the format's own
    (torch) quantize_key_blocks and quantize_values, outlier channels, constant groups, an infinite key
    and all."""
    from llmserve.kernels.cpu_ops import load_cpu_ops

    ops = load_cpu_ops()
    assert ops is not None  # every x86-64 level the kernels build for has it
    fmt = get_kv_cache_format(name)
    generator = torch.Generator().manual_seed(2)
    for dim in (64, 128):
        keys = (torch.randn(5, BLOCK, 3, dim, generator=generator) * torch.linspace(0.01, 30, dim)).to(dtype)
        values = torch.randn(5, BLOCK, 3, dim, generator=generator).to(dtype)
        keys[1], values[2] = 0.5, -2.0  # constant groups: the smallest scale
        keys[3, 5, 0, 7] = float("inf")  # an infinite key: its channel's pair stays finite
        key_rows, value_rows = ops.quantize_low_bit_blocks(keys, values, BITS[name])
        assert torch.equal(key_rows, fmt.quantize_key_blocks(keys))
        assert torch.equal(value_rows, fmt.quantize_values(values))


@pytest.mark.parametrize(("backend_name", "group"), [("torch", 3), ("cpu_paged", 3), ("cpu_paged", 20)])
@pytest.mark.parametrize("name", ["int4", "int2"])
def test_attention_reads_window_sinks_and_quantized_blocks_as_specified(
    name, backend_name, group, monkeypatch
):
    """Two sequences fed in uneven steps (prompt chunks crossing blocks, decodes) through the engine's
    input builder, window and backend (the reference, or the compiled kernel for the decodes), against a
    float64 model of what each query must see:
    its first LOW_BIT_SINK_TOKENS positions and those of its incomplete span of LOW_BIT_WINDOW_BLOCKS
    blocks exact, every other position as its block was quantized (a first block without its sinks in
    the ranges)."""
    bits, heads, dim = BITS[name], 3, 64  # 3 KV heads: at one sequence the kernel splits one by query rows
    steps = {"a": [45, 1, 20, 1, 1, 70, 1, 3, 40, 1], "b": [1, 100, 1, 1, 0, 33, 30, 1, 0, 2]}
    total = {rid: sum(counts) for rid, counts in steps.items()}
    generator = torch.Generator().manual_seed(1)
    history = {
        rid: [
            torch.randn(n, heads, dim, generator=generator).double() * (1 + 4 * (torch.arange(dim) % 7 == 0))
            for _ in "kv"
        ]
        for rid, n in total.items()
    }
    queries = {
        rid: torch.randn(n, heads * group, dim, generator=generator).double() for rid, n in total.items()
    }
    num_blocks = 16
    cache = CacheConfig(block_size=BLOCK, num_blocks=num_blocks, kv_cache_memory=1, kv_cache_dtype=name)
    backend = get_attention_backend(backend_name, name)
    kernel_calls = set()
    if backend_name == "cpu_paged":
        assert backend.ops.paged_attention_low_bit_supported(torch.float32, dim)  # AVX2, FMA and F16C
        ops = backend.ops

        def counted(name):
            kernel = getattr(ops, name)
            return lambda *args: kernel_calls.add(name) or kernel(*args)

        kernels = {name: counted(name) for name in ("paged_attention_low_bit", "prefill_attention")}
        monkeypatch.setattr(backend, "ops", SimpleNamespace(**{**vars(ops), **kernels}))
    builder = InputBuilder(cache, backend, torch.device("cpu"))
    layer = SimpleNamespace(num_kv_heads=heads, recent_kv=None)
    builder.recent_kv = RecentKV([layer], BLOCK, dim, torch.float32, torch.device("cpu"), slots=1)  # grows
    row_bytes = get_kv_cache_format(name).row_size(dim)
    key_cache = torch.zeros(num_blocks * BLOCK, heads, row_bytes, dtype=torch.uint8)
    value_cache = torch.zeros_like(key_cache)
    tables = {"a": [3, 9, 1, 12, 5, 7], "b": [2, 0, 8, 15, 11, 4]}
    states = {
        rid: CachedRequestState(
            rid, [7 + i] * total[rid], [7 + i] * total[rid], SamplingParams(), (), None, tables[rid], 0
        )
        for i, rid in enumerate(steps)
    }
    for step in range(len(steps["a"])):
        rows = [(states[rid], steps[rid][step]) for rid in steps if steps[rid][step]]
        inputs = builder.build(rows)
        spans = [
            (r.request_id, r.num_computed_tokens, n) for r, n in sorted(rows, key=lambda row: row[1] > 1)
        ]
        assert [r.request_id for r in inputs.requests] == [rid for rid, _, _ in spans]
        take = lambda parts, spans=spans: torch.cat([parts(rid)[s : s + n] for rid, s, n in spans]).float()  # noqa: E731
        out = backend.forward(
            take(lambda rid: queries[rid]),
            take(lambda rid: history[rid][0]),
            take(lambda rid: history[rid][1]),
            key_cache,
            value_cache,
            inputs.attention,
            dim**-0.5,
            recent=layer.recent_kv,
        )
        expected = torch.cat(
            [
                expected_attention(history[rid], queries[rid], start, n, bits, dim**-0.5)
                for rid, start, n in spans
            ]
        )
        torch.testing.assert_close(
            out.double(), expected, rtol=0, atol=5e-5
        )  # float32 sums; a code off by one: ~1e-2
        for state, n in rows:
            state.num_computed_tokens += n
    # decodes on paged_attention_low_bit, spans on prefill_attention over their dequantized context
    # decodes on paged_attention_low_bit (up to 16 query heads per KV head; more: the reference), spans
    # on prefill_attention over their dequantized context
    expected = {"paged_attention_low_bit", "prefill_attention"} if group <= 16 else {"prefill_attention"}
    assert kernel_calls == (expected if backend_name == "cpu_paged" else set())


def expected_attention(history, queries, start, count, bits, scale) -> torch.Tensor:
    """Queries at positions start .. start + count - 1 of one sequence, as low_bit.py specifies."""
    keys, values = (part.numpy() for part in history)
    out = []
    for p in range(start, start + count):
        span = LOW_BIT_WINDOW_BLOCKS * BLOCK
        window_from = (p + 1) // span * span
        seen_k, seen_v = keys[: p + 1].copy(), values[: p + 1].copy()
        for b in range(window_from // BLOCK if window_from > 0 else 0):
            rows = slice(b * BLOCK, (b + 1) * BLOCK)
            block_k, block_v = keys[rows].copy(), values[rows].copy()
            sinks = LOW_BIT_SINK_TOKENS
            if b == 0:  # the sinks are read from their entry: out of their block's ranges
                block_k[:sinks], block_v[:sinks] = block_k[sinks], block_v[sinks]
            seen_k[rows], seen_v[rows] = key_block64(block_k, bits), values64(block_v, bits)
            if b == 0:
                seen_k[:sinks], seen_v[:sinks] = keys[:sinks], values[:sinks]
        group = queries.shape[1] // keys.shape[1]
        k = np.repeat(seen_k, group, axis=1)  # [p + 1, heads, d]
        v = np.repeat(seen_v, group, axis=1)
        scores = np.einsum("hd,thd->ht", queries[p].numpy(), k) * scale
        probs = np.exp(scores - scores.max(axis=1, keepdims=True))
        probs /= probs.sum(axis=1, keepdims=True)
        out.append(torch.from_numpy(np.einsum("ht,thd->hd", probs, v)))
    return torch.stack(out)


def test_sink_entries_live_with_their_first_block_and_a_failed_step_drops_its_own():
    layer = SimpleNamespace(num_kv_heads=1, recent_kv=None)
    recent = RecentKV([layer], BLOCK, 64, torch.float32, torch.device("cpu"), slots=1)
    entries, made = recent.sink_entries([5, 7])
    assert made.all() and entries[0] != entries[1]
    again, made = recent.sink_entries([7, 5])  # a prefix hit sharing those first blocks
    assert not made.any() and list(again) == [entries[1], entries[0]]
    recent.drop_sinks([5])  # block 5 quantized again: reused by another sequence
    assert recent.sink_entries([5])[1].all() and not recent.sink_entries([7])[1].any()
    _, made = recent.sink_entries([9])
    recent.forget_step()  # that step failed: block 9's entry may be partly written
    assert recent.sink_entries([9])[1].all() and not recent.sink_entries([7])[1].any()
    many, _ = recent.sink_entries(range(100, 120))  # grows, and gives the layer the new tensors
    assert len(set(many.tolist())) == 20 and layer.recent_kv[2].data_ptr() == recent.sinks[0, 0].data_ptr()


@pytest.fixture(scope="module")
def smollm2_arch():
    return load_arch_config(default_model_path())


@pytest.mark.parametrize(("name", "ratio"), [("int4", 128 / 40), ("int2", 128 / 24)])
def test_pool_holds_3_2x_and_5_3x_the_tokens_of_bf16(name, ratio, smollm2_arch):
    def cache(kv_cache_dtype):
        args = EngineArgs(
            dtype="bfloat16", device="cpu", kv_cache_memory="1GiB", kv_cache_dtype=kv_cache_dtype
        )
        return args.create_config(smollm2_arch, "unused").cache

    bf16, low = cache("auto"), cache(name)
    assert low.block_size == BLOCK
    assert low.num_blocks == 2**30 // (2 * 30 * 3 * (64 * BITS[name] // 8 + 8) * BLOCK)
    assert abs(low.num_blocks / bf16.num_blocks - ratio) < 0.01


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(block_size=16), "block_size must be 32"),
        (dict(speculative_method="ngram", num_speculative_tokens=2), "speculative decoding"),
        (dict(sliding_window=64), "sliding window"),
        (dict(kv_transfer_config='{"kv_connector": "gloo", "kv_role": "kv_producer"}'), "kv-transfer-config"),
        (dict(kv_offloading_size=1), "kv-offloading-size"),
        (dict(preemption_mode="swap"), "preemption-mode swap"),
    ],
)
def test_combinations_not_supported_yet_are_one_line_errors(options, message, smollm2_arch):
    with pytest.raises(ValueError, match=message):
        EngineArgs(device="cpu", kv_cache_dtype="int4", **options).create_config(smollm2_arch, "unused")


def test_auto_takes_the_compiled_kernel_on_a_cpu_and_triton_refuses_low_bit_caches():
    from llmserve.attention.registry import select_attention_backend

    assert select_attention_backend("auto", torch.device("cpu"), "int2").name == "cpu_paged"
    with pytest.raises(ValueError, match="does not read int4 KV caches"):
        select_attention_backend("triton", torch.device("cpu"), "int4")


@pytest.fixture(scope="module")
def tiny(tiny_head32):
    return tiny_head32


PROMPTS = [
    list(range(start, start + length)) for start, length in ((100, 5), (900, 70), (3000, 140), (7000, 33))
]
GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


def generate(model, prompts=PROMPTS, params=GREEDY, one_at_a_time=False, **engine_args):
    llm = LLM(model=model, dtype="float32", **engine_args)
    if one_at_a_time:
        outputs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    else:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs], llm


@pytest.mark.parametrize("name", ["int4", "int2"])
def test_greedy_output_is_the_same_chunked_batched_prefix_cached_and_preempted(tiny, name):
    """Preempted: a pool of 9 blocks, where blocks (first blocks too) are reused while their sequences
    wait, and come back as prefix hits or are recomputed."""
    plain, _ = generate(tiny, kv_cache_dtype=name, one_at_a_time=True)
    batched, _ = generate(tiny, kv_cache_dtype=name)
    chunked, _ = generate(tiny, kv_cache_dtype=name, max_num_batched_tokens=48)
    assert batched == plain and chunked == plain
    llm = LLM(model=tiny, dtype="float32", kv_cache_dtype=name)
    llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    again = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert llm.engine.kv_cache_manager.prefix_cache_hits > 0
    assert again == plain
    cramped, small = generate(tiny, kv_cache_dtype=name, num_kv_blocks=9)  # auto: recompute
    assert small.engine.scheduler.preemptions_by_mode["recompute"] > 0
    assert cramped == plain


def test_parallel_samples_share_whole_blocks_and_keep_their_streams(tiny):
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=3, n=2, ignore_eos=True)
    alone = [
        generate(
            tiny,
            prompts=[p],
            params=SamplingParams(max_tokens=12, temperature=0.8, seed=3, ignore_eos=True),
            kv_cache_dtype="int4",
        )[0][0]
        for p in PROMPTS
    ]
    llm = LLM(model=tiny, dtype="float32", kv_cache_dtype="int4")
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == alone
    assert all(len(o.outputs) == 2 for o in outputs)


@pytest.mark.parametrize(("name", "bound"), [("int4", 0.9), ("int2", 0.7)])
def test_greedy_tokens_mostly_equal_the_float_cache(tiny, name, bound):
    """Teacher-forced agreement with the float cache along its greedy continuations (see the int8 test)."""
    reference, _ = generate(tiny)
    prefixes = [p + r[:i] for p, r in zip(PROMPTS, reference, strict=True) for i in range(len(r))]
    quantized, _ = generate(
        tiny, prompts=prefixes, params=SamplingParams(max_tokens=1, temperature=0), kv_cache_dtype=name
    )
    expected = [token for r in reference for token in r]
    agreement = sum(q == [e] for q, e in zip(quantized, expected, strict=True)) / len(expected)
    assert agreement >= bound, agreement
