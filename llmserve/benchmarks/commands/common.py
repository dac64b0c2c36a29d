"""Flags and helpers the bench commands share: number lists, the workload (from flags or a JSONL
file), the result file and plot."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from llmserve.benchmarks import results as result_files
from llmserve.benchmarks.workload import BenchRequest, WorkloadSpec, build_workload, load_jsonl


def int_list(text: str) -> list[int]:
    return [int(item) for item in text.split(",") if item]


def positive_ints(text: str) -> list[int]:
    values = int_list(text)
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r}")
    return values


def add_workload_arguments(parser: argparse.ArgumentParser, with_seed: bool, from_file: bool = True) -> None:
    """Workload flags; commands with engine flags share the engine's --seed as the workload seed."""
    group = parser.add_argument_group("workload")
    if from_file:
        group.add_argument(
            "--workload", default=None, help="JSONL file of requests; the flags below then do nothing"
        )
    group.add_argument("--num-requests", type=int, default=100)
    if with_seed:
        group.add_argument("--seed", type=int, default=0, help="workload seed")
    group.add_argument("--prompt-len-median", type=float, default=200.0)
    group.add_argument("--output-len-median", type=float, default=120.0)
    group.add_argument("--len-sigma", type=float, default=0.6, help="sigma of log(length), both lengths")
    group.add_argument("--prompt-len-range", type=int_list, default=[4, 1024], help="MIN,MAX prompt tokens")
    group.add_argument("--output-len-range", type=int_list, default=[4, 512], help="MIN,MAX output tokens")
    group.add_argument("--fixed-prompt-len", type=int, default=None, help="every prompt this long")
    group.add_argument("--fixed-output-len", type=int, default=None, help="every output this long")
    group.add_argument("--shared-prefixes", type=int, default=0, help="K system prompts shared by requests")
    group.add_argument("--prefix-len", type=int, default=500, help="tokens of each shared system prompt")


def workload_spec(args: argparse.Namespace) -> WorkloadSpec:
    for name in ("prompt_len_range", "output_len_range"):
        bounds = getattr(args, name)
        if len(bounds) != 2 or not 1 <= bounds[0] <= bounds[1]:
            raise ValueError(f"--{name.replace('_', '-')} takes MIN,MAX with 1 <= MIN <= MAX")
    return WorkloadSpec(
        num_requests=args.num_requests,
        seed=args.seed,
        prompt_len_median=args.prompt_len_median,
        output_len_median=args.output_len_median,
        sigma=args.len_sigma,
        prompt_len_range=tuple(args.prompt_len_range),
        output_len_range=tuple(args.output_len_range),
        fixed_prompt_len=args.fixed_prompt_len,
        fixed_output_len=args.fixed_output_len,
        shared_prefixes=args.shared_prefixes,
        prefix_len=args.prefix_len,
    )


def load_workload(args: argparse.Namespace, get_tokenizer: Callable) -> list[BenchRequest]:
    """The --workload file, or one drawn from the flags (the tokenizer is loaded only if needed)."""
    if getattr(args, "workload", None):
        return load_jsonl(args.workload, tokenizer=None if _file_has_ids(args.workload) else get_tokenizer())
    if args.num_requests < 1:
        raise ValueError("--num-requests must be >= 1")
    return build_workload(workload_spec(args), get_tokenizer())


def _file_has_ids(path: str) -> bool:
    with open(path) as lines:
        return all('"prompt_token_ids"' in line for line in lines if line.strip())


def load_tokenizer_for(model: str | None):
    from llmserve.model_loader import load_tokenizer, resolve_model_path

    return load_tokenizer(resolve_model_path(model))


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("output")
    group.add_argument(
        "--output", default=None, help="JSON result file (default: bench_results/NAME-TIME.json)"
    )
    group.add_argument("--plot", default=None, help="also draw a PNG here")


def save(args: argparse.Namespace, name: str, payload: dict, device=None) -> None:
    path = result_files.write_result(
        args.output or result_files.default_output_path(name),
        {**result_files.run_metadata(name, device), **payload},
    )
    print(f"result: {path}")
