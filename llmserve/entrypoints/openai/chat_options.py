"""The server's chat settings: the template override, and how tool calls and reasoning are parsed out
of generated text (vLLM's flag names). Light to import: `llmserve serve --help` reads it."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

TOOL_CALL_PARSERS = ("hermes", "llama3_json")  # tool_parsers.TOOL_PARSERS, named here without its imports
REASONING_PARSERS = ("deepseek_r1", "qwen3")


@dataclass(frozen=True)
class ChatOptions:
    chat_template: str | None = None
    """a Jinja chat template that replaces the model's own (`--chat-template FILE`)"""
    tool_call_parser: str = "hermes"
    """the tool-call format models are told to use (when their template does not) and that is parsed"""
    reasoning_parser: str | None = None
    """split `<think>` reasoning off into `message.reasoning`; None: reasoning stays in the content"""

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ChatOptions:
        template = None
        path = getattr(args, "chat_template", None)
        if path is not None:
            try:
                template = Path(path).read_text()
            except OSError as error:
                raise ValueError(f"--chat-template {path}: cannot read it ({error.strerror})") from None
        return cls(
            chat_template=template,
            tool_call_parser=getattr(args, "tool_call_parser", cls.tool_call_parser),
            reasoning_parser=getattr(args, "reasoning_parser", None),
        )


def chat_flags(args: argparse.Namespace) -> list[str]:
    """The chat flags given on the command line, for a child server (a data-parallel replica)."""
    flags = []
    if getattr(args, "chat_template", None) is not None:
        flags += ["--chat-template", str(Path(args.chat_template).resolve())]
    if getattr(args, "tool_call_parser", ChatOptions.tool_call_parser) != ChatOptions.tool_call_parser:
        flags += ["--tool-call-parser", args.tool_call_parser]
    if getattr(args, "reasoning_parser", None) is not None:
        flags += ["--reasoning-parser", args.reasoning_parser]
    return flags


def add_chat_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("chat")
    group.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE",
        help="a Jinja chat template file that replaces the model's own (docs/server.md, 'Tool calling')",
    )
    group.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default=ChatOptions.tool_call_parser,
        help="tool-call format: hermes (<tool_call>{json}</tool_call>: Hermes, Qwen; the default) "
        'or llama3_json ({"name": ..., "parameters": ...}: Llama 3)',
    )
    group.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        default=None,
        help="split <think>...</think> off into message.reasoning (qwen3: Qwen3; deepseek_r1: DeepSeek-R1)",
    )
