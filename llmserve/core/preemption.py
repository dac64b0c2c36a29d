"""Choosing how to preempt a request: drop and recompute its KV, or swap it to CPU memory.

`auto` compares two estimates per request:
  recompute ~ computed tokens x 2 x parameters FLOPs / device FLOP rate
  swap      ~ 2 x its KV bytes (out now, back in later) / host-device copy bandwidth
and swaps when that is cheaper and the CPU swap space has room. On a CPU the "copy" is a memcpy
(~10 GB/s against ~0.1 TFLOP/s), so swapping wins for any real sequence; on a GPU with a small model
recomputing short sequences can be cheaper than crossing PCIe. The rates are coarse defaults per
device type; they only need to get the order of magnitude right.
"""

from __future__ import annotations

from dataclasses import dataclass

# device type -> (FLOP/s, host<->device bytes/s)
_DEVICE_RATES = {"cpu": (1e11, 1e10), "cuda": (1e14, 2e10)}


@dataclass(frozen=True)
class PreemptionCosts:
    flops_per_token: float  # 2 x parameter count
    kv_bytes_per_token: int  # K and V, all layers
    device_type: str = "cpu"

    def recompute_seconds(self, num_tokens: int) -> float:
        return (
            num_tokens * self.flops_per_token / _DEVICE_RATES.get(self.device_type, _DEVICE_RATES["cpu"])[0]
        )

    def swap_seconds(self, num_tokens: int) -> float:
        bandwidth = _DEVICE_RATES.get(self.device_type, _DEVICE_RATES["cpu"])[1]
        return 2 * num_tokens * self.kv_bytes_per_token / bandwidth

    def prefer_swap(self, num_computed_tokens: int) -> bool:
        return self.swap_seconds(num_computed_tokens) < self.recompute_seconds(num_computed_tokens)
