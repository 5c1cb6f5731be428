"""Errors a frontend raises about the engine core, not about one request."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine core is gone (crashed, killed or unreachable); no request can finish.

    Raised to every pending and future caller instead of letting them hang.
    """

    def __init__(self, message: str = "The engine core died; all pending requests failed.") -> None:
        super().__init__(message)


class EngineStartupError(RuntimeError):
    """The engine core process failed before it was ready (e.g. a bad checkpoint).

    The message starts with the core's original exception type and text.
    """


class EngineHandshakeError(RuntimeError):
    """The engine core refused this frontend (wrong auth token or protocol version) or never answered."""
