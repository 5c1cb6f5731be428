"""The failure-log plugin writes each failure as it happens, once, also under pytest-xdist, and nothing unset."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = """
def test_passes():
    assert True

def test_fails_with_a_reason():
    assert 1 == 2, "the reason the log must keep"
"""


def _run(tmp_path: Path, *extra: str, log: bool = True) -> Path:
    (tmp_path / "test_sample.py").write_text(TESTS)
    out = tmp_path / "failures.log"
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_LITE_TEST_FAILURE_LOG", "PYTEST_XDIST_WORKER")}
    if log:
        env["VLLM_LITE_TEST_FAILURE_LOG"] = str(out)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "vllm_lite.testing.failure_log", "-p", "no:cacheprovider"]
    proc = subprocess.run([*cmd, *extra, "test_sample.py"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # one test fails on purpose
    return out


def test_each_failure_is_logged_with_its_reason(tmp_path: Path) -> None:
    text = _run(tmp_path).read_text()
    assert text.count("=== test_sample.py::test_fails_with_a_reason (call)") == 1
    assert "the reason the log must keep" in text
    assert "test_passes" not in text


def test_under_xdist_the_controller_logs_each_failure_once(tmp_path: Path) -> None:
    text = _run(tmp_path, "-n", "2").read_text()
    assert text.count("=== test_sample.py::test_fails_with_a_reason (call)") == 1


def test_nothing_is_written_without_the_variable(tmp_path: Path) -> None:
    assert not _run(tmp_path, log=False).exists()
