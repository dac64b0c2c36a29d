"""One logging set-up for every llmserve process: the CLI's, and an engine process started by spawn.

A forked engine process inherits the server's handlers; a spawned one starts with none, and without
this its INFO lines (model ready, KV cache size, speculative decoding) were lost.
"""

from __future__ import annotations

import logging
import sys

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(level: int) -> None:
    """Root logging to stderr at `level`, unless this process already has handlers (a fork)."""
    logging.basicConfig(level=level, format=LOG_FORMAT, stream=sys.stderr)
