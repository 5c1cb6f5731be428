"""bf16 SiLU-and-mul by table (csrc/fused_cpu_ops.cpp, silu_rows on AVX-512): every bf16 gate value, torch's bits.

On AVX-512 the vector columns of a bf16 row take silu(gate) rounded to bf16 from a table of all 65,536 gate bit
patterns (built once by the vector rule itself) instead of SLEEF's exp and a divide per element. These tests hold
it to torch's F.silu(gate) * up bit for bit for every pattern (zeros of both signs, subnormals, infinities, NaNs),
in vector columns and row tails (d % 64 != 0), for contiguous and strided rows, at 1 and 2 threads. The decoder
stack's prefill path (cpu_decoder_layers) calls the same silu_rows; tests/test_cpu_decoder_stack.py holds it to
the Python layers.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllm_lite.worker.attention.cpu_kernels import load_cpu_ops

pytestmark = pytest.mark.skipif(
    not (load_cpu_ops() and hasattr(torch.ops.vllm_lite, "fused_silu_and_mul")), reason="CPU kernels not built here"
)


def _exact() -> bool:
    """Whether the library's SiLU follows torch's vector split here (else it is held to 1 ulp, as elsewhere)."""
    ops = torch.ops.vllm_lite
    width = {"AVX512": 16, "AVX2": 8}.get(torch.backends.cpu.get_cpu_capability())
    return width == ops.fused_cpu_ops_vector_width() and ops.fused_cpu_ops_vector_exp()


def _torch_silu_mul(x: torch.Tensor) -> torch.Tensor:
    """torch's own F.silu(gate) * up for x [.., 2d], over the halves as views (SiluAndMul's torch path: torch then
    vectorises row by row, so a row's tail takes its scalar exp, as the kernel's)."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def _all_gates(d: int) -> torch.Tensor:
    """The 65,536 bf16 bit patterns as gates, rows of d (the last row padded with more patterns from the start)."""
    rows = -(-65536 // d)
    bits = torch.arange(rows * d, dtype=torch.int32).remainder(65536).to(torch.int16)
    return bits.view(torch.bfloat16).reshape(rows, d)


def _bits_equal_or_close(got: torch.Tensor, want: torch.Tensor) -> None:
    # NaNs: torch carries a NaN's payload where the kernels write bf16's default NaN; both NaN is a match.
    nan = got.isnan()
    assert torch.equal(nan, want.isnan())
    gi, wi = got.view(torch.int16), want.view(torch.int16)
    if _exact():
        diff = ((gi != wi) & ~nan).nonzero()
        assert diff.numel() == 0, (
            f"{diff.shape[0]} elements differ from torch, first at {diff[0].tolist()}: "
            f"got {got[tuple(diff[0])].item()} want {want[tuple(diff[0])].item()}"
        )
    else:
        assert ((gi.int() - wi.int()).abs()[~nan] <= 1).all()


@pytest.mark.parametrize("d", (4096, 3072, 100, 4864))
@pytest.mark.parametrize("up", ("random", "one", "specials"))
@torch.inference_mode()
def test_every_bf16_gate_matches_torch(d, up):
    """d = 4096 / 3072: vector columns only; 100 / 4864: rows with a scalar tail (d % 64 != 0)."""
    gate = _all_gates(d)
    gen = torch.Generator().manual_seed(d)
    if up == "random":
        u = (torch.randn(gate.shape, generator=gen) * 3).bfloat16()
    elif up == "one":
        u = torch.ones(gate.shape, dtype=torch.bfloat16)
    else:
        specials = torch.tensor([0.0, -0.0, 1e-40, -1e-40, float("inf"), -float("inf"), float("nan"), 3e38, -2.5])
        u = specials[torch.randint(0, len(specials), gate.shape, generator=gen)].bfloat16()
    x = torch.cat([gate, u], dim=1)
    got = torch.ops.vllm_lite.fused_silu_and_mul(x)
    _bits_equal_or_close(got, _torch_silu_mul(x))


@torch.inference_mode()
def test_strided_rows_and_threads():
    gate = _all_gates(1024)
    u = torch.randn(gate.shape, generator=torch.Generator().manual_seed(1)).bfloat16()
    wide = torch.cat([gate, u, torch.zeros(gate.shape[0], 40, dtype=torch.bfloat16)], dim=1)
    x = wide[:, : 2 * 1024]  # rows of 2048 with a stride of 2088
    want = _torch_silu_mul(x)
    prev = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            _bits_equal_or_close(torch.ops.vllm_lite.fused_silu_and_mul(x), want)
    finally:
        torch.set_num_threads(prev)


@torch.inference_mode()
def test_float32_unchanged():
    """float32 never takes the table: still SLEEF per element, torch's bits."""
    x = torch.randn(67, 2 * 200, generator=torch.Generator().manual_seed(2)) * 4
    got = torch.ops.vllm_lite.fused_silu_and_mul(x)
    want = _torch_silu_mul(x)
    if _exact():
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
