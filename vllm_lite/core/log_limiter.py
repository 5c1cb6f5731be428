"""Rate-limited warnings: a peer spraying junk must not flood the engine core's log."""

from __future__ import annotations

import logging
import time
from typing import Any


class LogLimiter:
    """At most ``burst`` warnings per ``window_s``; the rest are counted and reported once.

    Shared by the input thread and the busy loop without a lock: a race only miscounts.
    """

    def __init__(self, logger: logging.Logger, burst: int = 20, window_s: float = 60.0) -> None:
        self.logger = logger
        self.burst, self.window_s = burst, window_s
        self.window_start, self.count, self.suppressed = 0.0, 0, 0

    def warn(self, msg: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self.window_start > self.window_s:
            if self.suppressed:
                self.logger.warning("(%d similar messages suppressed)", self.suppressed)
            self.window_start, self.count, self.suppressed = now, 0, 0
        self.count += 1
        if self.count <= self.burst:
            self.logger.warning(msg, *args)
        else:
            self.suppressed += 1
