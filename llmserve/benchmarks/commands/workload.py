"""`llmserve bench workload`: write a workload JSONL that any system can replay."""

from __future__ import annotations

import argparse
from pathlib import Path

from llmserve.benchmarks.commands.common import add_workload_arguments, load_tokenizer_for, load_workload
from llmserve.benchmarks.workload import describe


def register(commands) -> None:
    parser = commands.add_parser("workload", help="write a workload JSONL that any system can replay")
    parser.add_argument("--out", required=True, help="JSONL file to write")
    parser.add_argument("--tokenizer", default=None, help="model dir/GGUF whose tokenizer counts tokens")
    add_workload_arguments(parser, with_seed=True, from_file=False)
    parser.set_defaults(handler=cmd_workload)


def cmd_workload(args: argparse.Namespace) -> int:
    from llmserve.benchmarks.workload import save_jsonl

    requests = load_workload(args, lambda: load_tokenizer_for(args.tokenizer))
    path = save_jsonl(requests, Path(args.out))
    stats = describe(requests)
    print(f"wrote {path}: " + ", ".join(f"{key} {value:g}" for key, value in stats.items()))
    return 0
