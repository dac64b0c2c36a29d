"""The engine behind the HTTP server, as the server's event loop sees it: a stream of outputs per request.

The engine runs in its own process, which `EngineCoreClient` (core_client.py) starts, pipes to,
reads from and restarts. This side keeps the tokenizer and validates prompts before anything is
queued, so bad input fails with a clear error at once (and only here). For each message the
client's reader thread hands over, this side gives each request the kind of output it asked for
(output_kinds.py, the only place for the server's requests: the engine process sends deltas; a DELTA
stream gets them as they are) and hands the outputs to their asyncio queues
with one `call_soon_threadsafe` per event loop per step. A request's stream ends with its finished
output, or with an exception if the engine failed it; if the engine process dies, every stream ends
with EngineDeadError. If a tensor-parallel rank dies, the engine process lives on but cannot step:
`failure` names the rank, and the streams in flight and every later request end with
EngineFailedError.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence

from llmserve.config import EngineArgs, EngineConfig
from llmserve.engine.core_client import (
    SHUTDOWN_GRACE_SECONDS,
    EngineCoreClient,
    EngineDeadError,
    EngineLaunch,
    EngineReady,
)
from llmserve.engine.health import EngineHealth, HealthState, WatchdogConfig
from llmserve.engine.llm_engine import LLMEngine, check_prompt
from llmserve.engine.lora_commands import LoRACommands
from llmserve.engine.messages import (
    AbortRequest,
    AddPoolingRequest,
    AddRequest,
    EngineMessage,
    EngineStatus,
    FailureKind,
    LoRACommandDone,
    RequestAborted,
    RequestsFailed,
    StepOutputs,
)
from llmserve.engine.output_kinds import OutputAccumulator
from llmserve.engine.supervision import RestartPolicy
from llmserve.metrics.stats import EngineGauges, StepStats
from llmserve.model_loader import load_tokenizer, resolve_model_path
from llmserve.outputs import RequestOutput
from llmserve.sampling_params import RequestOutputKind, SamplingParams
from llmserve.worker.cpu_binding import keep_process_off

logger = logging.getLogger("llmserve")

__all__ = ["AsyncLLM", "EngineDeadError", "EngineFailedError", "RequestFailedError"]


class RequestFailedError(RuntimeError):
    """The engine gave up on this request alone (its step, or its output processing, raised); the
    message is for the client, the cause is in the server log."""


class EngineFailedError(RuntimeError):
    """The engine process runs but can no longer step: a tensor-parallel rank died (the message says
    which, and its exit code)."""


class AsyncLLM:
    def __init__(
        self,
        engine_args: EngineArgs,
        fork: bool = False,
        engine_factory: Callable[..., LLMEngine] = LLMEngine,
        fork_closes: Sequence[int] = (),
        while_loading: Callable[[EngineHealth], None] | None = None,
        bind_cpus: bool = False,
        restart: RestartPolicy | None = None,
        watchdog: WatchdogConfig | None = None,
        warmup: bool = True,
    ) -> None:
        """Start the engine process and wait until its model is loaded and warmed up.

        `fork=True` starts it with every module already imported (a spawned one re-imports torch,
        which takes seconds), but is safe only from a process that has not yet run a parallel torch op:
        OpenMP's worker threads do not survive a fork and the child's first parallel region hangs.
        The server forks before anything runs; everything else gets the default, spawn. A forked
        child inherits every descriptor: it closes this side's pipe ends (else it would never see
        this process exit) and `fork_closes` (the server's listening socket). `while_loading` is
        this process's own start-up work (the server's imports, its start-up responder answering from
        the health it is given: starting, then warming), run while the model loads.
        `bind_cpus` pins a CPU engine's threads one per CPU and keeps this process's threads off the
        engine's main thread's CPU (worker/cpu_binding.py). `restart`: start a new engine process
        (spawned) when this one dies, within the policy's bounds (supervision.py); None: do not, and
        call `on_engine_lost`. `watchdog`: when a busy engine counts as stalled (health.py). `warmup`:
        the engine runs its warm-up (engine/warmup.py) before this returns, and after each restart;
        without it the warm-up listeners get no steps (the wait predictor starts with no prior).
        """
        self.step_listeners: list[Callable[[StepStats | None, list[RequestOutput]], None]] = []
        # at each arrival: the request's id, prompt and parameters
        self.request_listeners: list[Callable[[str, list[int], SamplingParams], None]] = []
        # the engine's warm-up steps (engine/warmup.py), after each start: the wait predictor's prior
        self._warmup_listeners: list[Callable[[list[StepStats]], None]] = []
        self._warmup_steps: list[StepStats] | None = None  # the latest warm-up's, once it is done
        self._warmup_lock = threading.Lock()
        self.gauges = EngineGauges()
        self.health = EngineHealth(watchdog or WatchdogConfig())
        self.on_engine_lost: Callable[[str], None] | None = None  # the engine is gone and not restarted
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._prompts: dict[str, tuple[str | None, list[int]]] = {}  # requests the engine may report on
        self._output_kinds = OutputAccumulator()
        self._queued: dict[str, int] = {}  # prompt tokens of requests sent that have no output yet
        launch = EngineLaunch(engine_args, engine_factory, bind_cpus, warmup)
        self.engine_core = EngineCoreClient(launch, self.health, self, restart)  # the engine process
        self.engine_core.start(fork, fork_closes if fork else ())
        try:
            if while_loading is not None:
                while_loading(self.health)
            # The tokenizer loads here while the engine process loads the model, on the other core,
            # with what renders chat templates (not left to the first chat request).
            self.tokenizer = load_tokenizer(resolve_model_path(engine_args.model))
            self.tokenizer.load_chat_template()
            ready = self.engine_core.wait_until_ready()
        except BaseException:
            self.engine_core.kill()
            raise
        self.config: EngineConfig = ready.config
        self.memory = ready.memory  # the loaded model's (worker/memory_report.py), for /server_info
        self.lora = LoRACommands(self.config.lora, self.engine_core.send)  # adapters loaded at run time
        if ready.main_cpu is not None:  # before the threads below start: they inherit it
            keep_process_off(ready.main_cpu)
        self.health.max_step_tokens = self.config.scheduler.max_num_batched_tokens
        self.on_engine_ready(ready)
        self.engine_core.start_threads()
        self.health.start_watchdog(lambda: bool(self._prompts))

    def on_engine_ready(self, ready: EngineReady) -> None:
        """A new engine is ready: its warm-up's steps are the first speeds (health) and the wait
        predictor's prior (the warm-up listeners); none without a warm-up."""
        steps = ready.warmup_steps
        self.memory = ready.memory  # a restarted engine measured its own
        self.batch_invariance = ready.batch_invariance  # worker/batch_invariance.py, for /server_info
        self.lora.note_cache_keys(ready.lora_keys)
        self.lora.replay()  # a restarted engine: the adapters loaded at run time, again
        self.health.on_warmed_up(steps)
        with self._warmup_lock:
            self._warmup_steps = steps
            for listener in self._warmup_listeners:
                listener(steps)

    # -- the API the server calls ------------------------------------------------------------------

    def encode_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        """Tokenize and validate now, so bad input fails before anything is queued."""
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        check_prompt(prompt_ids, self.config)
        return prompt_ids

    async def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs, each as `params.output_kind` asks (DELTA: only what is new);
        cancelling the iteration aborts it. `prompt_ids` come from `encode_prompt`, the one place a
        prompt is validated: nothing after it checks again."""
        stream = self._register(request_id, prompt_ids, params.output_kind)  # the kind is applied here
        for listener in self.request_listeners:  # before its first output can arrive
            listener(request_id, prompt_ids, params)
        self.engine_core.send(AddRequest(request_id, prompt_ids, params, time.monotonic(), priority))
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
                self.engine_core.send(AbortRequest(request_id))

    async def embed(self, prompt_ids: list[int], request_id: str, priority: int = 0) -> list[float]:
        """The prompt's pooled, L2-normalized vector (an engine pooling request: a prefill only);
        cancelling the wait aborts it. `prompt_ids` come from `encode_prompt`."""
        stream = self._register(request_id, prompt_ids, RequestOutputKind.FINAL_ONLY)
        self.engine_core.send(AddPoolingRequest(request_id, prompt_ids, time.monotonic(), priority))
        output = None
        try:
            output = await stream.get()
            if isinstance(output, BaseException):
                raise output
            if output.embedding is None:  # aborted (the engine stopping) before its prompt ran
                raise EngineDeadError("the request was aborted before its embedding was computed")
            return output.embedding
        finally:
            self._streams.pop(request_id, None)
            if output is None:
                self.engine_core.send(AbortRequest(request_id))

    def _register(self, request_id: str, prompt_ids: list[int], kind: RequestOutputKind) -> asyncio.Queue:
        """A new request's queue, once the engine is known to take requests and the id is free."""
        if not self.is_running:
            if self.health.state is HealthState.RESTARTING:
                raise EngineDeadError("the engine is restarting; retry shortly")
            raise EngineDeadError("the engine has stopped")
        if self.failure is not None:
            raise EngineFailedError(self.failure)
        if request_id in self._streams or request_id in self._prompts:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), stream)
        self._prompts[request_id] = (None, prompt_ids)
        self._queued[request_id] = len(prompt_ids)
        self._output_kinds.add_request(request_id, kind)
        return stream

    def add_warmup_listener(self, listener: Callable[[list[StepStats]], None]) -> None:
        """Call `listener` with the steps of every engine warm-up, at once with the last one if it is
        done (it may finish before the server's app is built)."""
        with self._warmup_lock:
            self._warmup_listeners.append(listener)
            if self._warmup_steps is not None:
                listener(self._warmup_steps)

    def abort(self, request_id: str) -> None:
        """Abort from outside the stream: its iterator receives the final "abort" output."""
        self.engine_core.send(AbortRequest(request_id))

    def has_request(self, request_id: str) -> bool:
        """Whether the engine may still report on this request."""
        return request_id in self._prompts

    @property
    def failure(self) -> str | None:
        """Why the engine can no longer step (a tensor-parallel rank died); None while it can."""
        return self.gauges.failure

    @property
    def queued_prompt_tokens(self) -> int:
        """Prompt tokens of the requests sent that have no output yet: the waiting queue, in tokens."""
        return sum(list(self._queued.values()))  # list(): one copy under the GIL, as the reader pops

    @property
    def _supervised(self) -> bool:
        """Whether a dead rank ends the engine process (to restart it, or for the server to exit)."""
        return self.engine_core.restarts or self.on_engine_lost is not None

    @property
    def is_running(self) -> bool:
        return self.engine_core.is_running

    def shutdown(self, timeout: float = SHUTDOWN_GRACE_SECONDS) -> None:
        """Ask the engine to fail what is in flight and exit; kill it if it has not within `timeout`."""
        self.health.set(HealthState.STOPPING, "the server is shutting down")
        self.health.stop_watchdog()
        self.engine_core.shutdown(timeout)

    # -- what the engine process reports (EngineEvents, called on the client's reader thread) ---------

    def on_engine_message(self, message: EngineMessage) -> str | None:
        """Deliver what `message` says; a dead rank's reason once the streams have heard it, when a
        supervised engine process is to be stopped for it."""
        self._handle(message)
        if self.gauges.failure is not None and self._supervised and self._failure_told(message):
            return self.gauges.failure
        return None

    def on_engine_gone(self, message: str) -> None:
        """The engine process is gone and not restarted: the server's `on_engine_lost`, if set."""
        if self.on_engine_lost is not None:
            self.on_engine_lost(message)

    def _failure_told(self, message: EngineMessage) -> bool:
        """Whether the streams in flight have heard why the engine failed (its RequestsFailed follows
        the status that reports a dead rank): only then may the engine process be stopped, or they
        would end as a plain abort without the rank's name."""
        told = isinstance(message, RequestsFailed) and message.kind is FailureKind.FAILED
        return told or not self._streams

    def on_engine_exit(self, message: str) -> None:
        """End every stream with EngineDeadError; the engine that knew these requests is gone."""
        error = EngineDeadError(message)
        self.lora.fail_all(message)
        self._deliver_all([(request_id, error) for request_id in list(self._streams)])
        for request_id in list(self._prompts):
            self._forget(request_id)
        self.gauges = EngineGauges()

    def _handle(self, message: EngineMessage) -> None:
        if isinstance(message, StepOutputs):
            self.gauges = message.gauges
            self.health.on_step(message.stats)
            deltas = [output for output in map(self._request_output, message.outputs) if output is not None]
            self._deliver_all(self._for_callers(deltas))
            self._notify(message.stats, deltas)
        elif isinstance(message, RequestAborted):
            self.gauges = message.gauges
            output = None if message.output is None else self._request_output(message.output)
            if output is not None:  # its final "abort" output ends a live stream and counts in metrics
                self._deliver_all(self._for_callers([output]))
                self._notify(None, [output])
            self._forget(message.request_id)
        elif isinstance(message, RequestsFailed):
            for request_id in message.request_ids:
                self._forget(request_id)
            error_type = {
                FailureKind.INVALID: ValueError,
                FailureKind.DEAD: EngineDeadError,
                FailureKind.FAILED: EngineFailedError,
                FailureKind.STEP: RequestFailedError,
            }.get(message.kind, RuntimeError)
            error = error_type(message.message)
            self._deliver_all([(request_id, error) for request_id in message.request_ids])
        elif isinstance(message, EngineStatus):
            self.gauges = message.gauges
        elif isinstance(message, LoRACommandDone):
            self.lora.on_done(message)

    def _request_output(self, wire) -> RequestOutput | None:
        """The delta as a RequestOutput with its prompt; None for a request this side forgot."""
        prompt = self._prompts.get(wire.request_id)
        if prompt is None:
            return None
        self._dequeue(wire.request_id)
        if wire.finished:
            del self._prompts[wire.request_id]
        return wire.to_request_output(*prompt)

    def _for_callers(self, deltas: list[RequestOutput]) -> list[tuple[str, RequestOutput]]:
        """Each request's output of the kind it asked for (none yet for FINAL_ONLY before its end)."""
        outputs = map(self._output_kinds.apply, deltas)
        return [(output.request_id, output) for output in outputs if output is not None]

    def _dequeue(self, request_id: str) -> None:
        self._queued.pop(request_id, None)

    def _forget(self, request_id: str) -> None:
        self._dequeue(request_id)
        self._prompts.pop(request_id, None)
        self._output_kinds.forget(request_id)

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
