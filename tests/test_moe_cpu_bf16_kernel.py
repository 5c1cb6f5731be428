"""csrc/moe_cpu.cpp's bfloat16 expert path (moe_cpu_pack_bf16 / moe_cpu_experts_bf16, VDPBF16PS), which
bfloat16 MoE layers take on builds that target AVX512-BF16 (fused_moe.Bf16KernelExperts).

Against the torch path (grouped_experts without packing: F.linear per expert, bf16 roundings after each
projection, SiLU, product and weighted add): equal bit for bit where every product and sum is exact (small
integers), within bf16 rounding otherwise, over row counts that leave partial register tiles, intermediate
and hidden sizes off the 16/32-column blocks, and k = 1-4; the same bits on 1 and 2 threads; the layer picks
it and VLLM_LITE_CPU_MOE_KERNEL=0 turns it off; bad inputs raise before any data is read.
Skipped where the build does not target AVX512-BF16 (Zen 3 / AVX2 hosts: bfloat16 experts stay on oneDNN).
"""

from __future__ import annotations

import pytest
import torch

from vllm_lite.worker.models import fused_moe as fm

pytestmark = pytest.mark.skipif(
    not fm._cpu_moe_bf16_kernel(), reason="the build does not target AVX512-BF16: bf16 experts stay on oneDNN"
)


def _case(t: int, e: int, k: int, h: int, inter: int, seed: int, ints: bool = False):
    g = torch.Generator().manual_seed(seed)
    if ints:  # small integers: every bf16 product and float32 sum below is exact
        x = torch.randint(-2, 3, (t, h), generator=g).bfloat16()
        w13 = torch.randint(-1, 2, (e, 2 * inter, h), generator=g).bfloat16()
        w2 = torch.randint(-1, 2, (e, h, inter), generator=g).bfloat16()
    else:
        x = torch.randn(t, h, generator=g).bfloat16()
        w13 = (torch.randn(e, 2 * inter, h, generator=g) / h**0.5).bfloat16()
        w2 = (torch.randn(e, h, inter, generator=g) / inter**0.5).bfloat16()
    weights, ids = fm.route(torch.randn(t, e, generator=g), k, renormalize=True)
    return x, w13, w2, weights, ids


@pytest.mark.parametrize("t", [1, 7, 64, 300])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_matches_the_torch_path_within_bf16_rounding(t, k):
    x, w13, w2, weights, ids = _case(t, 8, k, 48, 40, seed=t + k)
    want = fm.grouped_experts(x, w13, w2, weights, ids)
    got = fm.Bf16KernelExperts(w13, w2)(x, weights, ids)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    # Most outputs are the same bf16 value (the matmul sums differ in order only).
    assert (got == want).float().mean() > 0.9


@pytest.mark.parametrize("t", [3, 37])
def test_exact_inputs_give_the_torch_paths_bits(t):
    x, w13, w2, weights, ids = _case(t, 6, 2, 64, 24, seed=7, ints=True)
    want = fm.grouped_experts(x, w13, w2, weights, ids)
    got = fm.Bf16KernelExperts(w13, w2)(x, weights, ids)
    assert torch.equal(got, want)


def test_one_and_two_threads_give_the_same_bits():
    x, w13, w2, weights, ids = _case(200, 8, 2, 256, 96, seed=1)
    experts = fm.Bf16KernelExperts(w13, w2)
    two = experts(x, weights, ids)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = experts(x, weights, ids)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_bf16_layers_take_the_kernel_and_the_flag_turns_it_off(monkeypatch):
    _, w13, w2, _, _ = _case(1, 4, 2, 32, 48, seed=2)
    packed, why = fm.pack_experts_for_cpu(w13, w2)
    assert isinstance(packed, fm.Bf16KernelExperts) and why == ""
    odd, _ = fm.pack_experts_for_cpu(w13[:, :, :31], w2[:, :31])  # odd hidden size: no bf16 pairs
    assert not isinstance(odd, fm.Bf16KernelExperts)
    monkeypatch.setenv("VLLM_LITE_CPU_MOE_KERNEL", "0")
    packed, _ = fm.pack_experts_for_cpu(w13, w2)
    assert not isinstance(packed, fm.Bf16KernelExperts)


def test_bad_inputs_raise_before_any_data_is_read():
    x, w13, w2, weights, ids = _case(3, 4, 2, 32, 48, seed=3)
    experts = fm.Bf16KernelExperts(w13, w2)
    ops = torch.ops.vllm_lite
    with pytest.raises(ValueError, match="outside"):
        experts(x, weights, torch.tensor([[0, 1], [2, 4], [0, 3]]))
    with pytest.raises(TypeError, match="dtype"):
        experts(x.float(), weights, ids)
    with pytest.raises(ValueError, match="inter"):
        ops.moe_cpu_experts_bf16(x, experts.w13, experts.w2, weights, ids, 48 + 16)
    with pytest.raises(ValueError, match="w13p"):
        ops.moe_cpu_experts_bf16(torch.randn(3, 34).bfloat16(), experts.w13, experts.w2, weights, ids, 48)
    with pytest.raises(ValueError, match="H even"):
        ops.moe_cpu_pack_bf16(w13[:, :, :31], w2[:, :31])
