"""Edge cases of the gate_up kernels with SiLU-and-mul in their epilogue (csrc/bf16_small_m.cpp:
bf16_gate_up_small_m / bf16_gate_up_vnni over cpu_prepack.interleave_gate_up's copy): inputs the existing tests do
not build. Intermediate sizes below one 16-output block and odd ones (the last block padded with zero rows, its
stores cut to the true width), non-finite gate and up values (SiLU's +-inf and NaN against fused_silu_and_mul's
rule), more rows than the decoder stack sends to the VNNI kernel (no row cap there), x as a strided view, the
smallest K each layout takes, and thread counts. Each is compared bit for bit with the plain kernels' gate_up
(their sums do not depend on the outputs' order) then fused_silu_and_mul, and the unfused output with torch.
Skipped where the AVX512-BF16 decode kernels are not built."""

from __future__ import annotations

import pytest
import torch

from vllm_lite.worker.models import cpu_prepack

pytestmark = pytest.mark.skipif(
    not (cpu_prepack.small_m_kernel_available() and hasattr(torch.ops.vllm_lite, "bf16_gate_up_vnni")),
    reason="the AVX512-BF16 decode kernels are not built here",
)

B = cpu_prepack.GATE_UP_BLOCK


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def _interleaved_bias(bias, d):
    return None if bias is None else cpu_prepack.interleave_gate_up(bias.view(-1, 1), d).view(-1)


def _plain_gate_up(x: torch.Tensor, w: torch.Tensor, bias, small: bool) -> torch.Tensor:
    """gate_up [rows, 2d] in gate-then-up order from the plain kernels over the interleaved weight (any d)."""
    d = w.shape[0] // 2
    wi = cpu_prepack.interleave_gate_up(w, d)
    bi = _interleaved_bias(bias, d)
    if small:
        out = torch.ops.vllm_lite.bf16_linear_small_m(x, cpu_prepack.block_weight(wi), wi.shape[0], bi)
    else:
        out = torch.ops.vllm_lite.bf16_linear_vnni(x, cpu_prepack.vnni_weight(wi), wi.shape[0], bi)
    out = out.view(x.shape[0], -1, 2, B)
    return torch.cat([out[:, :, 0].flatten(1)[:, :d], out[:, :, 1].flatten(1)[:, :d]], 1)


def _fused(x: torch.Tensor, w: torch.Tensor, bias, silu_and_mul: bool, small: bool) -> torch.Tensor:
    d = w.shape[0] // 2
    wi = cpu_prepack.interleave_gate_up(w, d)
    if small:
        return torch.ops.vllm_lite.bf16_gate_up_small_m(x, cpu_prepack.block_weight(wi), d, bias, silu_and_mul)
    return torch.ops.vllm_lite.bf16_gate_up_vnni(x, cpu_prepack.vnni_weight(wi), d, bias, silu_and_mul)


def _check(x, w, bias, small: bool) -> None:
    gate_up = _plain_gate_up(x, w, bias, small)
    want = torch.ops.vllm_lite.fused_silu_and_mul(gate_up)
    got = _fused(x, w, bias, True, small)
    assert got.shape == want.shape
    assert torch.equal(_bits(got), _bits(want)), f"{int((_bits(got) != _bits(want)).sum())} outputs differ"
    d = w.shape[0] // 2  # and torch's F.silu(gate) * up over the same gate_up, bit for bit
    assert torch.equal(_bits(got), _bits(torch.nn.functional.silu(gate_up[:, :d]) * gate_up[:, d:]))
    unfused = _fused(x, w, bias, False, small)
    assert torch.equal(_bits(unfused), _bits(gate_up))
    # The plain kernels themselves against torch (float32 sums of bf16 products, one bf16 rounding).
    ref = x.float() @ w.float().t() + (0 if bias is None else bias.float())
    torch.testing.assert_close(unfused.float(), ref, atol=2e-2, rtol=2e-2, equal_nan=True)


