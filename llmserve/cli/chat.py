"""`llmserve chat`: an interactive chat with history, through the model's chat template."""

from __future__ import annotations

import argparse
import sys

from llmserve.cli.args import add_sampling_arguments, sampling_params_from
from llmserve.cli.generate import stream_text
from llmserve.config import EngineArgs


def register(subparsers) -> None:
    chat = subparsers.add_parser("chat", help="an interactive chat with history (the model's chat template)")
    chat.add_argument("--system", default=None, help="system prompt")
    add_sampling_arguments(chat, max_tokens=512)
    EngineArgs.add_cli_args(chat)
    chat.set_defaults(handler=cmd_chat)


def cmd_chat(args: argparse.Namespace) -> int:
    from llmserve.engine.llm_engine import LLMEngine

    params = sampling_params_from(args)
    engine = LLMEngine(EngineArgs.from_cli_args(args))
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
