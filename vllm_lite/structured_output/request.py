"""A request's structured-output state in the core: its grammar being prepared, then its matcher."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Optional

from vllm_lite.structured_output.backend_types import StructuredOutputMatcher


class StructuredOutputRequest:
    """Waits on a compile future off the step loop; once done holds a matcher or the compiler's error."""

    def __init__(self, future: "Future[StructuredOutputMatcher]") -> None:
        self._future = future
        self.matcher: Optional[StructuredOutputMatcher] = None
        self.error: Optional[str] = None

    def is_ready(self) -> bool:
        """True once the grammar is compiled (or failed: then `error` says why); never blocks."""
        if self.matcher is not None or self.error is not None:
            return True
        if not self._future.done():
            return False
        if self._future.cancelled():
            self.error = "grammar compilation was cancelled"
            return True
        exc = self._future.exception()
        if exc is not None:
            self.error = str(exc)
        else:
            self.matcher = self._future.result()
        return True

    def cancel(self) -> None:
        self._future.cancel()
