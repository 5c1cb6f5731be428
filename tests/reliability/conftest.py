"""One `vllm-lite serve` (core + HTTP frontend) shared by the reliability modules that only attack it.

Fault-injection tests that kill or stop a process start daemons of their own.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from vllm_lite.testing.target_daemon import TargetDaemon


@pytest.fixture(scope="session")
def target() -> Iterator[TargetDaemon]:
    daemon = TargetDaemon()
    try:
        daemon.assert_serves()
        yield daemon
    finally:
        daemon.stop()
