"""Start-up work of a frontend that can overlap: the tokenizer loads while the engine core starts.

Why: loading a Hugging Face tokenizer imports transformers (seconds on CPU), and the core process spends
seconds importing torch and loading the model; done one after the other they add up, done at once the
frontend is ready when the slower of the two is.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, TypeVar

T = TypeVar("T")
C = TypeVar("C")


def load_while_starting(load: Callable[[], T], start: Callable[[], C], stop: Callable[[C], Any]) -> tuple[T, C]:
    """``load()`` on a helper thread while ``start()`` runs here; both results, or the first error.

    When ``load`` fails after ``start`` succeeded, ``stop`` undoes the start (no core is left running).
    When ``start`` fails, its error is raised once ``load`` is done (the thread is never abandoned mid-import).
    """
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = load()
        except BaseException as e:  # noqa: BLE001 -- re-raised in the caller's thread
            result["error"] = e

    thread = threading.Thread(target=run, name="frontend-load", daemon=True)
    thread.start()
    try:
        started = start()
    finally:
        thread.join()
    if "error" in result:
        stop(started)
        raise result["error"]
    return result["value"], started
