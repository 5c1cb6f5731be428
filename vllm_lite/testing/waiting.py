"""Polling with a deadline: how tests wait for something another thread or process will do.

Tests never sleep a fixed time and hope; they poll a condition with a generous
deadline, so a slow machine only makes them slower, never wrong.
"""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable, TypeVar

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout_s: float, what: str, interval_s: float = 0.02) -> T:
    """Call `predicate` until it returns something truthy (returned); TimeoutError naming `what` after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what}: not true after {timeout_s} s")
        time.sleep(interval_s)


async def async_wait_until(
    predicate: Callable[[], T | Awaitable[T]], timeout_s: float, what: str, interval_s: float = 0.01
) -> T:
    """`wait_until` for the event loop: yields to other tasks between polls; `predicate` may be async."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value  # type: ignore[return-value]
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what}: not true after {timeout_s} s")
        await asyncio.sleep(interval_s)
