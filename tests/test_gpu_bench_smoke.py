"""benchmarks/gpu.py (issue #14's CUDA benchmark) on CPU: `--device cpu --smoke` runs every part of it
(checkpoint build, multiprocess engine, in-process profile worker, HF worker) on a tiny shape and prints
the JSON with every figure the issue asks for; the roofline and busy-fraction arithmetic is checked on
numbers worked out by hand."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from vllm_lite.testing.gpu_bench import (
    busy_fraction,
    config_facts,
    decode_step_cost,
    hf_config,
    roofline,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_busy_fraction_counts_overlaps_once_and_clamps():
    assert busy_fraction([(0, 10), (5, 15), (20, 30)], 40) == pytest.approx(25 / 40)
    assert busy_fraction([(0, 10), (2, 3)], 20) == pytest.approx(0.5)  # nested: counted once
    assert busy_fraction([(0, 50)], 40) == 1.0
    assert busy_fraction([], 10) == 0.0
    assert busy_fraction([(0, 1)], 0) == 0.0


def test_decode_step_cost_and_roofline_llama_1b():
    facts = config_facts(hf_config("llama-1b").to_dict())
    h, inter, layers, vocab = 2048, 5632, 22, 8000
    per_layer = h * 64 * (32 + 2 * 4) + 32 * 64 * h + 3 * h * inter
    assert facts["matmul_params"] == layers * per_layer + h * vocab
    cost = decode_step_cost(facts, batch=256, sum_context=256 * 400, dtype_bytes=2)
    assert cost["weight_bytes"] == 2 * facts["matmul_params"]
    assert cost["kv_read_bytes"] == 256 * 400 * 2 * layers * 4 * 64 * 2
    assert cost["flops"] == 2 * facts["matmul_params"] * 256 + 4 * layers * 32 * 64 * 256 * 400
    r = roofline(cost, measured_ms=40.0, copy_bytes_per_s=3e12, matmul_flops_per_s=800e12)
    bytes_ms = 1e3 * (cost["weight_bytes"] + cost["kv_read_bytes"]) / 3e12
    flops_ms = 1e3 * cost["flops"] / 800e12
    assert r["bytes_ms"] == pytest.approx(bytes_ms, rel=1e-3)
    assert r["flops_ms"] == pytest.approx(flops_ms, rel=1e-3)
    assert r["roofline_ms"] == pytest.approx(max(bytes_ms, flops_ms), rel=1e-3)
    assert r["fraction_of_roofline"] == pytest.approx(max(bytes_ms, flops_ms) / 40.0, rel=1e-3)
    assert 1.0 < r["roofline_ms"] < 2.5  # the "about 1.5-2 ms a step" for this shape


def test_llama_8b_shape():
    facts = config_facts(hf_config("llama-8b").to_dict())
    assert (facts["num_layers"], facts["hidden_size"], facts["intermediate_size"]) == (32, 4096, 14336)
    assert (facts["num_heads"], facts["num_kv_heads"]) == (32, 8)
    per_layer = 4096 * 128 * (32 + 2 * 8) + 32 * 128 * 4096 + 3 * 4096 * 14336
    assert facts["matmul_params"] == 32 * per_layer + 4096 * 8000  # ~7.0e9


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and x > 0


@pytest.mark.slow  # four interpreters (script, engine core, profile worker, HF worker): ~20 s
def test_smoke_run_prints_every_figure(tmp_path):
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "benchmarks", "gpu.py"), "--device", "cpu", "--smoke"],
        cwd=str(tmp_path),
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert len(lines) == 1, proc.stdout[-2000:]
    r = json.loads(lines[0])
    assert r["errors"] == []
    for key in ("device", "torch", "triton", "transformers", "settings", "probes"):
        assert key in r
    assert r["device"].startswith("cpu")
    s = r["settings"]
    assert s["dtype"] == "float32" and s["device"] == "cpu" and s["multiprocess"] is True
    assert _positive(r["probes"]["copy"]["bytes_per_s"]) and _positive(r["probes"]["matmul"]["flops_per_s"])

    t = r["shapes"]["tiny"]
    assert t["errors"] == []
    for key in (
        "vllm_lite_tokens_per_s",
        "hf_tokens_per_s",
        "ratio_vs_hf",
        "batch1_ms_per_token",
        "batch1_ttft_ms",
        "time_to_ready_s",
    ):
        assert _positive(t[key]), (key, t.get(key))
    assert t["output_tokens"] == s["num_prompts"] * s["output_len"]
    for key in ("gpu_busy_fraction", "gpu_busy_fraction_batch1"):
        assert 0.0 <= t[key] <= 1.0 and t[key] > 0, (key, t[key])
    for step in (t["decode_step"], t["batch1_decode_step"], t["decode_step_batch1_inprocess"]):
        for key in ("measured_ms", "bytes_moved", "flops", "bytes_ms", "flops_ms", "roofline_ms"):
            assert _positive(step[key]), (key, step)
        assert step["roofline_ms"] == max(step["bytes_ms"], step["flops_ms"])
        assert 0 < step["fraction_of_roofline"]
    assert t["decode_step"]["batch"] == s["num_prompts"]  # every prompt decoding in the profiled window
    assert t["batch1_decode_step"]["batch"] == 1
    assert t["decode_step"]["kv_read_bytes"] > t["batch1_decode_step"]["kv_read_bytes"]
