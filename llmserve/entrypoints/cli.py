"""The `llmserve` command: generate, chat, serve, bench.

Every user error (bad flags, a missing or corrupt model, an unsupported architecture, a prompt too
long) is one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import sys
import types
import typing
from collections.abc import Callable, Iterator

from llmserve.config import EngineArgs
from llmserve.log import configure_logging

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> typing.NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineArgs field, help text from the field's metadata."""
    group = parser.add_argument_group("engine")
    hints = typing.get_type_hints(EngineArgs)
    for spec in dataclasses.fields(EngineArgs):
        flag = "--" + spec.name.replace("_", "-")
        kind = _base_type(hints[spec.name])
        if kind is bool:
            group.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=spec.default, help=spec.metadata["help"]
            )
        else:
            group.add_argument(flag, type=kind, default=spec.default, help=spec.metadata["help"])


def _base_type(hint) -> type:
    """`int | None` -> int, `int | str` -> str (parsed later), `bool` -> bool."""
    if isinstance(hint, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return str if str in args else args[0]
    return hint


def engine_args_from(namespace: argparse.Namespace) -> EngineArgs:
    return EngineArgs(**{f.name: getattr(namespace, f.name) for f in dataclasses.fields(EngineArgs)})


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


def stream_text(engine, request_id: str, prompt, params) -> Iterator[str]:
    """Run one request to completion on a synchronous engine, yielding new text as it appears."""
    from llmserve.sampling_params import RequestOutputKind

    engine.add_request(request_id, prompt, params.with_output_kind(RequestOutputKind.DELTA))
    while engine.has_unfinished_requests():
        for output in engine.step():
            for completion in output.outputs:
                if completion.text:
                    yield completion.text


def cmd_generate(args: argparse.Namespace) -> int:
    from llmserve.engine.llm_engine import LLMEngine

    params = sampling_params_from(args)  # bad values fail before the model loads
    engine = LLMEngine(engine_args_from(args))
    prompt = args.prompt
    if args.chat:
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    for piece in stream_text(engine, "generate", prompt, params):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from llmserve.engine.llm_engine import LLMEngine

    params = sampling_params_from(args)
    engine = LLMEngine(engine_args_from(args))
    history: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    print("llmserve chat: type a message, /reset to clear the history, Ctrl-D to quit.", file=sys.stderr)
    for turn in range(sys.maxsize):
        try:
            user = input("> ").strip()
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if user == "/reset":
            history = history[:1] if args.system else []
            continue
        if not user:
            continue
        history.append({"role": "user", "content": user})
        prompt = engine.tokenizer.apply_chat_template(history)
        reply = []
        for piece in stream_text(engine, f"chat-{turn}", prompt, params):
            reply.append(piece)
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        history.append({"role": "assistant", "content": "".join(reply)})
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="llmserve", description="Serve and run large language models.")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", action="store_true", help="log engine details to stderr")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    commands.add_parser = functools.partial(commands.add_parser, parents=[common])

    generate = commands.add_parser("generate", help="stream a completion of PROMPT to stdout")
    generate.add_argument("prompt")
    generate.add_argument("--chat", action="store_true", help="wrap PROMPT in the model's chat template")
    add_sampling_arguments(generate, max_tokens=128)
    add_engine_arguments(generate)
    generate.set_defaults(handler=cmd_generate)

    chat = commands.add_parser("chat", help="an interactive chat with history (the model's chat template)")
    chat.add_argument("--system", default=None, help="system prompt")
    add_sampling_arguments(chat, max_tokens=512)
    add_engine_arguments(chat)
    chat.set_defaults(handler=cmd_chat)

    for register in _extra_commands():
        register(commands)
    return parser


def _extra_commands() -> list[Callable]:
    """Subcommands that live with their feature (server, benchmarks)."""
    registrars = []
    modules = ("llmserve.entrypoints.openai.cli", "llmserve.benchmarks.cli")
    modules += ("llmserve.evaluation.cli", "llmserve.quantization.cli", "llmserve.spec_decode.cli")
    for module_name in modules:
        try:
            module = __import__(module_name, fromlist=["register"])
        except ModuleNotFoundError as error:
            if error.name != module_name:
                raise
            continue
        registrars.append(module.register)
    return registrars


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(
        logging.INFO if getattr(args, "verbose", False) or args.command == "serve" else logging.WARNING
    )
    try:
        return args.handler(args)
    except (ValueError, OSError) as error:  # ModelLoadError is a ValueError
        print(f"llmserve: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
