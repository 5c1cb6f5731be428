"""csrc's moe_cpu_route (the router's product and fused_moe.route in one call) against F.linear + route(): the same
experts chosen, weights within float32 / bf16 rounding, renormalised or not, rounded to bf16 or not; the same bits
on 1 and 2 threads; SparseMoeBlock takes it with the C++ experts and keeps F.linear + route() otherwise."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllm_lite.worker.attention.cpu_kernels import cpu_op
from vllm_lite.worker.models import fused_moe
from vllm_lite.worker.models.fused_moe import SparseMoeBlock, route

pytestmark = pytest.mark.skipif(cpu_op("moe_cpu_route") is None, reason="CPU kernels not built here")

E, H = 8, 200  # H not a multiple of 16: the tail of the sums too


def _inputs(dtype, t=37, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, H, generator=g).to(dtype)
    w = (torch.randn(E, H, generator=g) * 0.2).to(dtype)
    return x, w


def _margin_ok(logits: torch.Tensor, k: int, gap: float) -> torch.Tensor:
    """Rows whose k-th and (k+1)-th largest logits differ by more than `gap` (a choice rounding cannot flip)."""
    top = torch.topk(logits.float(), k + 1, -1).values
    return (top[:, k - 1] - top[:, k]) > gap


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("k,renormalize,round_weights", [(2, True, False), (3, False, True), (8, True, True)])
def test_route_op_matches_f_linear_and_route(dtype, k, renormalize, round_weights):
    x, w = _inputs(dtype)
    logits = F.linear(x, w)
    want_w, want_ids = route(logits, k, renormalize, round_weights)
    got_w, got_ids = torch.ops.vllm_lite.moe_cpu_route(x, w, k, renormalize, round_weights)
    assert got_w.dtype == torch.float32 and got_ids.dtype == torch.int64 and got_w.shape == (37, k)
    rows = _margin_ok(logits, k, 1e-3 if dtype == torch.float32 else 0.1) if k < E else torch.ones(37, dtype=bool)
    assert rows.sum() > 20
    assert torch.equal(got_ids[rows], want_ids[rows])
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got_w[rows], want_w.float()[rows], rtol=tol, atol=tol)
    if renormalize:
        torch.testing.assert_close(got_w.sum(-1), torch.ones(37), rtol=1e-2 if round_weights else 1e-6, atol=1e-2)
    if round_weights and dtype == torch.bfloat16:
        assert torch.equal(got_w, got_w.bfloat16().float()), "weights must be bf16 values"
    if dtype == torch.float32 and not renormalize:
        # softmax over all experts: the top-k probabilities, no renormalisation
        torch.testing.assert_close(got_w, torch.softmax(F.linear(x, w), -1).gather(1, got_ids), rtol=1e-5, atol=1e-6)


def test_route_op_is_the_same_on_1_and_2_threads():
    x, w = _inputs(torch.float32, t=300)
    prev = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        a = torch.ops.vllm_lite.moe_cpu_route(x, w, 2, True, False)
        torch.set_num_threads(2)
        b = torch.ops.vllm_lite.moe_cpu_route(x, w, 2, True, False)
    finally:
        torch.set_num_threads(prev)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_route_op_ties_take_the_lower_expert_first_and_checks_its_arguments():
    x = torch.ones(2, 16)
    w = torch.zeros(4, 16)  # every logit 0: a tie among all experts
    weights, ids = torch.ops.vllm_lite.moe_cpu_route(x, w, 2, False, False)
    assert ids.tolist() == [[0, 1], [0, 1]]
    assert torch.equal(weights, torch.full((2, 2), 0.25))
    with pytest.raises(ValueError, match="top_k"):
        torch.ops.vllm_lite.moe_cpu_route(x, w, 5, True, False)
    with pytest.raises(ValueError, match="router"):
        torch.ops.vllm_lite.moe_cpu_route(x, torch.zeros(4, 8), 2, True, False)
    with pytest.raises(TypeError):
        torch.ops.vllm_lite.moe_cpu_route(x, w.bfloat16(), 2, True, False)
    empty_w, empty_ids = torch.ops.vllm_lite.moe_cpu_route(torch.zeros(0, 16), w, 2, True, False)
    assert empty_w.shape == (0, 2) and empty_ids.shape == (0, 2)


def _block(dtype, pack=True):
    torch.manual_seed(0)
    block = SparseMoeBlock(E, 2, 64, 48, renormalize=True)
    with torch.no_grad():
        block.gate.weight.copy_(torch.randn(E, 64) * 0.3)
        block.experts.w13_weight.copy_(torch.randn(E, 96, 64) * 0.1)
        block.experts.w2_weight.copy_(torch.randn(E, 64, 48) * 0.1)
    block.to(dtype)
    if pack:
        block.experts.process_weights_after_loading()
    return block


def test_sparse_moe_block_routes_in_cpp_with_the_cpp_experts(monkeypatch):
    block = _block(torch.float32)
    assert isinstance(block.experts.cpu_packed, fused_moe.KernelExperts)
    calls = []
    monkeypatch.setattr(fused_moe, "route", lambda *a, **k: calls.append(1) or route(*a, **k))
    x = torch.randn(5, 64)
    with torch.inference_mode():
        out = block(x)
    assert calls == [], "the C++ experts take the C++ routing"
    weights, ids = torch.ops.vllm_lite.moe_cpu_route(x, block.gate.weight, 2, True, False)
    assert torch.equal(out, block.experts.cpu_packed(x, weights, ids))
    # The route op missing (kernels built from older sources): F.linear + route(), close to the same.
    monkeypatch.setattr(fused_moe, "_cpu_route_op", lambda: None)
    with torch.inference_mode():
        out2 = block(x)
    assert calls == [1]
    torch.testing.assert_close(out2, out, rtol=1e-5, atol=1e-6)


def test_sparse_moe_block_without_the_cpp_experts_keeps_f_linear_and_route(monkeypatch):
    block = _block(torch.float32, pack=False)  # the plain grouped path (no packing after loading)
    calls = []
    monkeypatch.setattr(fused_moe, "route", lambda *a, **k: calls.append(1) or route(*a, **k))
    with torch.inference_mode():
        block(torch.randn(5, 64))
    assert calls == [1]
