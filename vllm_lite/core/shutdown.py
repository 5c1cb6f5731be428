"""When the engine core stops: running -> draining(deadline) -> stopped.

SIGTERM (and SIGINT for a daemon) or ``request()`` from any thread asks for a stop. The busy
loop then calls ``advance`` once per turn: the core takes no new work while draining, stops
as soon as nothing is running, and stops anyway once ``drain_timeout_s`` has passed (the loop
aborts what is left; ``drain_expired`` says so).
"""

from __future__ import annotations

import enum
import logging
import signal
import threading
import time
from typing import Any, Optional

logger = logging.getLogger(__name__)


class Phase(enum.Enum):
    RUNNING = "running"
    DRAINING = "draining"
    STOPPED = "stopped"


class ShutdownState:
    """The engine core's stop state; ``request`` is safe from signal handlers and other threads."""

    def __init__(self, drain_timeout_s: float) -> None:
        self.drain_timeout_s = drain_timeout_s
        self._requested = threading.Event()
        self.phase = Phase.RUNNING
        self.deadline: Optional[float] = None
        self.drain_expired = False

    def request(self) -> None:
        """Stop taking work and drain (idempotent)."""
        self._requested.set()

    @property
    def requested(self) -> bool:
        """True from the moment a stop was asked for: new requests and frontends are refused."""
        return self._requested.is_set()

    def install_signal_handlers(self, handle_sigint: bool) -> None:
        """SIGTERM (and SIGINT when ``handle_sigint``) request the stop. Main thread only."""

        def on_signal(signum: int, frame: Any) -> None:
            self.request()

        signal.signal(signal.SIGTERM, on_signal)
        if handle_sigint:
            signal.signal(signal.SIGINT, on_signal)

    def advance(self, has_unfinished: bool, now: Optional[float] = None) -> Phase:
        """Move on given whether requests are still running; returns the phase now in force."""
        if self.phase is Phase.STOPPED or not self.requested:
            return self.phase
        now = time.monotonic() if now is None else now
        if self.phase is Phase.RUNNING:
            logger.info("Shutdown requested: draining running requests for up to %.1f s.", self.drain_timeout_s)
            self.phase = Phase.DRAINING
            self.deadline = now + self.drain_timeout_s
        if not has_unfinished:
            self.phase = Phase.STOPPED
        elif self.deadline is not None and now >= self.deadline:
            self.phase, self.drain_expired = Phase.STOPPED, True
        return self.phase
