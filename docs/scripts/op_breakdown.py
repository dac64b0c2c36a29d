"""Where the time goes, per compiled op and per linear call: wall-clock timers around each.

  python docs/scripts/op_breakdown.py workload   # mixed-100 offline, twice on one LLM (cold, then warm pages)
  python docs/scripts/op_breakdown.py step N     # decode steps of N mixed-100 requests (20 steps)

Every compiled op (llmserve_cpu_ops), every F.linear / oneDNN-packed GEMM call and each layer's
prefill attention (the compiled kernel or PyTorch's SDPA, whichever the backend picks) is wrapped in a
perf_counter pair; the timers cost a few us per call, so "rest" (Python, scheduling, sampling
outside the wrapped ops) is an upper bound. The fused decode stack is switched off (its one C++ call
cannot be timed per op), so decode steps take the module path, ~3 ms slower at 32-86 sequences.
Needs bench_results/mixed-100.jsonl.
"""

import collections
import json
import sys
import time

import torch

import llmserve.attention.kv_format as kv_format
import llmserve.kernels.small_batch_linear as small_batch_linear
import llmserve.models.layers.norm as norm
import llmserve.models.layers.rotary as rotary
import llmserve.models.llama as llama
from llmserve import LLM, SamplingParams
from llmserve.kernels.cpu_ops import load_cpu_ops

spent: collections.Counter = collections.Counter()
calls: collections.Counter = collections.Counter()


def timed(name, function):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        result = function(*args, **kwargs)
        spent[name] += time.perf_counter() - start
        calls[name] += 1
        return result

    return wrapper


class TimedOps:
    def __init__(self, ops) -> None:
        self.ops = ops

    def __getattr__(self, name):
        attribute = getattr(self.ops, name)
        # prefill_attention runs inside the backend's _prefill, timed as a whole below
        wrap = callable(attribute) and not name.endswith("_supported") and name != "prefill_attention"
        return timed(name, attribute) if wrap else attribute


def instrument(engine) -> None:
    # Decode-only steps run inside the fused decode stack's one C++ call, where nothing can be timed
    # per op: the breakdown takes the module path (the same kernels, plus their Python dispatch).
    engine.model_runner.model.model.decode_stack = None
    ops = TimedOps(load_cpu_ops())
    for module in (norm, rotary, llama, kv_format):
        module.cpu_ops_for = lambda tensor: ops if tensor.device.type == "cpu" else None
    small_batch_linear.load_cpu_ops = lambda: ops
    linear = timed("F.linear", torch.nn.functional.linear)
    small_batch_linear.F = type("F", (), {"linear": staticmethod(linear)})
    packed_gemm = timed("packed GEMM", torch.ops.mkldnn._linear_pointwise)
    for layer in engine.model_runner.model.modules():
        packed_types = (small_batch_linear.SmallBatchLinear, small_batch_linear.PackedLinear)
        if isinstance(layer, packed_types) and layer.packed_weight is not None:
            layer.forward = _timed_forward(layer, packed_gemm)
    for module in engine.model_runner.model.modules():
        backend = getattr(module, "backend", None)
        if hasattr(backend, "ops"):
            backend.ops = ops
        if backend is not None and "_prefill" not in vars(backend):  # once per shared backend
            backend._prefill = timed("prefill attention", backend._prefill)


def _timed_forward(layer, packed_gemm):
    """The layer's forward with its packed-weight GEMM timed (the other branches go through timed ops)."""
    plain_forward = layer.forward

    def forward(input):
        many_rows = input.dim() == 2 and input.shape[0] > small_batch_linear.MAX_ROWS
        if many_rows and input.dtype in (torch.bfloat16, torch.float32):
            return packed_gemm(input, layer.packed_weight, layer.bias, "none", [], "")
        return plain_forward(input)

    return forward


def report(seconds: float, steps: int = 1, unit: str = "s", scale: float = 1.0) -> None:
    """Totals per op; with steps > 1, per step (times `scale`, e.g. 1e3 for ms)."""
    for name, value in spent.most_common():
        print(f"  {name:22s} {value * scale / steps:8.2f} {unit}  ({calls[name] / steps:.0f} calls)")
    print(f"  {'rest':22s} {(seconds - sum(spent.values())) * scale / steps:8.2f} {unit}")


def main() -> None:
    with open("bench_results/mixed-100.jsonl") as file:
        requests = [json.loads(line) for line in file]
    if sys.argv[1] == "workload":
        llm = LLM(prefix_caching=False)
        prompts = [r["prompt_token_ids"] for r in requests]
        params = [
            SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True, temperature=0) for r in requests
        ]
        llm.generate(prompts[:4], params[:4], use_tqdm=False)
        instrument(llm.engine)
        for attempt in ("first pass (cold KV pool pages)", "second pass"):
            spent.clear(), calls.clear()
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - start
            tokens = sum(len(p) for p in prompts) + sum(r["max_tokens"] for r in requests)
            print(f"{attempt}: {wall:.2f} s, {tokens / wall:.1f} tok/s")
            report(wall)
    else:
        batch = int(sys.argv[2])
        engine = LLM().engine
        params = SamplingParams(max_tokens=512, ignore_eos=True, temperature=0)
        for index, request in enumerate(requests[:batch]):
            engine.add_request(f"r{index}", request["prompt_token_ids"], params)
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()):
            engine.step()
        for _ in range(3):
            engine.step()
        instrument(engine)
        steps = 20
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = time.perf_counter() - start
        print(f"batch {batch}: {1e3 * wall / steps:.1f} ms per decode step")
        report(wall, steps=steps, unit="ms/step", scale=1e3)


if __name__ == "__main__":
    main()
