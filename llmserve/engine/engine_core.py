"""The engine in its own process: the server process sends commands, this loop steps and sends outputs.

Why a process: in a thread of the server, the engine shared the GIL with the event loop (the SSE
work, request parsing) and stepped torch from a non-main thread, and HTTP throughput trailed the
offline engine by 3-18% (docs/benchmarks.md). Here the engine owns its process's main thread and
interpreter; the server keeps tokenization, validation and streaming.

Messages (tuples, pickled by multiprocessing.connection):
  server -> engine, a list per send: ("add", request_id, prompt_ids, params, arrival_time, priority),
      ("abort", request_id), ("shutdown",).
  engine -> server: ("ready", (config, CPU of the engine's main thread or None)) or
      ("load_failed", exception) once; then
      ("step", output deltas, StepStats, EngineGauges) after every step,
      ("aborted", output delta or None, request_id, EngineGauges) for every abort command,
      ("failed", request_ids, kind, message) for requests the engine gave up on
      (kind "invalid": add_request refused it; "step": a step raised; "dead": the engine is stopping).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from collections.abc import Callable
from multiprocessing.connection import Connection

from llmserve.config import EngineArgs
from llmserve.engine.llm_engine import LLMEngine
from llmserve.engine.output_wire import OutputEncoder
from llmserve.log import configure_logging
from llmserve.metrics.stats import EngineGauges
from llmserve.worker.cpu_binding import bind_engine_threads

logger = logging.getLogger("llmserve")


def run_engine_core(
    engine_args: EngineArgs,
    commands: Connection,
    outputs: Connection,
    engine_factory: Callable[[EngineArgs], LLMEngine] = LLMEngine,
    inherited_fds: tuple[int, ...] = (),
    log_level: int = logging.WARNING,
    bind_cpus: bool = False,
) -> None:
    """The engine process's entry point; `inherited_fds` are the server's descriptors a fork copied,
    `log_level` the server's level for llmserve's loggers (a spawned process starts without it),
    `bind_cpus` pins a CPU engine's threads one per CPU (worker/cpu_binding.py)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the server decides
    configure_logging(log_level)  # a no-op after a fork, which kept the server's handlers
    logger.setLevel(log_level)
    for fd in inherited_fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    try:
        engine = engine_factory(engine_args)
    except BaseException as error:  # noqa: BLE001 - the server process raises it in its own
        outputs.send(("load_failed", _picklable(error)))
        return
    main_cpu = None
    if bind_cpus and engine.config.model.device.type == "cpu":
        main_cpu = bind_engine_threads()
    outputs.send(("ready", (engine.config, main_cpu)))
    EngineCore(engine, commands, outputs).run()


class EngineCore:
    def __init__(self, engine: LLMEngine, commands: Connection, outputs: Connection) -> None:
        self.engine = engine
        self.commands = commands
        self.outputs = outputs
        self.encoder = OutputEncoder()

    def run(self) -> None:
        try:
            while self._receive(block=not self.engine.has_unfinished_requests()):
                if self.engine.has_unfinished_requests():
                    self._step()
            self._fail_all("dead", "the server is shutting down")
        except (BrokenPipeError, EOFError):
            pass  # the server process is gone: nobody is left to tell

    def _receive(self, block: bool) -> bool:
        """Apply every command that has arrived (waiting for one if `block`); False: stop."""
        timeout = None if block else 0.0
        try:
            while self.commands.poll(timeout):
                for command in self.commands.recv():
                    if command[0] == "shutdown":
                        return False
                    self._apply(command)
                timeout = 0.0
        except (EOFError, OSError):
            return False  # the server process closed its end
        return True

    def _apply(self, command: tuple) -> None:
        if command[0] == "abort":
            request_id = command[1]
            output = self.engine.abort_request(request_id)
            delta = None if output is None else self.encoder.encode(output)
            self.outputs.send(("aborted", delta, request_id, self._gauges()))
            return
        _, request_id, prompt_ids, params, arrival_time, priority = command
        try:
            self.engine.add_request(request_id, prompt_ids, params, arrival_time, priority)
        except ValueError as error:
            self.outputs.send(("failed", [request_id], "invalid", str(error)))

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as error:  # noqa: BLE001 - one bad step must not take the server down
            logger.exception("engine step failed; failing the requests in flight")
            self._fail_all("step", f"{type(error).__name__}: {error}")
            return
        deltas = [self.encoder.encode(output) for output in outputs]
        self.outputs.send(("step", deltas, self.engine.last_step, self._gauges()))

    def _fail_all(self, kind: str, message: str) -> None:
        request_ids = list(self.engine.output_processor.parents)
        for request_id in request_ids:
            self.engine.abort_request(request_id)
            self.encoder.forget(request_id)
        self.outputs.send(("failed", request_ids, kind, message))

    def _gauges(self) -> EngineGauges:
        scheduler = self.engine.scheduler
        return EngineGauges(
            num_running=scheduler.num_running,
            num_waiting=scheduler.num_waiting,
            kv_cache_usage=self.engine.kv_cache_manager.usage,
            spec_decode=self.engine.spec_decode_stats,
        )


def _picklable(error: BaseException) -> BaseException:
    """The exception itself when it survives pickling, else a RuntimeError with its message."""
    import pickle

    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - any pickling failure
        return RuntimeError(f"{type(error).__name__}: {error}")
