"""`llmserve bench memory`: how many sequences of a workload a KV budget holds, paged vs contiguous
allocation; with --live, the engine run at that budget."""

from __future__ import annotations

import argparse
import dataclasses

from tqdm.auto import tqdm

from llmserve.benchmarks import results as result_files
from llmserve.benchmarks.commands.common import (
    add_output_arguments,
    add_workload_arguments,
    load_workload,
    save,
)
from llmserve.benchmarks.workload import BenchRequest, describe
from llmserve.config import EngineArgs


def register(commands) -> None:
    parser = commands.add_parser("memory", help="sequences that fit a KV budget: paged vs contiguous")
    parser.add_argument("--live", action="store_true", help="also run the engine at that budget, sampling it")
    parser.add_argument("--live-requests", type=int, default=200, help="the first N requests run live")
    add_workload_arguments(parser, with_seed=False)
    add_output_arguments(parser)
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(handler=cmd_memory, kv_cache_memory="256MiB")
    # Enough requests to fill the default budget several times over.
    parser.set_defaults(num_requests=1000)


def cmd_memory(args: argparse.Namespace) -> int:
    from llmserve.benchmarks.memory import plot_allocations, simulate
    from llmserve.benchmarks.throughput import check_fits
    from llmserve.model_loader import load_arch_config, load_tokenizer, resolve_model_path

    engine_args = EngineArgs.from_cli_args(args)
    path = resolve_model_path(engine_args.model)
    config = engine_args.create_config(load_arch_config(path), path)
    requests = load_workload(args, lambda: load_tokenizer(path))
    check_fits(requests, config.model.max_model_len)
    cache = config.cache
    allocations = simulate(
        requests, cache.num_blocks * cache.block_size, cache.block_size, config.model.max_model_len
    )
    print(_memory_report(allocations, cache, len(requests)))
    payload = {
        "engine_args": dataclasses.asdict(engine_args),
        "kv_cache_bytes": cache.kv_cache_memory,
        "num_blocks": cache.num_blocks,
        "block_size": cache.block_size,
        "workload": {"file": args.workload, **describe(requests)},
        "allocations": [a.to_json() for a in allocations],
    }
    if args.live:
        payload["live"] = _measure_live(engine_args, requests[: args.live_requests])
    save(args, "memory", payload)
    if args.plot:
        plot_allocations(allocations, f"{cache.kv_cache_memory / 2**20:.0f} MiB", args.plot)
    return 0


def _memory_report(allocations, cache, num_requests: int) -> str:
    rows = [a.to_json() for a in allocations]
    table = result_files.format_table(rows, ("strategy", "concurrent_sequences", "allocated_slots", "waste"))
    paged, *contiguous = allocations
    ratios = ", ".join(f"{paged.concurrent_sequences / max(c.concurrent_sequences, 1):.1f}x {c.strategy}"
                       for c in contiguous)  # fmt: skip
    note = " (every request fits: use more requests)" if paged.concurrent_sequences == num_requests else ""
    return (
        f"KV budget {cache.kv_cache_memory / 2**20:.1f} MiB = {cache.num_blocks} blocks x {cache.block_size} "
        f"tokens\n{table}\npaged fits {ratios}{note}"
    )


def _measure_live(engine_args, requests: list[BenchRequest]) -> dict:
    from llmserve.benchmarks.memory import live_engine_args, measure_live
    from llmserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(live_engine_args(engine_args, len(requests)))
    engine.model_runner.wait_for_kv_prefault()
    with tqdm(total=len(requests), desc="live", unit="req") as progress:
        live = measure_live(engine, requests, progress)
    print(
        f"live engine: at most {live.max_running} running at once (mean {live.mean_running:.1f}), "
        f"mean waste {100 * live.mean_waste:.1f}%, {live.num_preemptions} preemptions"
    )
    return dataclasses.asdict(live)
