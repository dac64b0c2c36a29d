"""Where an all-at-once run's time goes, step by step: the offline engine on a workload file.

    python -m benchmarks.tools.step_split --workload bench_results/mixed-100.jsonl [--model M]

Every request is added at once (greedy, `ignore_eos`, prefix caching off) and the engine is stepped to
the end; each step's shape (the scheduler's StepShape: decode rows, prompt tokens, decode context) and
its measured seconds are kept. It prints the time in steps that carry prompt tokens and in decode-only
steps, a least-squares split of the decode-only steps into a fixed cost per step, a cost per decode
row (the linear layers' work) and a cost per thousand tokens of decode context (attention over the KV
cache), the decode-only steps grouped by batch size, and the run's seconds in each phase of a step
(scheduling, input preparation, the forward pass, the output projection, sampling, the step's output
processing): the host-side share of the run is what the forward and projection leave. `--output`
keeps the steps as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence

import numpy as np

from llmserve.benchmarks.workload import BenchRequest, load_jsonl
from llmserve.config import EngineArgs
from llmserve.engine.llm_engine import LLMEngine
from llmserve.sampling_params import SamplingParams

ROW_GROUPS = ((1, 8), (9, 32), (33, 64), (65, 128), (129, 1 << 30))


def step_phases(engine: LLMEngine) -> dict[str, tuple[object, str]]:
    """Each phase of a step: the object and method the engine calls for it."""
    runner = engine.model_runner
    return {
        "schedule": (engine.scheduler, "schedule"),
        "prepare inputs": (runner, "prepare"),
        "forward": (runner, "_forward"),
        "output projection": (runner.model, "compute_logits"),
        "sample": (runner, "_sample_or_verify"),
        "process outputs": (engine, "_process"),
    }


@contextlib.contextmanager
def timed_phases(engine: LLMEngine) -> Iterator[dict[str, float]]:
    """Seconds spent in each phase while the block runs (instance attributes wrap the methods and are
    removed after, so the engine is as it was)."""
    seconds: dict[str, float] = defaultdict(float)
    wrapped = []
    for name, (owner, method) in step_phases(engine).items():
        inner = getattr(owner, method)

        def timer(*args, _inner=inner, _name=name, **kwargs):
            start = time.perf_counter()
            try:
                return _inner(*args, **kwargs)
            finally:
                seconds[_name] += time.perf_counter() - start

        setattr(owner, method, timer)
        wrapped.append((owner, method))
    try:
        yield seconds
    finally:
        for owner, method in wrapped:
            delattr(owner, method)


def run(
    engine: LLMEngine, requests: Sequence[BenchRequest], phases: dict[str, float] | None = None
) -> tuple[float, list[tuple[int, ...]]]:
    """Seconds for the whole workload and each step's (decode rows, prompt tokens, decode context,
    prefill pairs, microseconds); `phases`, if given, gets each phase's seconds (timed_phases)."""
    engine.model_runner.wait_for_kv_prefault()
    warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.add_request("warm-up", requests[0].prompt_token_ids, warm)
    while engine.has_unfinished_requests():
        engine.step()
    for index, request in enumerate(requests):
        params = SamplingParams(max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True)
        engine.add_request(str(index), request.prompt_token_ids, params)
    steps = []
    with timed_phases(engine) as timed:
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            step_start = time.perf_counter()
            engine.step()
            seconds = time.perf_counter() - step_start
            if engine.last_step is not None:
                steps.append((*engine.last_step.step_shape, round(seconds * 1e6)))
        total = time.perf_counter() - start
    if phases is not None:
        phases.update(timed)
    return total, steps


def split(steps: Sequence[tuple[int, ...]]) -> dict:
    """The decode-only steps' least-squares split (module docstring) and the totals."""
    shapes = np.array(steps, dtype=np.float64).reshape(-1, 5)
    seconds = shapes[:, 4] / 1e6
    decode_only = shapes[:, 1] == 0
    features = np.column_stack(
        [np.ones(int(decode_only.sum())), shapes[decode_only, 0], shapes[decode_only, 2] / 1e3]
    )
    coefficients = np.linalg.lstsq(features, seconds[decode_only], rcond=None)[0]
    parts = (features * coefficients).sum(axis=0)
    groups = []
    for low, high in ROW_GROUPS:
        chosen = decode_only & (shapes[:, 0] >= low) & (shapes[:, 0] <= high)
        if chosen.any():
            groups.append(
                {
                    "rows": f"{low}-{high}" if high < 1 << 30 else f"{low}+",
                    "steps": int(chosen.sum()),
                    "seconds": float(seconds[chosen].sum()),
                    "mean_ms": float(seconds[chosen].mean() * 1e3),
                    "mean_context": float(shapes[chosen, 2].mean()),
                }
            )
    return {
        "steps_with_prompt_tokens": int((~decode_only).sum()),
        "seconds_with_prompt_tokens": float(seconds[~decode_only].sum()),
        "decode_only_steps": int(decode_only.sum()),
        "decode_only_seconds": float(seconds[decode_only].sum()),
        "fixed_ms_per_step": float(coefficients[0] * 1e3),
        "ms_per_row": float(coefficients[1] * 1e3),
        "ms_per_1k_context": float(coefficients[2] * 1e3),
        "decode_seconds_fixed_rows_context": [float(part) for part in parts],
        "by_rows": groups,
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--workload", required=True, help="JSONL file of requests (`llmserve bench workload`)"
    )
    parser.add_argument(
        "--model", default=None, help="GGUF file or HF directory; default: the embedded model"
    )
    parser.add_argument("--output", default=None, help="write the steps and the split here (JSON)")
    args = parser.parse_args(argv)
    engine = LLMEngine(EngineArgs(model=args.model, prefix_caching=False))
    requests = load_jsonl(args.workload, engine.tokenizer)
    phases: dict[str, float] = {}
    total, steps = run(engine, requests, phases)
    tokens = sum(request.prompt_len + request.max_tokens for request in requests)
    result = split(steps)
    print(
        f"{len(requests)} requests, {tokens:,} tokens in {total:.2f} s: "
        f"{tokens / total:,.1f} tok/s, {len(steps)} steps"
    )
    print(
        f"steps with prompt tokens: {result['steps_with_prompt_tokens']}, "
        f"{result['seconds_with_prompt_tokens']:.2f} s; decode-only: {result['decode_only_steps']}, "
        f"{result['decode_only_seconds']:.2f} s"
    )
    fixed, rows, context = result["decode_seconds_fixed_rows_context"]
    print(
        f"decode-only fit: {result['fixed_ms_per_step']:.2f} ms a step + {result['ms_per_row']:.3f} ms a row "
        f"+ {result['ms_per_1k_context']:.3f} ms per 1k context tokens; "
        f"their seconds: {fixed:.2f} / {rows:.2f} / {context:.2f}"
    )
    for group in result["by_rows"]:
        print(
            f"  rows {group['rows']}: {group['steps']} steps, {group['seconds']:.2f} s, "
            f"mean {group['mean_ms']:.1f} ms, mean context {group['mean_context']:,.0f}"
        )
    print(
        "phases (s): "
        + ", ".join(f"{name} {seconds:.2f}" for name, seconds in phases.items())
        + f"; the rest of the steps {total - sum(phases.values()):.2f}"
    )
    if args.output:
        with open(args.output, "w") as out:
            record = {"total_seconds": total, "tokens": tokens, "split": result, "phases": phases}
            json.dump({**record, "steps": steps}, out)


if __name__ == "__main__":
    main()
