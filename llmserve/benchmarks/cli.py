"""`llmserve bench SUBCOMMAND`: one module per benchmark command in benchmarks/commands/.

Each command prints a report, writes a JSON result (with machine, command, date and commit) to
`--output` (default under bench_results/), and draws a PNG with `--plot`. docs/benchmarks.md says how
to run each and what its figures mean.
"""

from __future__ import annotations

from llmserve.benchmarks.commands import (
    latency,
    memory,
    prefix_cache,
    priority,
    serve,
    soak,
    spec_decode,
    throughput,
    workload,
)

# Each module's `register(commands)` adds its subcommand and sets `handler`; `llmserve bench --help`
# lists them in this order.
COMMANDS = (throughput, serve, latency, memory, workload, prefix_cache, priority, spec_decode, soak)


def register(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks: throughput, serve, latency, memory, workload")
    commands = bench.add_subparsers(dest="benchmark", required=True, parser_class=type(bench))
    for command in COMMANDS:
        command.register(commands)
