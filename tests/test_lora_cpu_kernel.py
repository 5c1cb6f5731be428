"""csrc's lora_add_cpu (torch.ops.vllm_lite.lora_add_cpu) against a float64 per-token reference.

The kernel groups a step's tokens by slot and runs every adapter's shrink and expand in one call; each token must
get exactly its own adapter's delta (ranks below the max zero-padded, fused sub-projections at their output
offsets), tokens with slot -1 must be left bit for bit, results must not depend on the thread count, and bad
inputs must raise before any data is touched. ``torch_ops.add_lora`` must send decode-sized steps to it and
larger ones to the bmm segments, with the same result either way.
"""

from __future__ import annotations

import pytest
import torch

from vllm_lite.lora import torch_ops
from vllm_lite.worker.attention.cpu_kernels import load_cpu_ops

pytestmark = pytest.mark.skipif(
    not load_cpu_ops() or not hasattr(torch.ops.vllm_lite, "lora_add_cpu"),
    reason="vllm-lite's CPU kernels are not built here (no compiler)",
)

SLOTS = 4


def _op():
    return torch.ops.vllm_lite.lora_add_cpu


def _case(k: int, outs: tuple[int, ...], r: int, slots: list[int], dtype: torch.dtype, pad: int = 3, seed: int = 0):
    """Slot tensors with slot s at rank r - s (zero-padded above), y with `pad` unrelated columns first."""
    g = torch.Generator().manual_seed(seed)
    n = len(outs)
    a = torch.zeros(SLOTS, n * r, k)
    bs = [torch.zeros(SLOTS, o, r) for o in outs]
    for s in range(SLOTS):
        rs = max(1, r - s)
        for i, b in enumerate(bs):
            a[s, i * r : i * r + rs] = torch.randn(rs, k, generator=g)
            b[s, :, :rs] = torch.randn(b.shape[1], rs, generator=g)
    offsets = [pad + sum(outs[:i]) for i in range(n)]
    width = pad + sum(outs)
    bt = torch.zeros(SLOTS, r, width)
    for b, off in zip(bs, offsets):
        bt[:, :, off : off + b.shape[1]] = b.transpose(1, 2)
    t = len(slots)
    x = torch.randn(t, k, generator=g)
    y = torch.randn(t, width, generator=g)
    cast = [v.to(dtype) for v in (y, x, a, bt)]
    return (*cast, [b.to(dtype) for b in bs], offsets, torch.tensor(slots, dtype=torch.int32))


def _reference(y, x, a, bs, offsets, slots) -> torch.Tensor:
    want = y.double().clone()
    r = bs[0].shape[2]
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        for i, (b, off) in enumerate(zip(bs, offsets)):
            h = a[s, i * r : (i + 1) * r].double() @ x[t].double()
            want[t, off : off + b.shape[1]] += b[s].double() @ h
    return want


