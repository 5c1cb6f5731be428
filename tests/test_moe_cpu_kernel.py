"""csrc/moe_cpu.cpp: the float32 CPU expert path in one op (moe_cpu_pack + moe_cpu_experts)."""

from __future__ import annotations

import pytest
import torch

from vllm_lite.worker.models import fused_moe as fm

pytestmark = pytest.mark.skipif(not fm._cpu_moe_kernel(), reason="csrc's CPU kernels are not built here")


def _experts(e: int, h: int, inter: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(e, 2 * inter, h, generator=g) * 0.1, torch.randn(e, h, inter, generator=g) * 0.1


def _routing(t: int, e: int, k: int, h: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    weights, ids = fm.route(torch.randn(t, e, generator=g), k, renormalize=True)
    return torch.randn(t, h, generator=g), weights, ids


# (experts, hidden, intermediate, top-k, tokens): the benchmark's Mixtral shape at decode/prefill sizes, and sizes
# that leave partial vector blocks (intermediate and hidden not multiples of 8 or 16, the SiLU's scalar tail).
SHAPES = [(8, 256, 896, 2, 64), (8, 256, 896, 2, 1), (8, 256, 896, 2, 300), (4, 40, 24, 2, 17), (6, 64, 100, 3, 9)]


@pytest.mark.parametrize("e,h,inter,k,t", SHAPES)
def test_kernel_matches_the_torch_expert_path(e: int, h: int, inter: int, k: int, t: int) -> None:
    w13, w2 = _experts(e, h, inter)
    x, weights, ids = _routing(t, e, k, h)
    experts = fm.KernelExperts(w13, w2)
    got = fm.grouped_experts(x, w13, w2, weights, ids, experts)
    want = fm.grouped_experts(x, w13, w2, weights, ids, None)
    # Its matmul sums run in another order than MKL's: float32 differences of ~1e-6 of the output's scale.
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * float(want.abs().max()))


@pytest.mark.parametrize("k", [2, 3])
def test_each_tokens_contributions_sum_in_transformers_order_bit_for_bit(k: int) -> None:
    """Given the op's own per-pair outputs (top-1 calls with weight 1), the top-k output is the torch path's sum:
    products rounded, added in ascending expert id (transformers' per-expert index_add_), starting from zero."""
    e, h, inter, t = 6, 64, 100, 23
    w13, w2 = _experts(e, h, inter)
    x, weights, ids = _routing(t, e, k, h)
    experts = fm.KernelExperts(w13, w2)
    got = experts(x, weights, ids)
    per_pair = [experts(x, torch.ones(t, 1), ids[:, j : j + 1]) for j in range(k)]  # [T, H] each
    pairs = torch.stack(per_pair, 1)  # [T, k, H]
    by_expert = torch.argsort(ids, dim=-1)
    contrib = pairs.gather(1, by_expert[:, :, None].expand(-1, -1, h))
    w = weights.gather(1, by_expert)
    want = torch.zeros(t, h)
    for j in range(k):
        want = want + contrib[:, j] * w[:, j, None]
    assert torch.equal(got, want)


def test_rows_do_not_depend_on_the_batch() -> None:
    """A token's output is the same alone as among others (its sums never depend on an expert's row count)."""
    e, h, inter = 8, 256, 896
    w13, w2 = _experts(e, h, inter)
    x, weights, ids = _routing(37, e, 2, h)
    experts = fm.KernelExperts(w13, w2)
    whole = experts(x, weights, ids)
    for i in (0, 5, 36):
        assert torch.equal(experts(x[i : i + 1], weights[i : i + 1], ids[i : i + 1])[0], whole[i])


def test_no_tokens_and_strided_rows() -> None:
    e, h, inter = 4, 32, 48
    w13, w2 = _experts(e, h, inter)
    experts = fm.KernelExperts(w13, w2)
    empty = experts(torch.empty(0, h), torch.empty(0, 2), torch.empty(0, 2, dtype=torch.long))
    assert empty.shape == (0, h)
    x, weights, ids = _routing(5, e, 2, h)
    wide = torch.cat([x, torch.randn(5, 7)], dim=1)[:, :h]  # rows with a stride > h
    assert torch.equal(experts(wide, weights, ids), experts(x, weights, ids))


def test_bad_inputs_raise_before_any_data_is_read() -> None:
    e, h, inter = 4, 32, 48
    w13, w2 = _experts(e, h, inter)
    experts = fm.KernelExperts(w13, w2)
    x, weights, ids = _routing(3, e, 2, h)
    ops = torch.ops.vllm_lite
    with pytest.raises(ValueError, match="outside"):
        experts(x, weights, torch.tensor([[0, 1], [2, 4], [0, 3]]))
    with pytest.raises(ValueError, match="outside"):
        experts(x, weights, torch.tensor([[0, -1], [2, 1], [0, 3]]))
    with pytest.raises(TypeError, match="dtype"):
        experts(x.bfloat16(), weights, ids)
    with pytest.raises(ValueError, match="w13p"):
        ops.moe_cpu_experts(torch.randn(3, h + 1), experts.w13, experts.w2, weights, ids, inter)
    with pytest.raises(ValueError, match="inter"):
        ops.moe_cpu_experts(x, experts.w13, experts.w2, weights, ids, inter + 64)
    with pytest.raises(ValueError, match="topk_ids"):
        ops.moe_cpu_experts(x, experts.w13, experts.w2, weights, ids[:2], inter)
    with pytest.raises(ValueError, match="w2"):
        ops.moe_cpu_pack(w13, w2[:, :, :-1])


def test_float32_layers_take_the_kernel_and_the_flag_turns_it_off(monkeypatch) -> None:
    e, h, inter = 4, 32, 48
    w13, w2 = _experts(e, h, inter)
    packed, why = fm.pack_experts_for_cpu(w13, w2)
    assert isinstance(packed, fm.KernelExperts) and why == ""
    bf16, _ = fm.pack_experts_for_cpu(w13.bfloat16(), w2.bfloat16())  # bfloat16 stays on oneDNN (or plain)
    assert not isinstance(bf16, fm.KernelExperts)
    monkeypatch.setenv("VLLM_LITE_CPU_MOE_KERNEL", "0")
    packed, _ = fm.pack_experts_for_cpu(w13, w2)
    assert not isinstance(packed, fm.KernelExperts)
