"""The engine in its own process: the server process sends commands, this loop steps and sends outputs.

Why a process: in a thread of the server, the engine shared the GIL with the event loop (the SSE
work, request parsing) and stepped torch from a non-main thread, and HTTP throughput trailed the
offline engine. Here the engine owns its process's main thread and
interpreter; the server keeps tokenization, validation and streaming. The messages both ways are
the typed structs of messages.py; outputs cross as deltas.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
from collections import Counter
from collections.abc import Callable
from multiprocessing.connection import Connection, wait

from llmserve.config import EngineArgs
from llmserve.engine.llm_engine import BatchFailed, LLMEngine
from llmserve.engine.messages import (
    AbortRequest,
    AddPoolingRequest,
    AddRequest,
    EngineLoadFailed,
    EngineOutput,
    EngineReady,
    EngineStatus,
    EngineWarming,
    FailureKind,
    LoRACommand,
    LoRACommandDone,
    RequestAborted,
    RequestsFailed,
    Shutdown,
    StepOutputs,
)
from llmserve.engine.warmup import warm_up
from llmserve.log import configure_logging
from llmserve.metrics.stats import EngineGauges
from llmserve.worker.cpu_binding import bind_engine_threads
from llmserve.worker.malloc_tuning import keep_large_allocations_on_the_heap, release_free_heap
from llmserve.worker.parent_watch import exit_with_parent

logger = logging.getLogger("llmserve")

# What a failed request's client reads: the cause, with its internals, goes to the server log only.
_STEP_FAILED = "the engine step running this request failed; the server log has the cause"
_LOGITS_FAILED = (
    "applying this request's logits processors (structured-output grammar, logit_bias) failed; "
    "the server log has the cause"
)
_OUTPUT_FAILED = (
    "processing this request's output (text, stop strings, logprobs) failed; the server log has the cause"
)


def run_engine_core(
    engine_args: EngineArgs,
    commands: Connection,
    outputs: Connection,
    engine_factory: Callable[..., LLMEngine] = LLMEngine,
    inherited_fds: tuple[int, ...] = (),
    log_level: int = logging.WARNING,
    bind_cpus: bool = False,
    warmup: bool = False,
) -> None:
    """The engine process's entry point; `inherited_fds` are the server's descriptors a fork copied,
    `log_level` the server's level for llmserve's loggers (a spawned process starts without it),
    `bind_cpus` pins a CPU engine's threads one per CPU (worker/cpu_binding.py), `warmup` runs the
    warm-up (engine/warmup.py) between EngineWarming and EngineReady, which carries its measured steps."""
    # Not a daemonic process (tensor-parallel workers are its children), so it ends itself with the server.
    exit_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the server decides
    configure_logging(log_level)  # a no-op after a fork, which kept the server's handlers
    logger.setLevel(log_level)
    for fd in inherited_fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    keep_large_allocations_on_the_heap()  # so the model's loading waits less for the KV prefault
    try:  # a warm-up waits for structured outputs' one-time costs: started beside the model's loading
        # deltas only: they cross to the server, which applies each request's output kind
        engine = engine_factory(engine_args, prepare_structured_outputs=warmup, apply_output_kinds=False)
    except BaseException as error:  # noqa: BLE001 - the server process raises it in its own
        outputs.send(EngineLoadFailed(_picklable(error)))
        return
    release_free_heap()
    main_cpu = None
    if bind_cpus and engine.config.model.device.type == "cpu":
        main_cpu = bind_engine_threads()
    steps = []
    if warmup:  # on the bound threads, so the warm-up is what the first requests find
        outputs.send(EngineWarming())
        steps = warm_up(engine)
    freeze_startup_objects()
    # a test's stand-in engine measures nothing
    memory, invariance = getattr(engine, "memory", None), getattr(engine, "batch_invariance", None)
    lora_keys = engine.lora_cache_keys() if hasattr(engine, "lora_cache_keys") else None
    outputs.send(EngineReady(engine.config, main_cpu, steps, memory, invariance, lora_keys))
    try:
        EngineCore(engine, commands, outputs).run()
    finally:
        engine.shutdown()  # tensor-parallel workers stop with the engine


def freeze_startup_objects() -> None:
    """Collect the start-up's garbage, then exempt every object left (the model, the tokenizer, the
    libraries: this process's lifetime) from the cyclic collector: a full collection otherwise walks
    them all, a pause of many decode steps whenever the requests' objects trigger one."""
    gc.collect()
    gc.freeze()


