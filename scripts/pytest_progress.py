"""A pytest plugin for short device leases: each test's outcome as it happens, and a summary that survives a kill.

    PYTHONPATH=scripts python -m pytest -p pytest_progress --progress-file OUT/suite.progress tests ...

- ``--progress-file PATH``: one line per test appended (and flushed) when its outcome is known:
  ``<seconds since start> <OUTCOME> <nodeid> <duration>s[ (when)][: first line of the failure]`` with OUTCOME
  PASSED, FAILED, ERROR (setup/teardown), SKIPPED or XFAIL/XPASS; ``PATH.json`` is rewritten (atomically) after
  each test: counts, the failed and errored node ids, the last test, the elapsed seconds and ``"finished"``
  (true only once the session ended, with its exit status). A run cut off by ``timeout`` leaves both.
- On the terminal, each failure or error is also named at once on its own line (``FAILED nodeid``), so a
  ``-q`` log under xdist (only dots until the end) can be grepped while the run goes.

Under pytest-xdist only the controller writes (it receives every worker's reports). No conftest needed:
load it with ``-p pytest_progress`` with this folder on PYTHONPATH (scripts/gpu_lease.sh does).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Optional

import pytest

_STATE: dict[str, Any] = {}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--progress-file",
        default=None,
        help="append each test's outcome to this file as it happens; PATH.json: the running counts",
    )


def pytest_configure(config: pytest.Config) -> None:
    path = config.getoption("--progress-file", default=None)
    if not path or hasattr(config, "workerinput"):  # an xdist worker: the controller writes
        return
    path = os.path.abspath(path)
    with open(path, "w", encoding="utf-8"):
        pass
    _STATE.update(
        path=path,
        t0=time.monotonic(),
        counts={"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "xfailed": 0, "xpassed": 0},
        failed=[],
        errors=[],
        last=None,
        config=config,
    )
    _write_summary(finished=False)


def _write_summary(finished: bool, exitstatus: Optional[int] = None) -> None:
    summary = {
        **_STATE["counts"],
        "failed_tests": _STATE["failed"],
        "error_tests": _STATE["errors"],
        "last_test": _STATE["last"],
        "elapsed_s": round(time.monotonic() - _STATE["t0"], 1),
        "finished": finished,
        "exitstatus": exitstatus,
    }
    tmp = _STATE["path"] + ".json.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=1)
    os.replace(tmp, _STATE["path"] + ".json")


def _outcome(report: pytest.TestReport) -> Optional[str]:
    """The test's outcome from this report, or None when this report does not settle it."""
    if hasattr(report, "wasxfail"):
        if report.skipped:
            return "XFAIL"
        if report.passed and report.when == "call":
            return "XPASS"
    if report.failed:
        return "FAILED" if report.when == "call" else "ERROR"
    if report.skipped:
        return "SKIPPED"
    if report.passed and report.when == "call":
        return "PASSED"
    return None


def _first_line(report: pytest.TestReport) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    text = getattr(crash, "message", None) or str(report.longrepr or "")
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return lines[0][:300] if lines else ""


KEYS = {"PASSED": "passed", "FAILED": "failed", "ERROR": "errors", "SKIPPED": "skipped", "XFAIL": "xfailed"}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if not _STATE:
        return
    outcome = _outcome(report)
    if outcome is None:
        return
    _STATE["counts"][KEYS.get(outcome, "xpassed")] += 1
    _STATE["last"] = report.nodeid
    line = f"{time.monotonic() - _STATE['t0']:8.1f} {outcome} {report.nodeid} {report.duration:.2f}s"
    if outcome in ("FAILED", "ERROR"):
        (_STATE["failed"] if outcome == "FAILED" else _STATE["errors"]).append(report.nodeid)
        line += f" ({report.when}): {_first_line(report)}"
        reporter = _STATE["config"].pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"{outcome} {report.nodeid} ({report.when}): {_first_line(report)}")
    with open(_STATE["path"], "a", encoding="utf-8") as f:
        f.write(line + "\n")
    _write_summary(finished=False)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _STATE:
        _write_summary(finished=True, exitstatus=int(exitstatus))
