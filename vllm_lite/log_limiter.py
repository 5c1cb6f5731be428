"""Rate-limited warnings: a peer spraying junk must not flood the engine core's log, nor hide other refusals.

Each kind of warning (its message template) has its own budget, so a burst of malformed frames does not
silence the authentication refusals that follow; what was held back is reported per kind once its window
ends, by the next warning or by the core's housekeeping tick (`flush`), so an attack shows in the log.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable


class LogLimiter:
    """At most ``burst`` warnings per kind per ``window_s``; the rest are counted and reported once.

    Shared by the input thread and the busy loop without a lock: a race only miscounts.
    """

    def __init__(
        self,
        logger: logging.Logger,
        burst: int = 20,
        window_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self._clock = clock
        self.burst, self.window_s = burst, window_s
        # message template -> [window start, warnings in the window, suppressed in the window]
        self._kinds: dict[str, list[Any]] = {}

    def warn(self, msg: str, *args: Any) -> None:
        now = self._clock()
        state = self._kinds.get(msg)
        if state is None or now - state[0] > self.window_s:
            if state is not None:
                self._report(msg, state)
            state = self._kinds[msg] = [now, 0, 0]
        state[1] += 1
        if state[1] <= self.burst:
            self.logger.warning(msg, *args)
        else:
            state[2] += 1

    def flush(self) -> None:
        """Report the kinds whose window has ended with warnings held back (called a few times a second)."""
        now = self._clock()
        for msg, state in list(self._kinds.items()):
            if now - state[0] > self.window_s:
                self._report(msg, state)
                del self._kinds[msg]

    @property
    def suppressed(self) -> int:
        """Warnings held back in the current windows, all kinds."""
        return sum(state[2] for state in self._kinds.values())

    def _report(self, msg: str, state: list[Any]) -> None:
        if state[2]:
            self.logger.warning("(%d more like %r suppressed in %.0f s)", state[2], msg, self.window_s)