@pytest.mark.parametrize("d", [1, 3, 8, 15, 16, 17, 33, 65, 127])
@pytest.mark.parametrize("rows", [1, 5, 12, 13, 64])
def test_small_and_odd_intermediate_sizes(d, rows) -> None:
    g = torch.Generator().manual_seed(1000 * d + rows)
    k = 64
    w = (0.2 * torch.randn(2 * d, k, generator=g)).bfloat16()
    bias = (0.5 * torch.randn(2 * d, generator=g)).bfloat16()
    x = (2 * torch.randn(rows, k, generator=g)).bfloat16()
    small = rows <= cpu_prepack.SMALL_M_MAX
    _check(x, w, None, small)
    _check(x, w, bias, small)


@pytest.mark.parametrize("small", [True, False], ids=["small_m", "vnni"])
def test_non_finite_gates_and_ups(small) -> None:
    """+-inf and NaN as gate and up outputs, in SiLU's vector columns (0-63) and its scalar tail (64-79): the bias
    carries them (added to finite sums in float32), so each column's gate and up take every pair of specials."""
    d, k, rows = 80, 32, 12 if small else 16
    specials = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 1.0, -1.0, 3e38, -3e38])
    g = torch.Generator().manual_seed(7)
    w = (0.1 * torch.randn(2 * d, k, generator=g)).bfloat16()
    x = torch.randn(rows, k, generator=g).bfloat16()
    n = specials.numel()
    for shift in range(n):
        gate = specials[torch.arange(d) % n]
        up = specials[(torch.arange(d) // n + shift) % n]
        bias = torch.cat([gate, up]).bfloat16()
        gate_up = _plain_gate_up(x, w, bias, small)
        want = torch.ops.vllm_lite.fused_silu_and_mul(gate_up)
        got = _fused(x, w, bias, True, small)
        assert torch.equal(_bits(got), _bits(want)), f"{int((_bits(got) != _bits(want)).sum())} outputs differ"
        # torch's own F.silu(gate) * up in bf16 agrees on which outputs are NaN, and on the infinities.
        ref = torch.nn.functional.silu(gate_up[:, :d]) * gate_up[:, d:]
        assert torch.equal(torch.isnan(got), torch.isnan(ref))
        inf = torch.isinf(ref)
        assert torch.equal(torch.isinf(got), inf) and torch.equal(got[inf], ref[inf])


@pytest.mark.parametrize("rows", [65, 100, 145])
def test_vnni_takes_any_row_count(rows) -> None:
    g = torch.Generator().manual_seed(rows)
    d, k = 200, 96
    w = (0.2 * torch.randn(2 * d, k, generator=g)).bfloat16()
    x = (2 * torch.randn(rows, k, generator=g)).bfloat16()
    _check(x, w, None, small=False)


@pytest.mark.parametrize("small", [True, False], ids=["small_m", "vnni"])
def test_strided_x_and_smallest_k(small) -> None:
    g = torch.Generator().manual_seed(3)
    d = 40
    for k in (32,) if small else (2, 32):
        w = (0.2 * torch.randn(2 * d, k, generator=g)).bfloat16()
        wide = (2 * torch.randn(12 if small else 20, 3 * k, generator=g)).bfloat16()
        x = wide[:, k : 2 * k]
        assert not x.is_contiguous()
        _check(x, w, None, small)
        assert torch.equal(_fused(x, w, None, True, small), _fused(x.contiguous(), w, None, True, small))


def test_bits_do_not_depend_on_the_thread_count() -> None:
    g = torch.Generator().manual_seed(5)
    d, k = 3072, 256
    w = (0.1 * torch.randn(2 * d, k, generator=g)).bfloat16()
    xs = [(2 * torch.randn(rows, k, generator=g)).bfloat16() for rows in (3, 12, 32)]
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append([_fused(x, w, None, True, x.shape[0] <= 12) for x in xs])
    finally:
        torch.set_num_threads(before)
    for other in results[1:]:
        assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(results[0], other))
