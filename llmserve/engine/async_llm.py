"""The engine behind the HTTP server: one background loop that every request shares.

The synchronous engine is built and runs in its own thread (torch releases the GIL in its kernels,
so the event loop stays responsive). Requests and aborts reach it through a thread-safe command queue, drained
at the start of every step; outputs come back to each request's asyncio queue, all of a step's
outputs in one `call_soon_threadsafe` per event loop (one wakeup per step, not one per request:
each wakeup is a self-pipe write that lets the event loop thread take the GIL and a core from the
model's threads). A request's stream ends with its finished output, or with an exception if the
engine failed it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from llmserve.config import EngineArgs
from llmserve.engine.llm_engine import LLMEngine
from llmserve.metrics.stats import StepStats
from llmserve.outputs import RequestOutput
from llmserve.sampling_params import SamplingParams

logger = logging.getLogger("llmserve")

_IDLE_WAIT_SECONDS = 0.05


class EngineDeadError(RuntimeError):
    pass


@dataclass
class _Add:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival_time: float
    priority: int


@dataclass
class _Abort:
    request_id: str


class AsyncLLM:
    def __init__(self, engine_args: EngineArgs) -> None:
        self.step_listeners: list[Callable[[StepStats | None, list[RequestOutput]], None]] = []
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = threading.Event()
        self._loaded = threading.Event()
        self._load_error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._load_and_run, args=(engine_args,), name="llmserve-engine", daemon=True
        )
        self._thread.start()
        self._loaded.wait()
        if self._load_error is not None:  # bad model or flags: the caller reports it, as before
            raise self._load_error
        self.tokenizer = self.engine.tokenizer
        self.config = self.engine.config

    # -- the API the server calls ------------------------------------------------------------------

    def encode_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        """Tokenize and validate now, so bad input fails before anything is queued."""
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.engine.validate_prompt(prompt_ids)
        return prompt_ids

    async def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Stream cumulative outputs of one request; cancelling the iteration aborts it."""
        if not self.is_running:
            raise EngineDeadError("the engine loop has stopped")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt_ids = self.encode_prompt(prompt)
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), stream)
        self._commands.put(_Add(request_id, prompt_ids, params, time.monotonic(), priority))
        finished = False
        try:
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._commands.put(_Abort(request_id))

    def abort(self, request_id: str) -> None:
        """Abort from outside the stream: its iterator receives the final "abort" output."""
        self._commands.put(_Abort(request_id))

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopped.is_set()

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stopped.set()
        self._thread.join(timeout)

    # -- the engine thread -------------------------------------------------------------------------

    def _load_and_run(self, engine_args: EngineArgs) -> None:
        # The engine is built on the thread that steps it: stepping a model loaded by another thread
        # measured about 15% slower per decode step here (docs/benchmarks.md, "HTTP overhead").
        try:
            self.engine = LLMEngine(engine_args)
        except BaseException as error:  # noqa: BLE001 - handed to __init__, which raises it
            self._load_error = error
            self._loaded.set()
            return
        self._loaded.set()
        self._run()

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException:  # a bug outside the step: fail every stream rather than leave it hanging
            logger.exception("the engine loop crashed")
            self._stopped.set()
            error = EngineDeadError("the engine loop crashed; see the server log")
            self._deliver_all([(request_id, error) for request_id in list(self._streams)])

    def _loop(self) -> None:
        while not self._stopped.is_set():
            self._drain_commands(block=not self.engine.has_unfinished_requests())
            if not self.engine.has_unfinished_requests():
                continue
            try:
                outputs = self.engine.step()
            except Exception as error:  # noqa: BLE001 - one bad step must not kill the server
                logger.exception("engine step failed; failing the requests in flight")
                self._fail_all(error)
                continue
            self._deliver_all([(output.request_id, output) for output in outputs])
            if self.engine.last_step is not None:
                self._notify(self.engine.last_step, outputs)
        self._fail_all(EngineDeadError("the server is shutting down"))

    def _drain_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=_IDLE_WAIT_SECONDS) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, command: _Add | _Abort) -> None:
        if isinstance(command, _Abort):
            output = self.engine.abort_request(command.request_id)
            if output is not None:  # its final "abort" output ends a live stream and counts in metrics
                self._deliver(command.request_id, output)
                self._notify(None, [output])
            return
        if command.request_id not in self._streams:
            return  # the client left before the request reached the engine
        try:
            self.engine.add_request(
                command.request_id, command.prompt_ids, command.params, command.arrival_time, command.priority
            )
        except ValueError as error:
            self._deliver(command.request_id, error)

    def _fail_all(self, error: BaseException) -> None:
        request_ids = list(self._streams)
        for request_id in request_ids:
            self.engine.abort_request(request_id)
        self._deliver_all([(request_id, error) for request_id in request_ids])

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        self._deliver_all([(request_id, item)])

    def _deliver_all(self, items: list[tuple[str, RequestOutput | BaseException]]) -> None:
        """Hand items to their streams with one callback per event loop (normally there is one)."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]] = {}
        for request_id, item in items:
            target = self._streams.get(request_id)
            if target is not None:
                loop, stream = target
                batches.setdefault(loop, []).append((stream, item))
        for loop, batch in batches.items():
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody is left to read these streams
                loop.call_soon_threadsafe(_put_all, batch)

    def _notify(self, stats: StepStats | None, outputs: list[RequestOutput]) -> None:
        """Tell listeners about a step (stats) and its outputs; aborts come with stats None."""
        for listener in self.step_listeners:
            try:
                listener(stats, outputs)
            except Exception:  # noqa: BLE001 - metrics must never break serving
                logger.exception("step listener failed")


def _put_all(batch: list[tuple[asyncio.Queue, object]]) -> None:
    for stream, item in batch:
        stream.put_nowait(item)
