"""The server's side of run-time LoRA loading: which adapters the engine serves, and the commands
that load and unload them (engine_core.py applies them between steps and answers each).

Adapters loaded at run time are sent again to an engine process started after a crash, so the
names the server lists stay the ones the engine serves.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
from collections.abc import Callable

from llmserve.config.lora import LoRAConfig
from llmserve.engine.messages import LoRACommand, LoRACommandDone


class LoRACommands:
    def __init__(self, config: LoRAConfig | None, send: Callable[[LoRACommand], None]) -> None:
        self.enabled = config is not None
        self.adapters: dict[str, str] = dict(config.modules) if config is not None else {}  # name -> path
        self._at_start = dict(self.adapters)  # what every engine process loads at its start
        # name -> the engine's prefix-cache key of the adapter's requests (LLMEngine.lora_cache_keys),
        # for /server_info: a router hashes an adapter's prompts with it
        self._cache_keys: dict[str, bytes] = {}
        self._send = send
        self._ids = itertools.count()
        # command id -> the waiting loop and future, and the adapter it loads (None: an unload)
        self._pending: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future, str | None]] = {}
        self._lock = threading.Lock()  # answers arrive on the engine client's reader thread

    @property
    def names(self) -> tuple[str, ...]:
        with self._lock:
            return tuple(self.adapters)

    def cache_keys(self) -> dict[str, bytes]:
        """The served adapters' prefix-cache keys that the engine has reported, by name."""
        with self._lock:
            return {name: key for name, key in self._cache_keys.items() if name in self.adapters}

    def note_cache_keys(self, keys: dict[str, bytes] | None) -> None:
        """An engine process's keys of the adapters it loaded at its start (EngineReady); a name
        unloaded or loaded from elsewhere since keeps the key its run-time load reported."""
        with self._lock:
            for name, key in (keys or {}).items():
                if self.adapters.get(name) == self._at_start.get(name):
                    self._cache_keys[name] = key

    async def load(self, name: str, path: str) -> None:
        """Load adapter `name` from PEFT directory `path`; ValueError saying why the engine refused."""
        if not self.enabled:
            raise ValueError("LoRA adapters need --enable-lora")
        if name in self.adapters:
            raise ValueError(f"the LoRA adapter {name!r} is already loaded")
        await self._run(LoRACommand(self._next_id(), name, path), loads=name)
        with self._lock:  # replay() reads the adapters on the engine client's reader thread
            self.adapters[name] = path

    async def unload(self, name: str) -> None:
        """Unload adapter `name`; ValueError if unknown or in use."""
        if name not in self.adapters:
            raise ValueError(f"the LoRA adapter {name!r} does not exist")
        await self._run(LoRACommand(self._next_id(), name))
        with self._lock:
            del self.adapters[name]
            self._cache_keys.pop(name, None)

    def replay(self) -> None:
        """A new engine process: send it the adapters loaded at run time (nobody waits for these).
        Runs on the engine client's reader thread: it reads a snapshot taken under the lock, as the
        event loop's load and unload change the adapters meanwhile."""
        with self._lock:
            adapters = dict(self.adapters)
        for name, path in self._at_start.items():  # unloaded (or loaded again from elsewhere) since
            if adapters.get(name) != path:
                self._send(LoRACommand(f"replay-{self._next_id()}", name))
        for name, path in adapters.items():
            if self._at_start.get(name) != path:
                self._send(LoRACommand(f"replay-{self._next_id()}", name, path))

    def on_done(self, message: LoRACommandDone) -> None:
        with self._lock:
            target = self._pending.pop(message.command_id, None)
            if target is not None and target[2] is not None and message.error is None:
                self._cache_keys[target[2]] = message.cache_key
        if target is not None:
            _settle_later(target[0], target[1], message.error)

    def fail_all(self, message: str) -> None:
        """The engine process is gone: every command waiting for an answer fails with `message`."""
        with self._lock:
            pending, self._pending = self._pending, {}
        for loop, future, _ in pending.values():
            _settle_later(loop, future, f"the engine stopped before applying the command: {message}")

    async def _run(self, command: LoRACommand, loads: str | None = None) -> None:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            self._pending[command.command_id] = (loop, future, loads)
        self._send(command)
        error = await future
        if error is not None:
            raise ValueError(error)

    def _next_id(self) -> str:
        return f"lora-{next(self._ids)}"


def _settle_later(loop: asyncio.AbstractEventLoop, future: asyncio.Future, error: str | None) -> None:
    with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits any more
        loop.call_soon_threadsafe(_settle, future, error)


def _settle(future: asyncio.Future, error: str | None) -> None:
    if not future.done():
        future.set_result(error)
