"""cpu_linear: the sliced float32 linear is used where its measured rule says, and equals F.linear bit for bit.

Tolerance: none -- torch.equal. The sliced product is the same dot product per output element;
where a BLAS rounds it differently the case falls back to F.linear, logged, and still equals it.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from vllm_lite.worker.models import cpu_linear


@pytest.fixture(autouse=True)
def fresh_cache(monkeypatch):
    """Each test sees its own verification cache (the module's is process-wide), on one torch thread
    (the measured case; the thread count is restored afterwards)."""
    monkeypatch.setattr(cpu_linear, "_checked", {})
    monkeypatch.setattr(cpu_linear, "_announced", set())
    monkeypatch.setattr(cpu_linear, "_on", True)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _weight(n: int, k: int = 768, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) / k**0.5


def test_gate_up_shape_at_batch_32_runs_in_slices_and_equals_f_linear(caplog):
    w = _weight(6144)
    x = torch.randn(32, 768)
    assert cpu_linear.plan(32, w) == "unchecked"
    with caplog.at_level(logging.INFO, logger=cpu_linear.__name__):
        first = cpu_linear.linear(x, w)  # verifies the case
        second = cpu_linear.linear(x, w)  # runs the slices
    assert torch.equal(first, F.linear(x, w)) and torch.equal(second, F.linear(x, w))
    capability = torch.backends.cpu.get_cpu_capability()
    if capability == "AVX2":  # where the rule was measured (MKL sgemm on Zen 3): slices are identical
        assert cpu_linear.plan(32, w) == "blocks"
    if cpu_linear.plan(32, w) == "blocks":
        assert [r.getMessage() for r in caplog.records] == [
            "float32 linear 768x6144 on CPU: 768-output slices for 16-128 rows (bit-identical to F.linear)"
        ]
    else:  # another BLAS rounded differently: F.linear kept, and said so
        assert any("keeping F.linear" in r.getMessage() for r in caplog.records)


def test_lm_head_with_bias_and_3d_input_equals_f_linear():
    w, b = _weight(32000, k=64, seed=1), torch.randn(32000)  # the rule looks at outputs and rows only
    x = torch.randn(2, 9, 64)  # 18 rows
    for _ in range(2):
        y = cpu_linear.linear(x, w, b)
        assert y.shape == (2, 9, 32000)
        assert torch.equal(y, F.linear(x, w, b))
    assert cpu_linear.plan(18, w, b) in ("blocks", "f_linear")
    assert cpu_linear.plan(18, w, b) != "unchecked"


def test_rule_keeps_f_linear_for_small_batches_narrow_weights_and_other_dtypes(monkeypatch):
    calls = []
    monkeypatch.setattr(cpu_linear, "blocked_linear", lambda *a: calls.append(a) or F.linear(*a))
    wide = _weight(6144, k=64)
    cases = [
        (torch.randn(1, 64), wide),  # decode batch 1
        (torch.randn(15, 64), wide),  # below MIN_ROWS
        (torch.randn(129, 64), wide),  # above MAX_ROWS
        (torch.randn(32, 64), _weight(3072, k=64)),  # narrow weight (qkv, o_proj, down)
        (torch.randn(32, 64).bfloat16(), wide.bfloat16()),  # bf16 has its own (prepacked) path
    ]
    for x, w in cases:
        assert torch.equal(cpu_linear.linear(x, w), F.linear(x, w))
        assert cpu_linear.plan(x.numel() // 64, w) == "f_linear"
    torch.set_num_threads(2)  # more threads than measured (the fixture restores the count)
    x = torch.randn(32, 64)
    assert torch.equal(cpu_linear.linear(x, wide), F.linear(x, wide))
    assert cpu_linear.plan(32, wide) == "f_linear"
    assert calls == []


def test_a_case_whose_slices_differ_falls_back_to_f_linear_with_a_warning(monkeypatch, caplog):
    def off_by_one_ulp(x, w, b):
        y = F.linear(x, w, b)
        return torch.nextafter(y, torch.full_like(y, float("inf")))

    monkeypatch.setattr(cpu_linear, "blocked_linear", off_by_one_ulp)
    w, x = _weight(4096, k=64), torch.randn(16, 64)
    with caplog.at_level(logging.WARNING, logger=cpu_linear.__name__):
        for _ in range(3):
            assert torch.equal(cpu_linear.linear(x, w), F.linear(x, w))
    assert cpu_linear.plan(16, w) == "f_linear"
    assert len([r for r in caplog.records if "keeping F.linear" in r.getMessage()]) == 1
