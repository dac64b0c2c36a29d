"""Sampling flags for the commands that generate text (generate, chat); engine flags come from
`EngineArgs.add_cli_args`."""

from __future__ import annotations

import argparse


def add_sampling_arguments(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=max_tokens, help="tokens to generate at most")
    group.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=-1)
    group.add_argument("--min-p", type=float, default=0.0)
    group.add_argument("--repetition-penalty", type=float, default=1.0)
    group.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    group.add_argument("--ignore-eos", action="store_true")


def sampling_params_from(namespace: argparse.Namespace):
    from llmserve.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=namespace.max_tokens,
        temperature=namespace.temperature,
        top_p=namespace.top_p,
        top_k=namespace.top_k,
        min_p=namespace.min_p,
        repetition_penalty=namespace.repetition_penalty,
        stop=namespace.stop,
        ignore_eos=namespace.ignore_eos,
    )
