"""`llmserve bench prefix-cache`: TTFT with a cached long prefix against a cold one, and throughput of
requests sharing system prompts with the prefix cache on and off."""

from __future__ import annotations

import argparse
import dataclasses

from llmserve.benchmarks import results as result_files
from llmserve.benchmarks.commands.common import add_output_arguments, save
from llmserve.benchmarks.workload import WorkloadSpec, build_workload, describe
from llmserve.config import EngineArgs


def register(commands) -> None:
    parser = commands.add_parser(
        "prefix-cache", help="TTFT with a cached long prefix; shared-prefix throughput"
    )
    parser.add_argument(
        "--prefix-len", type=int, default=1000, help="tokens of the cached prefix (TTFT test)"
    )
    parser.add_argument("--repeats", type=int, default=5, help="cold/warm TTFT pairs, each a fresh prefix")
    parser.add_argument(
        "--shared-prefixes", type=int, default=8, help="system prompts of the throughput test"
    )
    parser.add_argument("--shared-prefix-len", type=int, default=500)
    parser.add_argument("--num-requests", type=int, default=64, help="requests of the throughput test")
    add_output_arguments(parser)
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(handler=cmd_prefix_cache)


def cmd_prefix_cache(args: argparse.Namespace) -> int:
    from llmserve import LLM
    from llmserve.benchmarks.prefix_cache import measure_throughput, measure_ttft
    from llmserve.benchmarks.workload import TokenCorpus

    engine_args = EngineArgs.from_cli_args(args)
    cached = LLM(**{**dataclasses.asdict(engine_args), "prefix_caching": True})
    cached.engine.model_runner.wait_for_kv_prefault()
    corpus = TokenCorpus(cached.tokenizer)
    ttft = measure_ttft(cached, corpus, args.prefix_len, args.repeats, args.seed)
    summary = ttft.to_json()
    print(
        f"TTFT with a {args.prefix_len}-token prefix (batch 1, median of {args.repeats}): "
        f"cold {summary['cold_ttft_ms_median']:.1f} ms, cached {summary['warm_ttft_ms_median']:.1f} ms, "
        f"{ttft.speedup:.1f}x lower"
    )
    spec = WorkloadSpec(
        num_requests=args.num_requests,
        seed=args.seed,
        shared_prefixes=args.shared_prefixes,
        prefix_len=args.shared_prefix_len,
    )
    requests = build_workload(spec, cached.tokenizer, corpus)
    with_cache = measure_throughput(cached, requests)
    del cached
    uncached = LLM(**{**dataclasses.asdict(engine_args), "prefix_caching": False})
    uncached.engine.model_runner.wait_for_kv_prefault()
    without_cache = measure_throughput(uncached, requests)
    rows = [r.to_json() for r in (without_cache, with_cache)]
    print(
        result_files.format_table(
            rows, ["prefix_caching", "seconds", "total_tokens_per_s", "cached_prompt_tokens"]
        )
    )
    ratio = with_cache.to_json()["total_tokens_per_s"] / without_cache.to_json()["total_tokens_per_s"]
    print(f"shared-prefix throughput with the cache: {ratio:.2f}x")
    payload = {
        "ttft": summary,
        "throughput": rows,
        "throughput_ratio": ratio,
        "workload": describe(requests),
        "engine_args": dataclasses.asdict(engine_args),
    }
    save(args, "prefix-cache", payload, uncached.engine.config.model.device)
    if args.plot:
        from llmserve.benchmarks.table_plot import TablePanel, plot_table

        label = ["prefix_caching"]
        plot_table(
            [
                TablePanel("shared-prefix throughput", rows, label, "total_tokens_per_s"),
                TablePanel("prompt tokens from the cache", rows, label, "cached_prompt_tokens"),
            ],
            args.plot,
        )
    return 0
