"""`llmserve bench soak`: start a server with --check-invariants, send thousands of mixed requests
(streams, n > 1, stop strings, logprobs, 30% disconnects, bad requests, slow readers), then gate on
invariants, idle gauges, greedy references, the log and the RSS slope (benchmarks/soak.py)."""

from __future__ import annotations

import argparse
import shlex
from dataclasses import asdict
from pathlib import Path

from llmserve.benchmarks.commands.common import add_output_arguments, save


def register(commands) -> None:
    parser = commands.add_parser("soak", help="a long mixed load with gates on leaks and correctness")
    parser.add_argument("--model", default=None, help="model path (default: the embedded model)")
    parser.add_argument("--num-requests", type=int, default=3300)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--max-rss-slope", type=float, default=5.0, help="MB per 1,000 requests")
    parser.add_argument(
        "--server-args",
        default="--dtype float32 --kv-cache-memory 16MiB --max-model-len 1024",
        help="extra `llmserve serve` flags (float32: greedy references hold under batching; a small KV "
        "pool forces preemption; add --speculative-method ngram to speculate)",
    )
    parser.add_argument("--log", default="soak-server.log", help="the server's log file")
    add_output_arguments(parser)
    parser.set_defaults(handler=cmd_soak)


def cmd_soak(args: argparse.Namespace) -> int:
    from llmserve.benchmarks.soak import SoakConfig, run_soak
    from llmserve.model_loader import default_model_path

    config = SoakConfig(args.num_requests, args.concurrency, args.max_tokens, args.seed)
    config.max_rss_slope_mb_per_1k = args.max_rss_slope
    model = args.model or default_model_path()
    report = run_soak(model, shlex.split(args.server_args), config, Path(args.log), args.port)
    failures = report.failures(config)
    print(f"requests: {sum(report.requests.values())} {report.requests}")
    print(f"disconnects: {report.disconnects}, preemptions: {report.preemptions:g}, "
          f"invariant violations: {report.invariant_violations:g}, leaked: {report.leaked}")  # fmt: skip
    print(f"greedy checked: {report.greedy_checked}, mismatches: {report.greedy_mismatches}")
    if report.draft_tokens:
        print(f"speculative drafts verified: {report.draft_tokens:g}, accepted: {report.accepted_tokens:g}")
    slope = report.rss_slope_mb_per_1k
    print(
        "RSS slope: "
        + ("n/a (under 3,000 requests after warm-up)" if slope is None else f"{slope:.2f} MB/1k")
        + ("" if slope is None else f" (API server alone: {report.server_rss_slope_mb_per_1k:.2f})")
    )
    print("PASS" if not failures else "FAIL:\n  " + "\n  ".join(failures))
    save(args, "soak", {"config": asdict(config), "report": asdict(report), "failures": failures})
    if args.plot:
        from llmserve.benchmarks.soak import plot_rss

        plot_rss(report.rss_mb, config.warmup_requests, args.plot)
    return 1 if failures else 0
