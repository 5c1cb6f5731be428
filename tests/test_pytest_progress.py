"""scripts/pytest_progress.py: each test's outcome appended as it happens (failures also named on the terminal at
once), the running counts rewritten after each test, once per test under xdist, and left behind by a killed run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from vllm_lite.testing.waiting import wait_until

SCRIPTS = str(Path(__file__).resolve().parents[1] / "scripts")

TESTS = """
import pytest

@pytest.fixture
def broken():
    raise RuntimeError("setup breaks")

def test_passes():
    pass

def test_fails():
    assert 1 == 2, "the reason to keep"

def test_errors(broken):
    pass

@pytest.mark.skip(reason="not here")
def test_skipped():
    pass

@pytest.mark.xfail(reason="known")
def test_xfails():
    assert False
"""

HANG = """
import threading

def test_a_fails():
    assert False, "before the hang"

def test_b_hangs():
    threading.Event().wait()
"""


def _cmd(progress: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "pytest_progress"] + [
        "--progress-file",
        str(progress),
        *extra,
    ]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (SCRIPTS, env.get("PYTHONPATH", "")) if p)
    return env


def _check(tmp_path: Path, *extra: str) -> None:
    (tmp_path / "test_sample.py").write_text(TESTS)
    progress = tmp_path / "suite.progress"
    proc = subprocess.run(
        [*_cmd(progress, *extra), "test_sample.py"], cwd=tmp_path, env=_env(), capture_output=True, text=True
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = progress.read_text().splitlines()
    outcomes = sorted(ln.split()[1] + " " + ln.split()[2] for ln in lines)
    assert outcomes == [
        "ERROR test_sample.py::test_errors",
        "FAILED test_sample.py::test_fails",
        "PASSED test_sample.py::test_passes",
        "SKIPPED test_sample.py::test_skipped",
        "XFAIL test_sample.py::test_xfails",
    ], lines
    failed = next(ln for ln in lines if " FAILED " in ln)
    assert "(call)" in failed and "the reason to keep" in failed
    assert "(setup)" in next(ln for ln in lines if " ERROR " in ln) and "setup breaks" in progress.read_text()
    summary = json.loads((tmp_path / "suite.progress.json").read_text())
    assert summary["finished"] is True and summary["exitstatus"] == 1
    assert (summary["passed"], summary["failed"], summary["errors"], summary["skipped"], summary["xfailed"]) == (
        1,
        1,
        1,
        1,
        1,
    )
    assert summary["failed_tests"] == ["test_sample.py::test_fails"]
    assert summary["error_tests"] == ["test_sample.py::test_errors"]
    assert "FAILED test_sample.py::test_fails (call): AssertionError: the reason to keep" in proc.stdout


def test_each_outcome_once_with_counts(tmp_path: Path) -> None:
    _check(tmp_path)


def test_under_xdist_the_controller_writes_each_outcome_once(tmp_path: Path) -> None:
    _check(tmp_path, "-n", "2")


def test_a_killed_run_leaves_the_failures_and_counts_so_far(tmp_path: Path) -> None:
    (tmp_path / "test_hang.py").write_text(HANG)
    progress = tmp_path / "suite.progress"
    out = tmp_path / "stdout.log"
    with open(out, "w") as f:
        proc = subprocess.Popen([*_cmd(progress), "test_hang.py"], cwd=tmp_path, env=_env(), stdout=f, stderr=f)
    try:
        wait_until(lambda: " FAILED " in progress.read_text() if progress.exists() else False, 120, "the failure")
        wait_until(lambda: "FAILED test_hang.py::test_a_fails" in out.read_text(), 120, "the terminal line")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    summary = json.loads((tmp_path / "suite.progress.json").read_text())
    assert summary["finished"] is False and summary["failed_tests"] == ["test_hang.py::test_a_fails"]
    assert summary["last_test"] == "test_hang.py::test_a_fails"
