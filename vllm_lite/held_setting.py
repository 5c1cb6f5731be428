"""A process-wide setting (torch's thread count, the collector's thresholds) that in-process engines change while
they live and give back when they are shut down or collected, whichever comes first.

Several engines may live in one process at once: the first hold saves the value the process had, each hold sets
its own value, and the last release puts the saved value back. A release is a ``weakref.finalize`` on the owner:
calling it releases once (later calls do nothing), and an owner that is never shut down releases when it is
collected (or at interpreter exit), so a dropped engine does not leave the process changed for good. The saved
value goes back only if the setting still has the value the holds last set: a collection can run the release at
any later moment, and by then the process (a test, the user, a thread policy) may have set its own value, which a
late release must not overwrite.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Generic, Optional, TypeVar

T = TypeVar("T")


class HeldSetting(Generic[T]):
    def __init__(self, get: Callable[[], T], set_: Callable[[T], Any]) -> None:
        self._get = get
        self._set = set_
        # Re-entrant: a collection that runs while hold() holds the lock (set_ allocates) may call an earlier
        # owner's release on this same thread.
        self._lock = threading.RLock()
        self.holders = 0
        self._saved: Optional[T] = None
        self._last_set: Optional[T] = None

    def hold(self, owner: object, value: T) -> weakref.finalize:
        """Set ``value`` for as long as ``owner`` holds it; returns the release (call it at shutdown)."""
        with self._lock:
            if self.holders == 0:
                self._saved = self._get()
            self.holders += 1
            try:
                self._set(value)
                self._last_set = value
            except BaseException:
                self._release_locked()
                raise
        return weakref.finalize(owner, self._release)

    def _release(self) -> None:
        with self._lock:
            self._release_locked()

    def _release_locked(self) -> None:
        if self.holders <= 0:
            return
        self.holders -= 1
        if self.holders == 0 and self._saved is not None:
            saved, self._saved = self._saved, None
            if self._get() == self._last_set:  # else someone set it since: theirs stands
                self._set(saved)
