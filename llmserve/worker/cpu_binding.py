"""Which CPUs the server's two processes run on, when the engine's OpenMP threads fill the machine.

The engine process's main thread runs every step's serial part (scheduling, input preparation,
sampling, output processing, the pipe write of the step's outputs) while its OpenMP workers wait,
and it is OpenMP thread 0 of every parallel region. Whatever preempts it stalls the whole engine. The
server process's output reader is what did: the engine's pipe write wakes it with a "sync" wakeup,
which the kernel places on the writer's own core, so the reader's unpickling and delivery ran in
the engine's place, and the engine's pipe writes took several times longer than they do with the
server's threads elsewhere.

So, on a CPU engine with at least two CPUs, the engine process pins its OpenMP threads one per CPU
(thread 0, the main thread, on the first; vLLM's CPU worker pins its threads the same way) and the
server process keeps all its threads to the other CPUs, where they share a core with an OpenMP worker,
which only waits during the serial part. `llmserve serve --no-cpu-binding` turns it off.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

import torch

from llmserve.kernels.cpu_ops import load_cpu_ops

logger = logging.getLogger("llmserve")


def engine_cpus() -> list[int]:
    """The CPUs of the engine's OpenMP threads, thread t on entry t: of the CPUs this process may use,
    one per physical core first (torch runs one thread per core; two on the SMT siblings of one core
    would share it), then the siblings; as many as torch has threads."""
    allowed = sorted(os.sched_getaffinity(0))
    first_of_core, siblings, cores = [], [], set()
    for cpu in allowed:
        core = _core_of(cpu)
        if core is None or core not in cores:
            first_of_core.append(cpu)
            cores.add(core)
        else:
            siblings.append(cpu)
    return (first_of_core + siblings)[: torch.get_num_threads()]


def _core_of(cpu: int) -> tuple[str, str] | None:
    """(package, core) of a CPU from sysfs; None where the topology cannot be read."""
    topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
    try:
        package = (topology / "physical_package_id").read_text().strip()
        return package, (topology / "core_id").read_text().strip()
    except OSError:
        return None


def bind_engine_threads() -> int | None:
    """Pin this process's OpenMP threads one per CPU; the CPU of the calling (main) thread, or None
    where nothing was pinned (not Linux, fewer than two CPUs or more threads than CPUs, no compiled
    kernels, a refusal)."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    allowed = sorted(os.sched_getaffinity(0))
    cpus = engine_cpus()
    ops = load_cpu_ops()
    if len(cpus) < 2 or len(cpus) < torch.get_num_threads() or ops is None:
        return None
    if not ops.set_omp_thread_cpus([[cpu] for cpu in cpus]):
        ops.set_omp_thread_cpus([allowed] * len(cpus))  # undo a partial binding
        logger.warning("could not pin the engine's threads to CPUs %s; running unpinned", cpus)
        return None
    return cpus[0]


def keep_process_off(cpu: int) -> bool:
    """Move every thread of this process (and so the threads it starts later) off `cpu`; whether done."""
    if not hasattr(os, "sched_getaffinity"):
        return False
    others = os.sched_getaffinity(0) - {cpu}
    if not others:
        return False
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError, ValueError):  # a thread that has just exited
            os.sched_setaffinity(int(task.name), others)
    return True
