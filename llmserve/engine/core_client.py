"""The engine process as the server's process sees it: started, piped to, read from, restarted.

`EngineCoreClient` owns everything of the engine process itself (engine_core.py; forked where the
platform allows, so it starts with this process's imports): the process, its two pipes, the command
queue and the two threads that move the typed messages of messages.py. A sender batches commands
into one pipe write (the engine may be mid-step and not reading; the event loop must never wait on
it); a reader hands each message to the client's `EngineEvents` (AsyncLLM, which owns the requests
and their streams). When the engine process dies the reader tells the events, then starts a new
one within the restart policy's bounds (supervision.py) or gives up.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from llmserve.config import EngineArgs, EngineConfig
from llmserve.engine.engine_core import run_engine_core
from llmserve.engine.health import EngineHealth, HealthState
from llmserve.engine.llm_engine import LLMEngine
from llmserve.engine.messages import EngineLoadFailed, EngineMessage, EngineWarming, Shutdown
from llmserve.engine.supervision import RestartBudget, RestartPolicy
from llmserve.metrics.stats import StepStats
from llmserve.worker.cpu_binding import keep_process_off
from llmserve.worker.memory_report import MemoryReport

logger = logging.getLogger("llmserve")

SHUTDOWN_GRACE_SECONDS = 5.0


class EngineDeadError(RuntimeError):
    pass


@dataclass(frozen=True)
class EngineLaunch:
    """What each engine process is started with (the first and every restart)."""

    engine_args: EngineArgs
    engine_factory: Callable[..., LLMEngine] = LLMEngine
    bind_cpus: bool = False  # pin a CPU engine's threads (worker/cpu_binding.py)
    warmup: bool = True  # run the engine's warm-up (engine/warmup.py) before it says it is ready


@dataclass(frozen=True)
class EngineReady:
    """A loaded, warmed-up engine process: its config, its main thread's CPU, its warm-up's steps,
    and what its model holds in memory (None from an engine that does not measure it)."""

    config: EngineConfig
    main_cpu: int | None
    warmup_steps: list[StepStats]
    memory: MemoryReport | None = None
    batch_invariance: tuple[str, ...] | None = None  # worker/batch_invariance.py; None: not reported
    lora_keys: dict[str, bytes] | None = None  # the loaded adapters' prefix-cache keys; None: not reported


class EngineEvents(Protocol):
    """What the client tells its owner (called on the reader thread)."""

    @property
    def failure(self) -> str | None:
        """Why the engine can no longer step (a dead rank), as the engine last reported it."""

    def on_engine_message(self, message: EngineMessage) -> str | None:
        """Take one message; a reason to stop this engine process now (a dead rank the streams have
        heard of, under supervision), else None."""

    def on_engine_exit(self, message: str) -> None:
        """The engine process is gone: end what was in flight with `message`."""

    def on_engine_ready(self, ready: EngineReady) -> None:
        """A restarted engine process is ready."""

    def on_engine_gone(self, message: str) -> None:
        """The engine process is gone and will not be restarted."""


class EngineCoreClient:
    def __init__(
        self,
        launch: EngineLaunch,
        health: EngineHealth,
        events: EngineEvents,
        restart: RestartPolicy | None = None,
    ) -> None:
        """No process yet: `start` starts one. `health` is the owner's, which this client sets while
        the engine warms up, restarts or stops; `restart` None: a dead engine is not restarted."""
        self.launch = launch
        self.health = health
        self._events = events
        self._restarts = None if restart is None else RestartBudget(restart)
        self._stopping = threading.Event()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()

    @property
    def restarts(self) -> bool:
        """Whether a dead engine process is started again."""
        return self._restarts is not None

    @property
    def pid(self) -> int:
        """The current engine process's id."""
        return self._process.pid

    @property
    def is_running(self) -> bool:
        return self._process.is_alive() and not self._stopping.is_set()

    def send(self, command: EngineMessage) -> None:
        """Queue a command for the sender thread; never blocks."""
        self._commands.put(command)

    def start(self, fork: bool = False, fork_closes: Sequence[int] = ()) -> None:
        """A new engine process with its two pipes and command queue. `fork=True` starts it with
        every module already imported (see AsyncLLM); a forked child inherits every descriptor and
        closes this side's pipe ends and `fork_closes` (the server's listening socket)."""
        context = multiprocessing.get_context("fork" if fork else "spawn")
        self._commands = queue.SimpleQueue()
        engine_commands, self._command_pipe = context.Pipe(duplex=False)
        self._output_pipe, engine_outputs = context.Pipe(duplex=False)
        inherited = (self._command_pipe.fileno(), self._output_pipe.fileno(), *fork_closes) if fork else ()
        launch = self.launch
        self._process = context.Process(
            target=run_engine_core,
            args=(
                launch.engine_args,
                engine_commands,
                engine_outputs,
                launch.engine_factory,
                inherited,
                logger.getEffectiveLevel(),
                launch.bind_cpus,
                launch.warmup,
            ),
            name="llmserve-engine",
            # Not daemonic: a daemonic process may not start children (tensor-parallel workers). It
            # still ends with this process: it watches it (worker/parent_watch.py), and at interpreter
            # exit it is killed here before multiprocessing would wait for it.
            daemon=False,
        )
        self._process.start()
        atexit.register(_kill_at_exit, self._process)
        engine_commands.close()  # the child's ends: closing ours lets each side see the other exit
        engine_outputs.close()

    def wait_until_ready(self) -> EngineReady:
        """The engine's config, main CPU and warm-up steps once it is loaded and warmed up; /health
        says `warming` while it warms up (engine/warmup.py)."""
        try:
            message = self._output_pipe.recv()
            if isinstance(message, EngineWarming):
                self.health.set(HealthState.WARMING, "the engine is warming up")
                message = self._output_pipe.recv()
        except EOFError:
            self._process.join()
            raise EngineDeadError(
                f"the engine process exited while loading (exit code {self._process.exitcode})"
            ) from None
        if isinstance(message, EngineLoadFailed):
            self._process.join()
            raise message.error  # bad model or flags: the caller reports it, as in one process
        return EngineReady(
            message.config,
            message.main_cpu,
            message.warmup_steps,
            message.memory,
            message.batch_invariance,
            message.lora_keys,
        )

    def start_threads(self) -> None:
        """The sender and reader of the current engine process (each bound to its own pipe)."""
        sender = threading.Thread(
            target=self._send_commands,
            args=(self._commands, self._command_pipe),
            name="llmserve-engine-send",
            daemon=True,
        )
        reader = threading.Thread(
            target=self._read_outputs,
            args=(self._process, self._output_pipe),
            name="llmserve-engine-read",
            daemon=True,
        )
        sender.start()
        reader.start()

    def kill(self) -> None:
        """End the current engine process now and wait for it."""
        self._process.kill()
        self._process.join()

    def shutdown(self, timeout: float = SHUTDOWN_GRACE_SECONDS) -> None:
        """Ask the engine to fail what is in flight and exit; kill it if it has not within `timeout`."""
        if not self._stopping.is_set():
            self._stopping.set()
            self._commands.put(Shutdown())
        if timeout > 0:
            self._process.join(timeout)
            if self._process.is_alive():
                self.kill()

    # -- the sender and reader threads ---------------------------------------------------------------

    def _send_commands(self, commands: queue.SimpleQueue, pipe) -> None:
        """Pipe every queued command, all that have piled up in one write."""
        while True:
            batch = [commands.get()]
            with contextlib.suppress(queue.Empty):
                while True:
                    batch.append(commands.get_nowait())
            if any(command is None for command in batch):  # this engine process was replaced
                return
            try:
                pipe.send(batch)
            except OSError:  # the engine process is gone; the reader fails the streams
                return
            if any(isinstance(command, Shutdown) for command in batch):
                return

    def _read_outputs(self, process: multiprocessing.Process, pipe) -> None:
        try:
            while True:
                stop_reason = self._events.on_engine_message(pipe.recv())
                if stop_reason is not None:
                    self._set_gone(stop_reason)  # /health 503 before the kill, not `stopping`
                    process.kill()  # a dead rank: a new engine process brings up all the ranks again
        except (EOFError, OSError):
            pass
        except BaseException:  # a bug on this side: fail every stream rather than leave it hanging
            logger.exception("reading the engine's outputs failed")
            process.kill()
        process.join(SHUTDOWN_GRACE_SECONDS)
        if self._stopping.is_set():
            self._events.on_engine_exit("the server is shutting down")
            return
        message = f"the engine process exited unexpectedly (exit code {process.exitcode}); see the server log"
        if self._events.failure is not None:
            message = f"{self._events.failure}; the engine process was stopped"
        logger.error(message)
        self._set_gone(message)  # /health turns 503 before any stream hears of it
        self._commands.put(None)  # the sender of this engine process ends
        self._events.on_engine_exit(message)
        self._restart_or_give_up(message)

    def _set_gone(self, message: str) -> None:
        """/health for an engine process that is gone: restarting, or stopping without supervision
        (the supervisor may say stopping instead)."""
        state = HealthState.RESTARTING if self._restarts is not None else HealthState.STOPPING
        self.health.set(state, message)

    def _restart_or_give_up(self, message: str) -> None:
        """Start a new engine process after the policy's back-off; give up when it allows no more."""
        while True:
            delay = None if self._restarts is None else self._restarts.next_delay()
            if delay is None:
                self.health.set(HealthState.STOPPING, f"{message}; not restarted")
                self._stopping.set()
                self._events.on_engine_gone(message)
                return
            self.health.set(HealthState.RESTARTING, message)
            logger.warning("restarting the engine process in %.1f s", delay)
            if self._stopping.wait(delay):
                return
            try:
                self.start()  # spawned: this process has threads by now
                ready = self.wait_until_ready()
            except BaseException as error:  # noqa: BLE001 - the next try, or giving up, follows
                self.kill()
                message = f"restarting the engine process failed: {error}"
                logger.error(message)
                continue
            if self._stopping.is_set():  # shut down while it loaded
                self.kill()
                return
            if ready.main_cpu is not None:
                keep_process_off(ready.main_cpu)
            self.health.num_restarts += 1
            self._events.on_engine_ready(ready)
            logger.warning("the engine process restarted (restart %d)", self.health.num_restarts)
            self.start_threads()
            return


def _kill_at_exit(process: multiprocessing.Process) -> None:
    if process.is_alive():
        process.kill()
        process.join()
