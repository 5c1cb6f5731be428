"""scripts/gpu_check.py's verdicts on a suite run: only multi-GPU skips are acceptable on one GPU, and every
compiled-on-CUDA kernel case must have run (a junit file written here stands in for a real run)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check() -> Any:
    spec = importlib.util.spec_from_file_location("gpu_check_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _junit(path: Path, cases: list[tuple[str, str, str]]) -> None:
    """cases: (name, outcome, skip reason) with outcome passed/failed/skipped."""
    rows = []
    for name, outcome, reason in cases:
        inner = {
            "passed": "",
            "failed": '<failure message="boom">x</failure>',
            "skipped": f'<skipped message="{reason}"/>',
        }
        rows.append(f'<testcase classname="tests.test_x" name="{name}">{inner[outcome]}</testcase>')
    path.write_text(f'<testsuites><testsuite name="pytest">{"".join(rows)}</testsuite></testsuites>')


def _suite(gpu_check: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cases, device: str = "cuda") -> dict:
    def fake_pytest(args, junit, log, timeout_s):
        _junit(Path(junit), cases)
        return {"status": "pass", **gpu_check._junit_summary(junit)}

    monkeypatch.setattr(gpu_check, "_pytest", fake_pytest)
    args = argparse.Namespace(out=str(tmp_path), suite_workers=0, suite_args=[], suite_timeout=1.0, device=device)
    return gpu_check.part_suite(args)


MULTI = "needs 2 CUDA devices, 1 visible"


def test_multi_gpu_skips_and_all_native_kernel_cases_run_pass(gpu_check, tmp_path, monkeypatch) -> None:
    cases = [("test_compiled_kernel_on_cuda_matches_reference[a]", "passed", ""), ("test_tp", "skipped", MULTI)]
    res = _suite(gpu_check, tmp_path, monkeypatch, cases)
    assert res["status"] == "pass", res
    assert res["native_cuda_kernel_cases"] == {"passed": 1, "failed": 0, "skipped": 0}
    assert res["skip_reasons"] == [MULTI]


@pytest.mark.parametrize(
    "cases",
    [
        [("test_compiled_kernel_on_cuda_matches_reference[a]", "passed", ""), ("test_y", "skipped", "needs CUDA")],
        [("test_compiled_kernel_on_cuda_matches_reference[a]", "skipped", "triton missing")],
        [("test_other", "passed", "")],  # no compiled kernel case ran at all
    ],
    ids=["a-non-gpu-skip", "a-native-case-skipped", "no-native-case"],
)
def test_other_skips_or_missing_native_kernel_cases_fail_on_cuda(gpu_check, tmp_path, monkeypatch, cases) -> None:
    res = _suite(gpu_check, tmp_path, monkeypatch, cases)
    assert res["status"] == "fail" and "note" in res, res


def test_on_cpu_the_skips_are_only_listed(gpu_check, tmp_path, monkeypatch) -> None:
    cases = [("test_compiled_kernel_on_cuda_matches_reference[a]", "skipped", "needs CUDA")]
    res = _suite(gpu_check, tmp_path, monkeypatch, cases, device="cpu")
    assert res["status"] == "pass" and res["skip_reasons"] == ["needs CUDA"]
    assert os.path.exists(tmp_path / "suite.xml")


def test_a_cut_short_run_reports_the_failures_logged_so_far(gpu_check, tmp_path) -> None:
    log = tmp_path / "suite.log.failures"
    log.write_text(
        "=== tests/test_a.py::test_x (call)\nAssertionError: first\n=== tests/test_b.py::test_y (setup)\nboom\n"
    )
    found = gpu_check._failures_so_far(str(log))
    assert [f["test"] for f in found] == ["tests/test_a.py::test_x (call)", "tests/test_b.py::test_y (setup)"]
    assert found[0]["text"] == "AssertionError: first" and found[1]["text"] == "boom"
    assert gpu_check._failures_so_far(str(tmp_path / "absent")) == []


def test_overlap_runs_the_benchmark_alone_first_then_the_suite_beside_the_rest(
    gpu_check, tmp_path, monkeypatch
) -> None:
    events: list[str] = []

    def part(name: str):
        def run(args):
            events.append(f"{name}:start")
            if name == "suite":
                assert "bench:end" in events and "kernels:end" in events, events  # the benchmarks ran alone
            events.append(f"{name}:end")
            return {"status": "pass"}

        return run

    monkeypatch.setattr(gpu_check, "RUNNERS", {n: part(n) for n in gpu_check.PARTS})
    rc = gpu_check.main(["--device", "cpu", "--overlap", "--out", str(tmp_path), "--parts", "suite,kernels,hf,bench"])
    assert rc == 0
    # The timed parts alone, one after the other, in the order asked; then the suite beside the HF match.
    assert events[:4] == ["kernels:start", "kernels:end", "bench:start", "bench:end"]
    assert sorted(events[4:]) == ["hf:end", "hf:start", "suite:end", "suite:start"]
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    assert set(summary["parts"]) == {"bench", "suite", "hf", "kernels"} and summary["ok"] is True


def test_round_robin_split_covers_every_name_once_in_at_most_n_groups(gpu_check) -> None:
    names = [f"a{i}" for i in range(7)]
    groups = gpu_check.split_round_robin(names, 3)
    assert groups == [["a0", "a3", "a6"], ["a1", "a4"], ["a2", "a5"]]
    assert gpu_check.split_round_robin(names[:2], 4) == [["a0"], ["a1"]]  # never an empty group
    assert gpu_check.split_round_robin(names[:3], 0) == [names[:3]]


def test_parallel_hf_part_merges_the_workers_and_reports_a_lost_one(gpu_check, tmp_path, monkeypatch) -> None:
    """Each child writes its own summary; one that died leaves its architectures failed, not missing."""
    launched: list[list[str]] = []

    class FakeChild:
        def __init__(self, cmd, **kwargs) -> None:
            archs = cmd[cmd.index("--archs") + 1 :]
            summary = cmd[cmd.index("--summary") + 1]
            launched.append(archs)
            self.returncode = 0
            if "gpt2" in archs:  # this worker crashed before writing anything
                self.returncode = 1
                return
            models = {a: {"pass": a != "opt", "seconds": 1.0} for a in archs}
            (tmp_path / summary).write_text(json.dumps({"parts": {"hf": {"models": models}}}))

        def wait(self) -> int:
            return self.returncode

    monkeypatch.setattr(gpu_check.subprocess, "Popen", FakeChild)
    args = argparse.Namespace(out=str(tmp_path), device="cuda", hf_workers=2, archs=["llama", "opt", "gpt2", "qwen2"])
    res = gpu_check.part_hf(args)
    assert launched == [["llama", "gpt2"], ["opt", "qwen2"]]
    assert list(res["models"]) == ["llama", "opt", "gpt2", "qwen2"]  # the order asked for
    assert res["models"]["qwen2"]["pass"] and not res["models"]["opt"]["pass"]
    for lost in ("llama", "gpt2"):  # the crashed worker's group
        assert res["models"][lost] == {"pass": False, "error": "worker exited 1 without it"}
    assert res["status"] == "fail" and res["workers"] == 2


def test_a_suite_cut_short_reports_the_counts_and_failures_of_the_tests_that_ended(
    gpu_check, tmp_path, monkeypatch
) -> None:
    """_pytest runs pytest with scripts/pytest_progress.py (each outcome as it happens) and the failure log: when
    the run is cut (no junit file), the summary still has the counts and the failing tests so far. The pytest
    command really runs here (plugin loaded from the command and environment _pytest builds); the cut is
    simulated after it."""
    import subprocess

    sample = tmp_path / "test_sample.py"
    sample.write_text("def test_ok():\n    pass\n\ndef test_bad():\n    assert 0, 'the reason'\n")
    real_run = subprocess.run

    def run_then_cut(cmd, **kwargs):
        real_run(cmd, **kwargs)
        os.remove(str(tmp_path / "suite.xml"))  # a killed run writes no junit file
        raise subprocess.TimeoutExpired(cmd, kwargs.get("timeout"))

    monkeypatch.setattr(gpu_check.subprocess, "run", run_then_cut)
    log = str(tmp_path / "suite.log")
    res = gpu_check._pytest([str(sample), "-p", "vllm_lite.testing.failure_log"], str(tmp_path / "suite.xml"), log, 600)
    assert res["status"] == "timeout" and (res["passed"], res["failed"]) == (1, 1), res
    assert [f["test"].split("::")[-1] for f in res["failures"]] == ["test_bad (call)"]
    assert "FAILED" in (tmp_path / "suite.log.progress").read_text()
    assert "test_sample.py::test_bad (call): AssertionError: the reason" in (tmp_path / "suite.log").read_text()
