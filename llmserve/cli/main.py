"""The `llmserve` command's parser and entry point.

Every user error (bad flags, a missing or corrupt model, an unsupported architecture, a prompt too
long) is one line on stderr and exit code 2, never a traceback.

A command that has finished exits without the interpreter's teardown (`exit_without_teardown`):
collecting every module's objects (torch's operator tables, transformers', the tokenizer's) takes
seconds after a server's last request was answered and its engine process joined, seconds a restart
or a rolling update waits, and as long again after a `generate`'s output.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import ctypes
import functools
import logging
import os
import sys
import threading
import typing

from llmserve.benchmarks import cli as bench
from llmserve.cli import chat, evaluate, generate, quantize, router, serve, train_draft_head
from llmserve.log import configure_logging

EXIT_USAGE = 2

# Each module's `register(subparsers)` adds its subcommand and sets `handler`; `llmserve --help`
# lists them in this order.
SUBCOMMANDS = (generate, chat, serve, router, bench, evaluate, quantize, train_draft_head)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> typing.NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="llmserve", description="Serve and run large language models.")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", action="store_true", help="log engine details to stderr")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    commands.add_parser = functools.partial(commands.add_parser, parents=[common])
    for subcommand in SUBCOMMANDS:
        subcommand.register(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(
        logging.INFO if args.verbose or args.command in ("serve", "router") else logging.WARNING
    )
    try:
        return args.handler(args)
    except (ValueError, OSError) as error:  # ModelLoadError is a ValueError
        print(f"llmserve: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


def exit_without_teardown(code: int) -> typing.NoReturn:
    """End the process as a normal exit would, less the interpreter's teardown (module docstring):
    thread pools told to stop and every non-daemon thread joined, the exit handlers run (an engine
    process's, the loggers' flush), the standard streams flushed; the rest the OS reclaims. Only for
    a process's entry point: it never returns."""
    try:
        threading._shutdown()  # what the interpreter's exit does first
    except KeyboardInterrupt:  # a second Ctrl-C while threads finish
        code = 130
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed or broken stream: nothing left to write
            stream.flush()
    with contextlib.suppress(Exception):  # C-level stdio buffers (native extensions' output)
        ctypes.CDLL(None).fflush(None)
    os._exit(code)


if __name__ == "__main__":
    exit_without_teardown(main())
