"""A pytest plugin: with $VLLM_LITE_TEST_FAILURE_LOG set, each failure's report is appended to that file as it
happens, not only in the summary at the end. A run killed at a device lease's limit (scripts/gpu_check.py) then
still says why its tests failed. Under pytest-xdist the controller writes (it sees every worker's reports)."""

from __future__ import annotations

import pytest

from vllm_lite import envs

MAX_REPORT_CHARS = 6000


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = envs.VLLM_LITE_TEST_FAILURE_LOG
    if not path or envs.PYTEST_XDIST_WORKER or not report.failed:
        return
    with open(path, "a", encoding="utf-8") as f:
        f.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext[-MAX_REPORT_CHARS:]}\n")
