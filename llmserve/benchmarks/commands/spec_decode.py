"""`llmserve bench spec-decode`: batch-1 ms/token of each speculative method on grounded and chat
prompts, and throughput with speculation off, on and auto."""

from __future__ import annotations

import argparse
import dataclasses

from llmserve.benchmarks import results as result_files
from llmserve.benchmarks.commands.common import add_output_arguments, positive_ints, save
from llmserve.config import EngineArgs


def register(commands) -> None:
    parser = commands.add_parser(
        "spec-decode", help="batch-1 ms/token per speculative method; throughput off / on / auto"
    )
    parser.add_argument(
        "--methods",
        default="ngram,early_exit",
        help="besides none: ngram,early_exit,draft,draft_head,draft_head_only,suffix,eagle",
    )
    parser.add_argument(
        "--early-exit-layers", type=positive_ints, default=None, help="early-exit depths, e.g. 8,12,16"
    )
    parser.add_argument("--num-prompts", type=int, default=32, help="prompts per latency workload")
    parser.add_argument("--document-len", type=int, default=400, help="tokens of each grounded document")
    parser.add_argument("--max-tokens", type=int, default=128, help="latency: tokens at most (EOS ends)")
    parser.add_argument("--batch-sizes", type=positive_ints, default=[1, 4, 16, 64])
    parser.add_argument("--throughput-output-len", type=int, default=128, help="tokens per request")
    parser.add_argument("--throughput-repeats", type=int, default=3, help="waves per batch size and mode")
    parser.add_argument("--throughput-method", default="ngram", help="method measured on/auto ('' skips)")
    add_output_arguments(parser)
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(handler=cmd_spec_decode)


def cmd_spec_decode(args: argparse.Namespace) -> int:
    from llmserve.benchmarks.spec_decode import (
        LATENCY_COLUMNS,
        THROUGHPUT_COLUMNS,
        SpecBenchConfig,
        methods,
        run_benchmark,
    )

    for name in ("num_prompts", "document_len", "max_tokens", "throughput_output_len", "throughput_repeats"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    engine_args = EngineArgs.from_cli_args(args)
    names = [n for n in args.methods.split(",") if n]
    if args.speculative_draft_model and "draft" not in names:
        names.append("draft")
    chosen = methods(names, args.early_exit_layers or [None], args.speculative_draft_model)
    if args.throughput_method and args.throughput_method not in {m.name for m in chosen}:
        raise ValueError(f"--throughput-method {args.throughput_method!r} is not among the methods measured")
    config = SpecBenchConfig(
        methods=tuple(chosen),
        throughput_method=args.throughput_method,
        num_prompts=args.num_prompts,
        document_len=args.document_len,
        max_tokens=args.max_tokens,
        batch_sizes=tuple(args.batch_sizes),
        throughput_output_len=args.throughput_output_len,
        throughput_repeats=args.throughput_repeats,
        seed=args.seed,
    )
    payload = run_benchmark(engine_args, config)
    print(result_files.format_table(payload["latency"], LATENCY_COLUMNS))
    if payload["throughput"]:
        print(result_files.format_table(payload["throughput"], THROUGHPUT_COLUMNS))
    save(args, "spec-decode", {**payload, "engine_args": dataclasses.asdict(engine_args)})
    if args.plot:
        from llmserve.benchmarks.spec_decode import plot_spec_decode

        plot_spec_decode(payload, args.plot)
    return 0
