"""The router's prefix-cache hit rate against one engine's, on a shared-prefix workload over HTTP.

    python -m benchmarks.tools.dp_prefix_hits --out benchmarks/results/DATE-dp-prefix-hits.json \
        [--workload bench_results/shared-8x500-200.jsonl] [--data-parallel-size 2] [--port 8000]

Writes the workload if the file is missing (`llmserve bench workload`: 8 system prompts of 500
tokens, each request one of them plus its own question), then, one server at a time: a fresh
`llmserve serve` (one engine, all CPUs) and a fresh `llmserve serve --data-parallel-size N` (N
replicas behind the router), each loaded with the whole workload by `llmserve bench serve`, which
reads the prefix-cache counters (`llmserve:prefix_cache_queries_total`, `_hits_total`) from the
server's /metrics before and after; the router's /metrics carries every replica's. The result file
holds both runs' hit rates, throughput and the ratio, with the machine, command, date and commit.
The hit rate does not depend on speed, so a busy machine changes the timings, not the result.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from benchmarks.tools.side_by_side import Step, llmserve_command, run_step
from llmserve.benchmarks.results import run_metadata, write_result

GOAL = 0.9  # the router's hit rate at least this fraction of one engine's (issue 31)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the result file (JSON)")
    parser.add_argument("--workload", default="bench_results/shared-8x500-200.jsonl")
    parser.add_argument("--num-requests", type=int, default=200, help="requests, if the workload is written")
    parser.add_argument("--data-parallel-size", type=int, default=2)
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--request-rate", default="inf")
    parser.add_argument("--health-timeout", type=float, default=900.0)
    parser.add_argument("--logs", default="bench_results/logs")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    given = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(given)
    metadata = run_metadata("dp-prefix-hits")  # before anything runs: the commit measured
    metadata["command"] = shlex.join(["python", "-m", "benchmarks.tools.dp_prefix_hits", *given])
    llmserve = [llmserve_command()]
    if not Path(args.workload).exists():
        workload = [*llmserve, "bench", "workload", "--out", args.workload]
        workload += [
            "--num-requests",
            str(args.num_requests),
            "--shared-prefixes",
            "8",
            "--prefix-len",
            "500",
        ]
        subprocess.run(workload, check=True)
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{args.port}"
    server = [*llmserve, "serve", "--port", str(args.port)]
    runs = {}
    with tempfile.TemporaryDirectory() as scratch:
        for name, extra in (
            ("one-engine", []),
            (f"dp{args.data_parallel_size}", ["--data-parallel-size", str(args.data_parallel_size)]),
        ):
            output = Path(scratch) / f"{name}.json"
            bench = [*llmserve, "bench", "serve", "--url", url, "--workload", args.workload]
            bench += ["--request-rate", args.request_rate, "--output", str(output)]
            run_step(Step(name, bench, [*server, *extra], url), logs, "dp-prefix-hits", args.health_timeout)
            runs[name] = summary(json.loads(output.read_text()), [*server, *extra], bench)
    one, dp = runs.values()
    ratio = dp["prefix_cache"]["hit_rate"] / one["prefix_cache"]["hit_rate"]
    payload = {**metadata, "workload": args.workload, "runs": runs, "hit_rate_ratio": ratio, "goal": GOAL}
    write_result(args.out, payload)
    for name, run in runs.items():
        cache = run["prefix_cache"]
        print(
            f"{name}: hit rate {cache['hit_rate']:.4f} ({cache['hits']:.0f} / {cache['queries']:.0f} tokens)"
        )
    print(f"router / one engine: {ratio:.3f} (goal >= {GOAL}); written to {args.out}")


def summary(result: dict, server: list[str], bench: list[str]) -> dict:
    """What the comparison needs of one `bench serve` result file."""
    (run,) = result["runs"]
    if run["prefix_cache"] is None:
        raise RuntimeError(f"{result['url']}/metrics has no prefix-cache counters")
    keep = (
        "num_requests",
        "num_ok",
        "duration",
        "total_token_throughput",
        "output_throughput",
        "prefix_cache",
    )
    return {"server": " ".join(server), "bench": " ".join(bench), **{key: run[key] for key in keep}}


if __name__ == "__main__":
    main()
