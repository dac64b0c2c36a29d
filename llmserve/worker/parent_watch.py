"""Ending a child process with the process that started it, however that one ended (a SIGKILL too).

multiprocessing gives every child it starts (fork or spawn) a sentinel: a pipe whose write end only
the parent holds, so it reads end-of-file once the parent is gone. A daemon thread waits on it and
exits the process. Unlike prctl's PR_SET_PDEATHSIG it follows the parent process, not the thread
that started the child, and needs no Linux-only call.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
from multiprocessing.connection import wait

logger = logging.getLogger("llmserve")

PARENT_GONE_EXIT_CODE = 3


def exit_with_parent() -> None:
    """From now on, exit this process as soon as its multiprocessing parent is gone."""
    parent = multiprocessing.parent_process()
    if parent is None:
        raise RuntimeError("exit_with_parent: this process was not started by multiprocessing")
    threading.Thread(
        target=_exit_when_ready, args=(parent.sentinel,), name="llmserve-parent-watch", daemon=True
    ).start()


def _exit_when_ready(sentinel: int) -> None:
    wait([sentinel])
    logger.error("the process that started this one is gone; exiting")
    os._exit(PARENT_GONE_EXIT_CODE)  # no clean-up: the parent that would wait for it is gone
