"""One `vllm-lite serve` (core + HTTP frontend) shared by the reliability modules that only attack it.

Fault-injection tests that kill or stop a process start daemons of their own.

When a run collects this whole directory (CI runs the whole suite), the daemon starts in the background as soon
as this file is loaded, at the start of collection: its start-up (three interpreters, ~15 s of CPU) then runs on
the core that single-process collection leaves idle, instead of before the first test that needs it. A run of
single files or node ids starts it lazily, as before. A prestarted daemon nobody asked for is stopped at exit.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import pytest

from vllm_lite.testing.checkpoints import get_checkpoint
from vllm_lite.testing.target_daemon import TargetDaemon

_HERE = Path(__file__).resolve().parent
_prestarted: Optional[Future] = None
_pool: Optional[ThreadPoolExecutor] = None


def _collects_this_directory(config: pytest.Config) -> bool:
    """True when an argument (or the default testpaths) is this directory or one above it."""
    base = Path(config.invocation_params.dir)
    for arg in config.args:
        path = Path(str(arg).split("::", 1)[0])
        path = (path if path.is_absolute() else base / path).resolve()
        if path.is_dir() and (path == _HERE or path in _HERE.parents):
            return True
    return False


def pytest_configure(config: pytest.Config) -> None:
    global _pool, _prestarted
    if _collects_this_directory(config) and not config.option.collectonly:
        get_checkpoint("llama")  # any first-time build here: the thread below then imports nothing heavy
        _pool = ThreadPoolExecutor(1, thread_name_prefix="reliability-target")
        _prestarted = _pool.submit(TargetDaemon)


def pytest_unconfigure(config: pytest.Config) -> None:
    """Stop a prestarted daemon that no test used (stop() is idempotent for one the fixture already stopped)."""
    global _pool, _prestarted
    if _prestarted is not None:
        try:
            _prestarted.result().stop()
        except Exception:  # noqa: BLE001 -- its start-up error was reported by the tests that needed it
            pass
        _prestarted = None
    if _pool is not None:
        _pool.shutdown(wait=True)
        _pool = None


@pytest.fixture(scope="session")
def target() -> Iterator[TargetDaemon]:
    daemon = _prestarted.result() if _prestarted is not None else TargetDaemon()
    try:
        daemon.assert_serves()
        yield daemon
    finally:
        daemon.stop()
