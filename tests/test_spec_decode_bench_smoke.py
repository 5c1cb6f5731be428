"""benchmarks/spec_decode.py's one step-phase harness (phase_times) on the CPU, under both its clocks: --step-times
(wall clock) reports every phase of plain and verify steps, and the verify wrapper it installs is gone afterwards;
--host-times (thread CPU time) reports the host part outside the model and the verify steps with mixed draft
lengths."""

from __future__ import annotations

import importlib.util
import os

import pytest

from vllm_lite.default_model import resolve_model
from vllm_lite.worker.spec_decode_step import SpecDecodeStep

SCRIPT = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "spec_decode.py")


def _script():
    spec = importlib.util.spec_from_file_location("spec_decode_bench_script", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


PROMPT = [5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10]  # repeats itself: the lookup finds drafts
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 3}


def test_step_times_split_plain_and_verify_steps_into_phases() -> None:
    bench = _script()
    verify, greedy = SpecDecodeStep.verify, SpecDecodeStep.verify_greedy
    prompt = PROMPT
    out = bench.phase_times(resolve_model(None), {"rep": [prompt]}, SPEC, 12, (1,), 1, "float32", host_cpu=False)
    assert SpecDecodeStep.verify is verify and SpecDecodeStep.verify_greedy is greedy
    # restored as the class's own staticmethod entries (a plain function there would take an instance as an argument)
    assert all(isinstance(SpecDecodeStep.__dict__[n], staticmethod) for n in ("verify", "verify_greedy"))
    plain = out["rep/batch1/plain/plain_step_us"]
    assert plain["steps"] > 0
    assert {"step", "schedule", "update_states", "forward", "lm_head", "sample", "update", "frontend"} <= set(plain)
    verified = out["rep/batch1/ngram/verify_step_us"]
    assert verified["steps"] > 0
    assert {"verify", "propose", "lm_head", "forward", "sample"} <= set(verified)
    assert 0 < verified["verify"] < verified["sample"] < verified["step"]


def test_host_times_report_the_host_part_of_plain_and_verify_steps() -> None:
    bench = _script()
    out = bench.phase_times(resolve_model(None), {"rep": [PROMPT]}, SPEC, 12, (1,), 1, "float32", host_cpu=True)
    plain = out["rep/batch1/plain/plain_step_us"]
    assert plain["steps"] > 0
    assert {"step", "host", "schedule", "forward", "lm_head", "sample", "update", "frontend_outputs"} == set(plain) - {
        "steps"
    }
    verified = out["rep/batch1/ngram/verify_step_us"]
    assert verified["steps"] > 0 and "propose" in verified
    assert 0 < verified["verify"] < verified["sample"] and 0 < verified["sample_rest"] < verified["sample"]
    assert 0 < verified["host"] < verified["step"]
    mixed, verify_steps = out["rep/batch1/ngram/verify_steps_with_mixed_draft_lengths"]
    assert verify_steps == verified["steps"] and 0 <= mixed <= verify_steps


def test_host_times_refuse_a_device_other_than_the_cpu() -> None:
    """--host-times pins the CPU engine (on a GPU machine the engine's default device is CUDA, where the phases
    differ); asked for another device it says so before building anything."""
    bench = _script()
    with pytest.raises(ValueError, match="device='cuda'"):
        bench.phase_times("unused", {}, SPEC, 12, (1,), 1, "float32", host_cpu=True, device="cuda")
