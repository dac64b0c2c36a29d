"""`llmserve bench throughput`: offline, naive request-level batching vs the continuous engine."""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
from collections.abc import Callable
from typing import TypeVar

from llmserve.benchmarks.commands.common import (
    add_output_arguments,
    add_workload_arguments,
    load_workload,
    positive_ints,
    save,
)
from llmserve.benchmarks.workload import describe
from llmserve.config import EngineArgs

T = TypeVar("T")


def register(commands) -> None:
    parser = commands.add_parser("throughput", help="offline: naive request-level batching vs continuous")
    parser.add_argument(
        "--naive-batch-sizes",
        type=batch_sizes,
        default=[8, 16, 32],
        help="e.g. 8,16,32; none: the continuous engine only",
    )
    parser.add_argument(
        "--engine-thread",
        action="store_true",
        help="step the engine in a background thread, as `llmserve serve` does (torch's threads and the "
        "OS treat the main thread's work differently: this separates that from the HTTP cost)",
    )
    add_workload_arguments(parser, with_seed=False)
    add_output_arguments(parser)
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(handler=cmd_throughput)


def batch_sizes(text: str) -> list[int]:
    """Naive batch sizes, or "none" for the continuous engine alone."""
    return [] if text.strip().lower() == "none" else positive_ints(text)


def cmd_throughput(args: argparse.Namespace) -> int:
    from llmserve import LLM
    from llmserve.benchmarks.throughput import format_report, plot_throughput, run_throughput, speedup

    engine_args = EngineArgs.from_cli_args(args)
    llm = LLM(**dataclasses.asdict(engine_args))
    llm.engine.model_runner.wait_for_kv_prefault()
    requests = load_workload(args, lambda: llm.tokenizer)
    run = in_thread if args.engine_thread else _call
    continuous, naive = run(run_throughput, llm, requests, args.naive_batch_sizes)
    print(format_report(continuous, naive))
    ratio, best = speedup(continuous, naive) if naive else (None, None)
    payload = {
        "workload": {"file": args.workload, **describe(requests)},
        "engine_args": dataclasses.asdict(engine_args),
        "engine_thread": args.engine_thread,
        # why greedy outputs may differ between batchings (worker/batch_invariance.py); []: they cannot
        "batch_invariance_reasons": list(llm.engine.batch_invariance),
        "results": [r.to_json() for r in (*naive, continuous)],
        "speedup_vs_best_naive": ratio,
        "best_naive": best and best.system,
    }
    save(args, "throughput", payload, llm.engine.config.model.device)
    if args.plot:
        plot_throughput(continuous, naive, args.plot)
    return 0


def _call(function: Callable[..., T], *args) -> T:
    return function(*args)


def in_thread(function: Callable[..., T], *args) -> T:
    """`function(*args)` run in a new thread (its exception re-raised here)."""
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="llmserve-engine") as pool:
        return pool.submit(function, *args).result()
