"""benchmarks/spec_decode.py --step-times on the CPU: every phase of plain and verify steps is reported, and the
verify wrapper it installs is gone afterwards."""

from __future__ import annotations

import importlib.util
import os

from vllm_lite.default_model import resolve_model
from vllm_lite.worker.spec_decode_step import SpecDecodeStep

SCRIPT = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "spec_decode.py")


def _script():
    spec = importlib.util.spec_from_file_location("spec_decode_bench_script", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_step_times_split_plain_and_verify_steps_into_phases() -> None:
    bench = _script()
    verify = SpecDecodeStep.verify
    prompt = [5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10]  # repeats itself: the lookup finds drafts
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 3}
    out = bench.step_times(resolve_model(None), {"rep": [prompt]}, spec, 12, (1,), 1, "float32", "cpu")
    assert SpecDecodeStep.verify is verify
    plain = out["rep/batch1/plain/plain_step_us"]
    assert plain["steps"] > 0
    assert {"step", "schedule", "update_states", "forward", "lm_head", "sample", "update", "frontend"} <= set(plain)
    verified = out["rep/batch1/ngram/verify_step_us"]
    assert verified["steps"] > 0
    assert {"verify", "propose", "lm_head", "forward", "sample"} <= set(verified)
    assert 0 < verified["verify"] < verified["sample"] < verified["step"]