SLOT_MIXES = {
    "round-robin-with-none": [0, 1, 2, 3, -1, 0, 1, 2, 3, -1, 0, 1, 2],
    "skewed": [2] * 11 + [0, -1, 3],
    "one-slot": [1] * 6,
    "single-token": [3],
    "no-adapter": [-1, -1, -1],
}
SHAPES = {
    "fused-qkv": (64, (48, 16, 16), 8),
    "odd-sizes": (37, (29,), 5),  # K and N off the 16-lane and 32-column blocks, odd rank
    "wide-gate-up": (32, (300, 300), 16),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("slots", SLOT_MIXES.values(), ids=SLOT_MIXES.keys())
def test_kernel_matches_per_token_reference(slots: list[int], shape: tuple, dtype: torch.dtype) -> None:
    k, outs, r = shape
    y, x, a, bt, bs, offsets, token_slots = _case(k, outs, r, slots, dtype)
    want = _reference(y, x, a, bs, offsets, token_slots)
    got = y.clone()
    _op()(got, x, a, bt, token_slots, offsets, list(outs))
    none = token_slots < 0
    assert torch.equal(got[none], y[none]), "a token without an adapter was changed"
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
    else:  # one bf16 rounding of each output (float32 math inside): within half an ulp, plus inputs' rounding
        torch.testing.assert_close(got.double(), want, rtol=8e-3, atol=5e-2)
        exact = want.to(torch.bfloat16)
        assert (got != exact).float().mean().item() < 0.05, "more than a few outputs off the correctly rounded value"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_kernel_is_thread_count_independent(dtype: torch.dtype) -> None:
    slots = [i % SLOTS for i in range(40)]
    y, x, a, bt, bs, offsets, token_slots = _case(256, (512, 128), 16, slots, dtype, seed=1)
    before = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            got = y.clone()
            _op()(got, x, a, bt, token_slots, offsets, [512, 128])
            outs.append(got)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_kernel_leaves_uncovered_columns_alone() -> None:
    y, x, a, bt, bs, offsets, token_slots = _case(16, (8,), 4, [0, 1, 2], torch.float32, pad=5)
    got = y.clone()
    _op()(got, x, a, bt, token_slots, offsets, [8])
    assert torch.equal(got[:, :5], y[:, :5])
    assert not torch.equal(got[:, 5:], y[:, 5:])


def _good():
    y, x, a, bt, bs, offsets, token_slots = _case(16, (8, 8), 4, [0, 1, -1], torch.float32)
    return dict(y=y, x=x, lora_a=a, lora_bt=bt, token_slots=token_slots, out_offsets=offsets, out_sizes=[8, 8])


BAD = {
    "slot-too-large": (lambda d: d.update(token_slots=torch.tensor([0, 4, -1], dtype=torch.int32)), ValueError),
    "slot-below-minus-one": (lambda d: d.update(token_slots=torch.tensor([0, -2, 1], dtype=torch.int32)), ValueError),
    "int64-slots": (lambda d: d.update(token_slots=d["token_slots"].long()), TypeError),
    "mixed-dtypes": (lambda d: d.update(x=d["x"].bfloat16()), TypeError),
    "half": (lambda d: d.update({k: d[k].half() for k in ("y", "x", "lora_a", "lora_bt")}), TypeError),
    "token-count": (lambda d: d.update(x=d["x"][:2]), ValueError),
    "k-mismatch": (lambda d: d.update(lora_a=d["lora_a"][:, :, :8].contiguous()), ValueError),
    "rank-mismatch": (lambda d: d.update(lora_bt=d["lora_bt"][:, :3].contiguous()), ValueError),
    "columns-outside-y": (lambda d: d.update(out_offsets=[3, 12]), ValueError),
    "sizes-count": (lambda d: d.update(out_sizes=[8]), ValueError),
    "non-contiguous-a": (
        lambda d: d.update(lora_a=d["lora_a"].transpose(0, 1).contiguous().transpose(0, 1)),
        ValueError,
    ),
    "strided-columns": (lambda d: d.update(x=torch.randn(16, 3).t()), ValueError),
}


@pytest.mark.parametrize("bad", BAD.values(), ids=BAD.keys())
def test_kernel_rejects_bad_inputs_before_touching_y(bad) -> None:
    change, exc = bad
    d = _good()
    change(d)
    y0 = d["y"].clone()
    with pytest.raises(exc):
        _op()(**d)
    assert torch.equal(d["y"], y0)


def _count_kernel_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Route csrc's lora_add_cpu through a wrapper that records each call's token count (the list returned)."""
    calls: list[int] = []
    real = _op()

    def counting(y, *args):
        calls.append(y.shape[0])
        real(y, *args)

    monkeypatch.setattr(torch_ops, "_KERNEL", [counting])
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_add_lora_takes_the_kernel_for_small_steps_and_segments_for_large(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _count_kernel_calls(monkeypatch)
    small = [i % SLOTS for i in range(torch_ops.KERNEL_MAX_TOKENS)]
    large = [i % SLOTS for i in range(torch_ops.KERNEL_MAX_TOKENS + 1)]
    for slots, kernel in ((small, True), (large, False)):
        y, x, a, bt, bs, offsets, token_slots = _case(64, (48, 16, 16), 8, slots, dtype)
        with_kernel, segments = y.clone(), y.clone()
        calls.clear()
        torch_ops.add_lora(with_kernel, x, a, bs, offsets, token_slots, lora_bt=bt)
        assert calls == ([len(slots)] if kernel else [])
        torch_ops.add_lora_segments(segments, x, a, bs, offsets, token_slots)
        tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-1)
        torch.testing.assert_close(with_kernel.double(), segments.double(), **tol)
        calls.clear()
        torch_ops.add_lora(y.clone(), x, a, bs, offsets, token_slots)  # no lora_bt: segments
        assert calls == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_reaches_the_kernel_through_ops_add_lora(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """LoRALinear has one path: ops.add_lora -> torch_ops.add_lora (looked up per call, so the benchmark's
    ``--ops`` swap reaches every layer), which runs csrc's op on a decode-sized step and segments on a larger one,
    both with the segments' result."""
    from torch import nn

    import vllm_lite.lora.layers as layers_mod
    from vllm_lite.lora.layers import LoRALinear, LoRAState, SubProjection

    g = torch.Generator().manual_seed(3)
    k, outs, r = 64, (48, 16), 8
    base = nn.Linear(k, sum(outs), bias=True).to(dtype)
    subs = [SubProjection(f"p{i}", sum(outs[:i]), o, 0) for i, o in enumerate(outs)]
    state = LoRAState()
    layer = LoRALinear(base, subs, False, state, SLOTS, r)
    for s in range(SLOTS):
        layer.set_slot(s, [(torch.randn(r, k, generator=g), torch.randn(o, r, generator=g)) for o in outs])
    calls = _count_kernel_calls(monkeypatch)
    routed: list[int] = []
    auto = torch_ops.add_lora

    def via_torch_ops(y, *args, **kw):
        routed.append(y.shape[0])
        auto(y, *args, **kw)

    dispatched: list[int] = []
    ops_add_lora = layers_mod.add_lora

    def counting_dispatch(y, *args):
        dispatched.append(y.shape[0])
        ops_add_lora(y, *args)

    monkeypatch.setattr(layers_mod, "add_lora", counting_dispatch)
    monkeypatch.setattr(torch_ops, "add_lora", via_torch_ops)
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-1)
    for t, kernel in ((torch_ops.KERNEL_MAX_TOKENS, True), (torch_ops.KERNEL_MAX_TOKENS + 1, False)):
        x = torch.randn(t, k, generator=g).to(dtype)
        slots = torch.tensor([(i % (SLOTS + 1)) - 1 for i in range(t)], dtype=torch.int32)  # -1 included
        state.token_slots = slots
        want = base(x)
        torch_ops.add_lora_segments(want, x, layer.lora_a, layer.lora_b, layer._offsets, slots)
        calls.clear()
        dispatched.clear()
        routed.clear()
        got = layer(x)
        assert dispatched == [t] and routed == [t] and calls == ([t] if kernel else [])
        torch.testing.assert_close(got.double(), want.double(), **tol)