class EngineCore:
    def __init__(self, engine: LLMEngine, commands: Connection, outputs: Connection) -> None:
        self.engine = engine
        self.commands = commands
        self.outputs = outputs

    def run(self) -> None:
        try:
            while self._receive(block=not self.engine.has_unfinished_requests()):
                if self.engine.has_unfinished_requests():
                    self._step()
            self._fail_all(FailureKind.DEAD, "the server is shutting down")
        except (BrokenPipeError, EOFError):
            pass  # the server process is gone: nobody is left to tell

    def _receive(self, block: bool) -> bool:
        """Apply every command that has arrived (waiting for one if `block`); False: stop."""
        try:
            if block:
                self._wait_for_command()
            timeout = 0.0
            while self.commands.poll(timeout):
                for command in self.commands.recv():
                    if isinstance(command, Shutdown):
                        return False
                    self._apply(command)
                timeout = 0.0
        except (EOFError, OSError):
            return False  # the server process closed its end
        return True

    def _wait_for_command(self) -> None:
        """Block until a command arrives; a tensor-parallel worker exiting meanwhile is reported."""
        while sentinels := self.engine.rank_sentinels():
            if self.commands in wait([self.commands, *sentinels]):
                return
            if self.engine.check_ranks() is not None:
                self.outputs.send(EngineStatus(self._gauges()))
        self.commands.poll(None)

    def _apply(self, command: AddRequest | AddPoolingRequest | AbortRequest | LoRACommand) -> None:
        if isinstance(command, LoRACommand):
            self._apply_lora(command)
            return
        if isinstance(command, AbortRequest):
            output = self.engine.abort_request(command.request_id)
            wire = None if output is None else EngineOutput.of(output)
            self.outputs.send(RequestAborted(command.request_id, wire, self._gauges()))
            return
        if self.engine.failure is not None:
            self.outputs.send(RequestsFailed([command.request_id], FailureKind.FAILED, self.engine.failure))
            return
        try:
            if isinstance(command, AddPoolingRequest):
                self.engine.add_pooling_request(
                    command.request_id, command.prompt_token_ids, command.arrival_time, command.priority
                )
            else:
                self.engine.add_tokenized_request(
                    command.request_id,
                    command.prompt_token_ids,
                    command.params,
                    command.arrival_time,
                    command.priority,
                )
        except ValueError as error:
            self.outputs.send(RequestsFailed([command.request_id], FailureKind.INVALID, str(error)))

    def _apply_lora(self, command: LoRACommand) -> None:
        """Load or unload an adapter between steps; the answer names why it was refused, if it was."""
        try:
            if command.path is None:
                self.engine.remove_lora(command.name)
            else:
                self.engine.add_lora(command.name, command.path)
        except Exception as error:  # noqa: BLE001 - an unreadable adapter must not take the engine down
            self.outputs.send(LoRACommandDone(command.command_id, str(error) or type(error).__name__))
            return
        key = b"" if command.path is None else self.engine.lora_cache_keys().get(command.name, b"")
        self.outputs.send(LoRACommandDone(command.command_id, None, key))

    def _step(self) -> None:
        try:
            outputs = self.engine.step()  # deltas (the engine applies no output kind here)
        except BatchFailed as failed:  # the forward pass or sampling: its batch fails, no other request
            logger.error(
                "engine step failed; failing its batch of %d requests",
                len(failed.request_ids),
                exc_info=failed.__cause__,
            )
            self.engine.fail_requests(failed.request_ids)
            self.outputs.send(RequestsFailed(failed.request_ids, FailureKind.STEP, _STEP_FAILED))
            self.outputs.send(EngineStatus(self._gauges()))
            return
        except Exception:  # noqa: BLE001 - one bad step must not take the server down
            if self.engine.failure is not None:  # a rank died: the executor logged which
                self.outputs.send(EngineStatus(self._gauges()))  # /health first, then the streams
                self._fail_all(FailureKind.FAILED, self.engine.failure)
                return
            logger.exception("engine step failed; failing the requests in flight")
            self._fail_all(FailureKind.STEP, _STEP_FAILED)
            return
        if self.engine.failed_requests:  # their output processing raised; the server log says why
            self.outputs.send(RequestsFailed(self.engine.failed_requests, FailureKind.STEP, _OUTPUT_FAILED))
        if self.engine.failed_logits_requests:  # a logits processor of theirs (a grammar mask) raised
            self.outputs.send(
                RequestsFailed(self.engine.failed_logits_requests, FailureKind.STEP, _LOGITS_FAILED)
            )
        wire = [EngineOutput.of(output) for output in outputs]
        self.outputs.send(StepOutputs(wire, self.engine.last_step, self._gauges()))

    def _fail_all(self, kind: FailureKind, message: str) -> None:
        request_ids = list(self.engine.output_processor.parents)
        for request_id in request_ids:
            self.engine.abort_request(request_id)
        self.outputs.send(RequestsFailed(request_ids, kind, message))

    def _gauges(self) -> EngineGauges:
        scheduler = self.engine.scheduler
        return EngineGauges(
            num_running=scheduler.num_running,
            num_waiting=scheduler.num_waiting,
            kv_cache_usage=self.engine.kv_cache_manager.usage,
            num_swapped=len(self.engine.kv_cache_manager.swap_space.tables),
            swap_space_usage=self.engine.kv_cache_manager.swap_space.usage,
            spec_decode=self.engine.spec_decode_stats,
            ranks=self.engine.rank_stats(),
            failure=self.engine.failure,
            invariant_violations=0 if self.engine.invariants is None else self.engine.invariants.violations,
            lora_requests=self._lora_requests(),
            max_loras=0 if self.engine.config.lora is None else self.engine.config.lora.max_loras,
        )

    def _lora_requests(self) -> tuple[tuple[str, int, int], ...]:
        """(name, running, waiting) of each loaded LoRA adapter; () with LoRA off."""
        lora, scheduler = self.engine.model_runner.lora, self.engine.scheduler
        if lora is None:
            return ()
        running = Counter(r.sampling_params.lora_name for r in scheduler.running)
        waiting = Counter(r.sampling_params.lora_name for r in scheduler.waiting)
        return tuple((name, running[name], waiting[name]) for name in lora.adapters)


def _picklable(error: BaseException) -> BaseException:
    """The exception itself when it survives pickling, else a RuntimeError with its message."""
    import pickle

    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - any pickling failure
        return RuntimeError(f"{type(error).__name__}: {error}")
