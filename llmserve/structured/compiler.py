"""Grammars compiled by xgrammar, in a thread pool, cached by their parameters.

xgrammar releases the GIL while it compiles, so a compile in the pool runs beside the engine's step
loop (or the server's event loop) instead of stalling it. Both processes compile: the server to
refuse an unsupported or over-budget grammar with a 400 before the request starts, the engine for
its own matchers (the compiled grammar, megabytes for a large schema, does not cross the pipe).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol

from llmserve.structured.params import GrammarError, StructuredOutputsParams
from llmserve.structured.schema import check_schema

if TYPE_CHECKING:
    import xgrammar


class Tokenizer(Protocol):
    """What compiling reads of model_loader's Tokenizer: the transformers tokenizer."""

    @property
    def hf(self) -> Any: ...


CACHE_SIZE = 128  # compiled grammars kept (a large schema's is a few MB)
COMPILE_THREADS = 2


class GrammarCompiler:
    """Compiles StructuredOutputsParams for one tokenizer and vocabulary; thread-safe."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._lock = threading.Lock()  # the cache's; submit() takes it on the event loop or step loop
        self._build_lock = threading.Lock()  # the vocabulary table's, held for a second on first use
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="llmserve-grammar")

    def submit(self, params: StructuredOutputsParams) -> Future:
        """The compiled grammar's future: the cached one, or a compile queued in the pool."""
        with self._lock:
            future = self._cache.get(params.key)
            if future is not None:
                self._cache.move_to_end(params.key)
                return future
            future = self._pool.submit(self._compile, params)
            self._cache[params.key] = future
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        future.add_done_callback(lambda f: f.exception() is not None and self._forget(params.key, f))
        return future

    def compile(self, params: StructuredOutputsParams) -> xgrammar.CompiledGrammar:
        """Compile (or take from the cache) now; raises GrammarError."""
        return self.submit(params).result()

    def _forget(self, key: tuple, future: Future) -> None:
        """A failed compile is not cached: the next request retries it (and gets the same error)."""
        with self._lock:
            if self._cache.get(key) is future:
                del self._cache[key]

    def prepare(self) -> Future:
        """Build the vocabulary table in the pool now (xgrammar's import and the tokenizer's table take
        about a second): a server calls it at start so that its first structured request does not."""
        return self._pool.submit(self._xgrammar)

    def _xgrammar(self) -> xgrammar.GrammarCompiler:
        with self._build_lock:  # the tokenizer's vocabulary table is built once, on the first compile
            if self._compiler is None:
                import xgrammar

                info = xgrammar.TokenizerInfo.from_huggingface(
                    self._tokenizer.hf, vocab_size=self._vocab_size, stop_token_ids=self._stop_token_ids
                )
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def _compile(self, params: StructuredOutputsParams) -> xgrammar.CompiledGrammar:
        compiler = self._xgrammar()
        try:
            if params.json is not None:
                check_schema(json.loads(params.json))
                return compiler.compile_json_schema(params.json, any_whitespace=False, strict_mode=True)
            if params.json_object:
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if params.regex is not None:
                return compiler.compile_regex(params.regex)
            if params.choice is not None:
                return compiler.compile_grammar(choice_grammar(params.choice))
            return compiler.compile_grammar(params.grammar)
        except RuntimeError as error:  # xgrammar's parse and conversion errors
            raise GrammarError(f"{params.kind}: {_first_line(error)}") from error

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def choice_grammar(choices: Sequence[str]) -> str:
    """EBNF accepting exactly one of the strings (JSON string literals are valid EBNF literals)."""
    return "root ::= " + " | ".join(json.dumps(choice) for choice in choices)


def _first_line(error: Exception) -> str:
    """xgrammar's message without its '[time] file:line: ' prefix."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return text.split(": ", 1)[1] if text.startswith("[") and ": " in text else text
