"""Requests whose grammar is still compiling wait here, outside the scheduler.

The compile runs in the GrammarCompiler's threads (xgrammar releases the GIL), so the step loop keeps
serving the other streams; each step first admits the requests whose grammar is ready. A grammar
compiled before (a cache hit) admits its request at once.
"""

from __future__ import annotations

import concurrent.futures
from concurrent.futures import Future

from llmserve.request import Request
from llmserve.sampling_params import SamplingParams
from llmserve.structured.compiler import GrammarCompiler


class GrammarGate:
    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self.pending: dict[str, tuple[Future, list[Request]]] = {}  # request id -> (compile, children)

    def future(self, params: SamplingParams) -> Future | None:
        """The compile a request must wait for; None when it need not wait. Raises GrammarError at once
        for a grammar that already failed (a cached refusal)."""
        spec = params.structured_outputs
        if spec is None:
            return None
        future = self.compiler.submit(spec)
        if not future.done():
            return future
        future.result()  # raises the compile's error
        return None

    def hold(self, request_id: str, future: Future, children: list[Request]) -> None:
        self.pending[request_id] = (future, children)

    def take_ready(self) -> list[tuple[str, list[Request], BaseException | None]]:
        """The held requests whose compile finished: (id, children, its error or None)."""
        done = [rid for rid, (future, _) in self.pending.items() if future.done()]
        ready = []
        for request_id in done:
            future, children = self.pending.pop(request_id)
            ready.append((request_id, children, future.exception()))
        return ready

    def drop(self, request_id: str) -> bool:
        """Forget a held request (aborted); whether it was held."""
        return self.pending.pop(request_id, None) is not None

    def wait(self, timeout: float) -> None:
        """Sleep until a held compile finishes or `timeout` passes (an idle engine: nothing else to run)."""
        futures = [future for future, _ in self.pending.values()]
        if futures:
            concurrent.futures.wait(futures, timeout, return_when=concurrent.futures.FIRST_COMPLETED)
