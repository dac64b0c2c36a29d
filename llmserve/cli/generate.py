"""`llmserve generate PROMPT`: stream one completion to stdout."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator

from llmserve.cli.args import add_sampling_arguments, sampling_params_from
from llmserve.config import EngineArgs


def register(subparsers) -> None:
    generate = subparsers.add_parser("generate", help="stream a completion of PROMPT to stdout")
    generate.add_argument("prompt")
    generate.add_argument("--chat", action="store_true", help="wrap PROMPT in the model's chat template")
    add_sampling_arguments(generate, max_tokens=128)
    EngineArgs.add_cli_args(generate)
    generate.set_defaults(handler=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    from llmserve.engine.llm_engine import LLMEngine

    params = sampling_params_from(args)  # bad values fail before the model loads
    engine = LLMEngine(EngineArgs.from_cli_args(args))
    prompt = args.prompt
    if args.chat:
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    for piece in stream_text(engine, "generate", prompt, params):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def stream_text(engine, request_id: str, prompt, params) -> Iterator[str]:
    """Run one request to completion on a synchronous engine, yielding new text as it appears."""
    from llmserve.sampling_params import RequestOutputKind

    engine.add_request(request_id, prompt, params.with_output_kind(RequestOutputKind.DELTA))
    while engine.has_unfinished_requests():
        for output in engine.step():
            for completion in output.outputs:
                if completion.text:
                    yield completion.text
