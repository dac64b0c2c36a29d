"""Batch-1 latency: prefill speed by prompt length, decode time per token, and the hardware bounds.

At batch 1 every decode step reads every weight once, so ms/token cannot beat weight bytes over
memory bandwidth; the measured decode time divided by that floor is how far the engine is from the
hardware. Large-batch throughput is bounded instead by compute: a token costs about 2 FLOPs per
parameter, so matmul FLOP/s over 2 x parameters is the most tokens/s any batching can reach.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np
import torch
from torch import nn

from llmserve.benchmarks.results import format_table, pyplot, save_figure
from llmserve.benchmarks.workload import TokenCorpus, greedy_params
from llmserve.quantization.embedding import lookup_blocks
from llmserve.quantization.kernels import QuantizedLinear

COLUMNS = ("prompt_len", "prefill_ms", "prefill_tok_s", "decode_ms_per_token", "decode_tok_s")


@dataclass(frozen=True)
class LatencyPoint:
    prompt_len: int
    prefill_seconds: float  # request added -> first token out (median of repeats)
    decode_seconds_per_token: float  # first token -> last token, per token (median of repeats)

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_len / self.prefill_seconds

    def to_json(self) -> dict:
        return {
            **asdict(self),
            "prefill_ms": 1e3 * self.prefill_seconds,
            "prefill_tok_s": self.prefill_tok_s,
            "decode_ms_per_token": 1e3 * self.decode_seconds_per_token,
            "decode_tok_s": 1.0 / self.decode_seconds_per_token,
        }


@dataclass(frozen=True)
class HardwareBounds:
    num_parameters: int
    weight_bytes: int
    copy_bandwidth: float  # bytes/s, read and write both counted
    matmul_flops: float  # FLOP/s of a square matmul in the model dtype
    # bytes/s of a streaming read (a sum): decode only reads its weights, and on some machines the copy
    # above swings from run to run while reads and decode do not
    read_bandwidth: float | None = None

    @property
    def floor_ms_per_token(self) -> float:
        """Batch-1 decode cannot be faster than reading all the weights once."""
        return 1e3 * self.weight_bytes / self.copy_bandwidth

    @property
    def read_floor_ms_per_token(self) -> float | None:
        """The same floor at the streaming-read bandwidth."""
        return None if not self.read_bandwidth else 1e3 * self.weight_bytes / self.read_bandwidth

    @property
    def compute_ceiling_tok_s(self) -> float:
        """No batch size can produce tokens faster than the FLOPs allow."""
        return self.matmul_flops / (2 * self.num_parameters)

    def to_json(self) -> dict:
        return {
            **asdict(self),
            "copy_bandwidth_gb_s": self.copy_bandwidth / 1e9,
            "matmul_gflop_s": self.matmul_flops / 1e9,
            "floor_ms_per_token": self.floor_ms_per_token,
            "read_floor_ms_per_token": self.read_floor_ms_per_token,
            "compute_ceiling_tok_s": self.compute_ceiling_tok_s,
        }


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_seconds(run: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Fastest of `repeats` timed runs after one untimed one (the best run is the least disturbed)."""
    run()
    synchronize(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return min(times)


def measure_copy_bandwidth(device: torch.device, num_bytes: int = 512 * 2**20, repeats: int = 5) -> float:
    """Bytes/s of a large device-to-device copy, counting the read and the write."""
    source = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
    target = torch.empty_like(source)
    seconds = best_seconds(lambda: target.copy_(source), device, repeats)
    return 2 * source.numel() * source.element_size() / seconds


def measure_read_bandwidth(device: torch.device, num_bytes: int = 512 * 2**20, repeats: int = 5) -> float:
    """Bytes/s of a streaming read of a large buffer (a sum, whose result is one number)."""
    source = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
    seconds = best_seconds(lambda: source.sum(), device, repeats)
    return source.numel() * source.element_size() / seconds


def measure_matmul_flops(
    dtype: torch.dtype, device: torch.device, size: int = 2048, repeats: int = 5
) -> float:
    """FLOP/s of a size x size @ size x size matmul (2 size^3 FLOPs), the size cut to what one product
    does in about a tenth of a second at the rate a small one measures (torch's bf16 GEMM at the AVX2
    level takes a minute at 2,048: a ceiling measurement, not a benchmark of its own)."""
    probe = min(size, _PROBE_SIZE)
    a = torch.randn(probe, probe, device=device).to(dtype)
    rate = 2 * probe**3 / best_seconds(lambda: torch.mm(a, a), device, 1)
    size = min(size, max(probe, int((rate * _MATMUL_SECONDS / 2) ** (1 / 3))))
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    return 2 * size**3 / best_seconds(lambda: torch.mm(a, b), device, repeats)


_PROBE_SIZE = 256
_MATMUL_SECONDS = 0.1  # the ceiling's product takes about this long (or is the size asked for)


def model_size(model: nn.Module) -> tuple[int, int]:
    """Weight count and the bytes one batch-1 decode step reads: the float weights of every layer
    but an untied embedding table (a step reads one row of it; a tied one is the output projection,
    read whole, and counted once), and each quantized layer's codes and scales (its small-batch copy
    where it keeps one, the layout the 1-8 row kernels stream), and a float layer's packed copy in
    place of its weight (which it may have freed), so the floor holds for any mode."""
    packed = {id(m.small_batch_weight): m for m in model.modules() if _packed_copy(m) is not None}
    read_packed = {id(m.weight) for m in packed.values() if m.weight is not None}
    lookups = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    products = {
        id(p) for m in model.modules() if not isinstance(m, nn.Embedding) for p in m.parameters(recurse=False)
    }
    parameters = [
        p
        for p in model.parameters()
        if (id(p) not in lookups or id(p) in products) and id(p) not in read_packed
    ]
    count = sum(p.numel() for p in parameters) + sum(m.in_features * m.out_features for m in packed.values())
    num_bytes = sum(p.numel() * p.element_size() for p in parameters)
    num_bytes += sum(_packed_copy(m).numel() * _packed_copy(m).element_size() for m in packed.values())
    lookups_only = lookup_blocks(model)  # an untied embedding's own blocks: a row a step
    for module in model.modules():
        if isinstance(module, QuantizedLinear) and id(module) not in lookups_only:
            count += module.in_features * module.out_features
            num_bytes += sum(b.numel() * b.element_size() for b in _decode_buffers(module.kernel))
    return count, num_bytes


def _packed_copy(module: nn.Module) -> torch.Tensor | None:
    """A float layer's small-batch copy, the one its batch-1 kernel streams (None: it has none)."""
    if isinstance(module, nn.Linear):
        return getattr(module, "small_batch_weight", None)
    return None


def _decode_buffers(kernel: nn.Module) -> list[torch.Tensor]:
    """What a decode step reads of a quantized layer's kernel (a stacked layer's: each part's)."""
    parts = getattr(kernel, "parts", None)
    if parts is not None:
        return [buffer for part in parts for buffer in _decode_buffers(part)]
    buffers = {name: b for name, b in kernel.named_buffers(recurse=False) if b is not None and name != "bias"}
    small_batch = {
        name: b for name, b in buffers.items() if name.startswith("small_batch_") or name == "scales_float"
    }
    return list(small_batch.values() or buffers.values())


def measure_bounds(
    model: nn.Module, device: torch.device, copy_bytes: int, matmul_size: int, repeats: int
) -> HardwareBounds:
    num_parameters, weight_bytes = model_size(model)
    dtype = next(model.parameters()).dtype
    return HardwareBounds(
        num_parameters=num_parameters,
        weight_bytes=weight_bytes,
        copy_bandwidth=measure_copy_bandwidth(device, copy_bytes, repeats),
        matmul_flops=measure_matmul_flops(dtype, device, matmul_size, repeats),
        read_bandwidth=measure_read_bandwidth(device, copy_bytes, repeats),
    )


def time_request(engine, request_id: str, prompt_ids: list[int], decode_tokens: int) -> tuple[float, float]:
    """(seconds to the first token, seconds per token after it) of one request alone in the engine."""
    start = time.perf_counter()
    engine.add_request(request_id, prompt_ids, greedy_params(decode_tokens + 1))
    first_token = None
    while engine.has_unfinished_requests():
        outputs = engine.step()
        if first_token is None and any(o.outputs and o.outputs[0].token_ids for o in outputs):
            first_token = time.perf_counter()
    return first_token - start, (time.perf_counter() - first_token) / decode_tokens


def run_latency(
    engine,
    corpus: TokenCorpus,
    prompt_lengths: Sequence[int],
    decode_tokens: int,
    repeats: int,
    seed: int = 0,
    progress=None,
) -> list[LatencyPoint]:
    """Median prefill and decode times at each prompt length, a fresh corpus window per repeat."""
    if decode_tokens < 1 or repeats < 1:
        raise ValueError("decode tokens and repeats must be >= 1")
    rng = np.random.default_rng(seed)
    time_request(engine, "latency-warmup", corpus.window_ids(rng, 8), 2)
    points = []
    for prompt_len in prompt_lengths:
        runs = []
        for repeat in range(repeats):
            prompt_ids = corpus.window_ids(rng, prompt_len)
            runs.append(time_request(engine, f"latency-{prompt_len}-{repeat}", prompt_ids, decode_tokens))
            if progress is not None:
                progress.update(1)
        prefill, decode = zip(*runs, strict=True)
        points.append(LatencyPoint(prompt_len, statistics.median(prefill), statistics.median(decode)))
    return points


def format_report(points: Sequence[LatencyPoint], bounds: HardwareBounds) -> str:
    slowest_decode = max(p.decode_seconds_per_token for p in points)
    fastest_decode = min(p.decode_seconds_per_token for p in points)
    return "\n".join([
        format_table([p.to_json() for p in points], COLUMNS),
        f"weights: {bounds.num_parameters / 1e6:.1f} M parameters, {bounds.weight_bytes / 2**20:.1f} MiB",
        f"copy bandwidth {bounds.copy_bandwidth / 1e9:.1f} GB/s -> batch-1 floor "
        f"{bounds.floor_ms_per_token:.3f} ms/token; measured decode is "
        f"{1e3 * fastest_decode / bounds.floor_ms_per_token:.1f}x-"
        f"{1e3 * slowest_decode / bounds.floor_ms_per_token:.1f}x the floor",
        *(
            [
                f"read bandwidth {bounds.read_bandwidth / 1e9:.1f} GB/s -> read floor "
                f"{bounds.read_floor_ms_per_token:.3f} ms/token; measured decode is "
                f"{1e3 * fastest_decode / bounds.read_floor_ms_per_token:.1f}x-"
                f"{1e3 * slowest_decode / bounds.read_floor_ms_per_token:.1f}x of it"
            ]
            if bounds.read_bandwidth
            else []
        ),
        f"matmul {bounds.matmul_flops / 1e9:.1f} GFLOP/s -> compute ceiling "
        f"{bounds.compute_ceiling_tok_s:,.0f} tokens/s at any batch size",
    ])  # fmt: skip


def plot_latency(points: Sequence[LatencyPoint], bounds: HardwareBounds, path) -> None:
    plt = pyplot()
    lengths = [p.prompt_len for p in points]
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(lengths, [p.prefill_tok_s for p in points], marker="o")
    left.axhline(bounds.compute_ceiling_tok_s, color="tab:red", linestyle="--", label="compute ceiling")
    left.set(yscale="log", xlabel="prompt tokens", ylabel="prefill tokens / s", title="prefill (batch 1)")
    left.legend()
    right.plot(lengths, [1e3 * p.decode_seconds_per_token for p in points], marker="o", label="measured")
    right.axhline(bounds.floor_ms_per_token, color="tab:red", linestyle="--", label="bandwidth floor")
    right.set(xlabel="prompt tokens", ylabel="ms / token", title="decode (batch 1)")
    right.set_ylim(bottom=0)
    right.legend()
    for axis in (left, right):
        axis.set_xscale("log")
        axis.set_xticks(lengths, [str(n) for n in lengths])
        axis.minorticks_off()
    save_figure(figure, path)
