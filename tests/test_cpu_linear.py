"""cpu_linear: the k-blocked float32 kernel and the sliced float32 linear are used where their rules say, and
equal F.linear bit for bit.

Tolerance: none -- torch.equal. The sliced product is the same dot product per output element; the kernel
(csrc/f32_linear_cpu.cpp) sums in MKL's order; where a BLAS rounds either differently the case falls back, logged,
and still equals F.linear. The kernel's own sums are also checked against float64 (any host).
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
    # The slices' tests run without the k-blocked kernel (it would take their cases first); its own tests turn it on.
    monkeypatch.setattr(cpu_linear, "_kernel_on", False)
    monkeypatch.setattr(cpu_linear, "_kc", {})
    monkeypatch.setattr(cpu_linear, "_kc_known", {})
    monkeypatch.setattr(cpu_linear, "_kernel_warned", set())
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


# ---------------------------------------------------------------- the k-blocked kernel (f32_linear_kblocked)


def _kernel_or_skip():
    op = cpu_linear._kernel_op()
    if op is None:
        pytest.skip("csrc's f32_linear_kblocked is not built here (needs AVX-512 or AVX2 + FMA and a compiler)")
    return op


def _mkl_order_here() -> bool:
    """Whether this host's F.linear sums as the kernel's rule says: MKL on an AVX-512 AMD CPU (measured on Zen 4).
    MKL takes other code paths on Intel CPUs (never measured: there the check may keep F.linear/slices, which the
    test still requires to be bit-identical)."""
    from vllm_lite.platform import _cpuinfo

    return (
        torch.backends.cpu.get_cpu_capability() == "AVX512"
        and torch.backends.mkl.is_available()
        and _cpuinfo().get("vendor_id") == "AuthenticAMD"
    )


@pytest.mark.parametrize("m,k,n", [(8, 64, 16), (13, 200, 31), (64, 256, 8000), (100, 256, 384), (33, 896, 40)])
def test_kernel_sums_in_k_blocks_within_float32_rounding_of_float64(m, k, n):
    """The op itself on any host: x @ w.T for row counts off its 16/64-row tiles and column counts off its 6/5-
    column tiles, every kc, against float64 (a dropped k, row or column gives errors of order 1)."""
    op = _kernel_or_skip()
    g = torch.Generator().manual_seed(m * 1000 + n)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) / k**0.5
    want = (x.double() @ w.double().T).float()
    for kc in cpu_linear.kc_candidates(k):
        got = op(x, w, kc)
        assert got.shape == (m, n)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    strided = torch.randn(m, 2 * k, generator=g)[:, :k]  # rows apart in memory: the op reads by row stride
    assert torch.equal(
        op(strided, w, cpu_linear.kc_candidates(k)[0]), op(strided.contiguous(), w, cpu_linear.kc_candidates(k)[0])
    )


def test_kernel_rejects_bad_inputs_before_reading_them():
    op = _kernel_or_skip()
    w = torch.randn(32, 64)
    with pytest.raises(ValueError):
        op(torch.randn(8, 65), w, 64)  # K disagrees
    with pytest.raises(ValueError):
        op(torch.randn(8, 64), w, 0)  # kc
    with pytest.raises(ValueError):
        op(torch.randn(8, 64), w.T.contiguous().T, 64)  # weight not contiguous
    with pytest.raises(TypeError):
        op(torch.randn(8, 64).double(), w, 64)


@pytest.mark.parametrize("threads", [1, 2])
def test_lm_head_and_attention_shapes_take_the_kernel_and_equal_f_linear(monkeypatch, threads, caplog):
    """The MoE benchmark's decode shapes (LM head 256 -> 8000, qkv 256 -> 384 at 64 rows; a 3-D input; a prefill
    chunk of 300 rows; K = 896 with 5 blocks): bit-identical to F.linear, through the kernel where MKL's order
    is the measured one (Zen 4), else kept on F.linear/slices by the check."""
    _kernel_or_skip()
    monkeypatch.setattr(cpu_linear, "_kernel_on", True)
    torch.set_num_threads(threads)
    cases = [
        (torch.randn(64, 256), _weight(8000, k=256)),
        (torch.randn(64, 256), _weight(384, k=256, seed=2)),
        (torch.randn(3, 16, 256), _weight(384, k=256, seed=3)),
        (torch.randn(300, 256), _weight(256, k=256, seed=4)),
        (torch.randn(16, 896), _weight(256, k=896, seed=5)),
    ]
    with torch.inference_mode(), caplog.at_level(logging.INFO, logger=cpu_linear.__name__):
        for x, w in cases:
            rows = x.numel() // x.shape[-1]
            assert cpu_linear.plan(rows, w) == "unchecked"
            for _ in range(2):  # the check, then the chosen path
                y = cpu_linear.linear(x, w)
                assert torch.equal(y, F.linear(x, w))
            assert cpu_linear.plan(rows, w) != "unchecked"
            if _mkl_order_here():
                assert cpu_linear.plan(rows, w) == "kernel", (tuple(x.shape), tuple(w.shape))
    if _mkl_order_here():
        assert not [r for r in caplog.records if "sums differently" in r.getMessage()]


def test_kernel_rule_leaves_routers_biases_small_batches_and_autograd_to_f_linear(monkeypatch):
    _kernel_or_skip()
    monkeypatch.setattr(cpu_linear, "_kernel_on", True)
    calls = []
    real = cpu_linear._kernel_op()
    monkeypatch.setattr(cpu_linear, "_kernel_op", lambda: lambda *a: calls.append(a) or real(*a))
    w = _weight(384, k=64)
    cases = [
        (torch.randn(64, 64), _weight(8, k=64), None),  # a MoE router: MKL's 8-output path sums otherwise
        (torch.randn(64, 64), w, torch.randn(384)),  # bias
        (torch.randn(7, 64), w, None),  # below KERNEL_MIN_ROWS
        (torch.randn(513, 64), w, None),  # above KERNEL_MAX_ROWS
        (torch.randn(64, 64).bfloat16(), w.bfloat16(), None),
    ]
    for x, ww, b in cases:
        assert torch.equal(cpu_linear.linear(x, ww, b), F.linear(x, ww, b))
    x = torch.randn(64, 64, requires_grad=True)
    cpu_linear.linear(x, w).sum().backward()  # autograd: F.linear, so the gradient exists
    assert x.grad is not None
    assert calls == []


def test_a_case_where_no_kc_matches_keeps_f_linear_and_says_so_once(monkeypatch, caplog):
    _kernel_or_skip()
    monkeypatch.setattr(cpu_linear, "_kernel_on", True)
    real = cpu_linear._kernel_op()

    def off_by_one_ulp(x, w, kc):
        y = real(x, w, kc)
        return torch.nextafter(y, torch.full_like(y, float("inf")))

    monkeypatch.setattr(cpu_linear, "_kernel_op", lambda: off_by_one_ulp)
    w, x = _weight(384, k=256), torch.randn(64, 256)
    with torch.inference_mode(), caplog.at_level(logging.INFO, logger=cpu_linear.__name__):
        for _ in range(3):
            assert torch.equal(cpu_linear.linear(x, w), F.linear(x, w))
    assert cpu_linear.plan(64, w) == "f_linear"
    assert len([r for r in caplog.records if "sums differently" in r.getMessage()]) == 1


def test_a_degenerate_first_input_cannot_vouch_for_a_kc_that_sums_differently(monkeypatch):
    """A first input of zeros sums to the same bits in any order; the check also runs on a seeded random input,
    so an op that is right only on zeros never takes the case."""
    _kernel_or_skip()
    monkeypatch.setattr(cpu_linear, "_kernel_on", True)
    real = cpu_linear._kernel_op()

    def right_on_zeros_only(x, w, kc):
        y = real(x, w, kc)
        return y if not x.any() else torch.nextafter(y, torch.full_like(y, float("inf")))

    monkeypatch.setattr(cpu_linear, "_kernel_op", lambda: right_on_zeros_only)
    w = _weight(384, k=256)
    with torch.inference_mode():
        assert torch.equal(cpu_linear.linear(torch.zeros(64, 256), w), torch.zeros(64, 384))
        assert cpu_linear.plan(64, w) == "f_linear"
        x = torch.randn(64, 256)
        assert torch.equal(cpu_linear.linear(x, w), F.linear(x, w))
