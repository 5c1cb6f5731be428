"""The CPU LoRA op (``torch_ops.add_lora``) against a float64 per-token reference, for every segment layout.

A step's tokens with an adapter are laid out once as equal-length segments of one slot each: the slots
themselves when their counts are even (weights a view), else slots split into several segments (weights
gathered). Each layout must give every token exactly its own adapter's delta, leave tokens without one
untouched, and honour ranks below the max (zero-padded A rows / B columns) in fused sub-projections.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_lite.lora import torch_ops

SLOTS, MAX_RANK, IN = 4, 8, 12
OUTS = (10, 6, 6)  # a fused q/k/v-like layer: three sub-projections side by side
OFFSET = 3  # the fused output starts after 3 unrelated columns


def _slot_tensors(g: torch.Generator) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A [S, 3 * max_rank, in], B_i [S, out_i, max_rank] with slot s at rank 2 + 2 s (zero-padded above it)."""
    a = torch.zeros(SLOTS, len(OUTS) * MAX_RANK, IN)
    bs = [torch.zeros(SLOTS, o, MAX_RANK) for o in OUTS]
    for s in range(SLOTS):
        r = 2 + 2 * s
        for i, b in enumerate(bs):
            a[s, i * MAX_RANK : i * MAX_RANK + r] = torch.randn(r, IN, generator=g)
            b[s, :, :r] = torch.randn(b.shape[1], r, generator=g)
    return a, bs


def _reference(y, x, a, bs, slots) -> torch.Tensor:
    want = y.double().clone()
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        off = OFFSET
        for i, b in enumerate(bs):
            h = a[s, i * MAX_RANK : (i + 1) * MAX_RANK].double() @ x[t].double()
            want[t, off : off + b.shape[1]] += b[s].double() @ h
            off += b.shape[1]
    return want


CASES = {
    "even-mix-with-no-adapter": [0, 2, -1, 1, 3, 0, -1, 2, 1, 3, 0, 2],
    "unbalanced-split": [1] * 13 + [3, -1, 0, 1, 1, -1],
    "one-slot-in-order": [2] * 7,
    "one-slot-among-none": [-1, 2, 2, -1, 2],
    "gapped-slots": [0, 3, 3, 3, 3, 3, 3, 3, 3, 0],
    "single-token": [3],
}


@pytest.mark.parametrize("slots", CASES.values(), ids=CASES.keys())
def test_add_lora_gives_each_token_its_adapter_delta(slots: list[int]) -> None:
    g = torch.Generator().manual_seed(len(slots))
    a, bs = _slot_tensors(g)
    token_slots = torch.tensor(slots, dtype=torch.int32)
    x = torch.randn(len(slots), IN, generator=g)
    y = torch.randn(len(slots), OFFSET + sum(OUTS) + 2, generator=g)
    want = _reference(y, x, a, bs, token_slots)
    got = y.clone()
    offsets = list(np.cumsum((OFFSET,) + OUTS[:-1]))
    torch_ops.add_lora(got, x, a, bs, offsets, token_slots)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    no_adapter = token_slots < 0
    assert torch.equal(got[no_adapter], y[no_adapter])  # bit for bit, not just close


def test_the_step_plan_is_built_once_and_shared_by_layers() -> None:
    token_slots = torch.tensor([1, 0, 1, -1], dtype=torch.int32)
    torch_ops.set_step_slots(token_slots)
    try:
        plan = torch_ops.step_plan(token_slots)
        assert plan is not None and torch_ops.step_plan(token_slots) is plan
        assert torch_ops.step_plan(token_slots.clone()) is not plan  # another tensor: planned afresh
    finally:
        torch_ops.set_step_slots(None)


def test_segments_stay_views_when_even_and_padding_stays_bounded() -> None:
    even = torch_ops.plan_segments(np.array([0, 1, 2, 3] * 8))
    assert even is not None and even.seg_slots is None and even.pad is None  # decode: slots are the segments
    assert (even.num_segments, even.seg_len) == (4, 8)
    alone = torch_ops.plan_segments(np.array([2] * 9))
    assert alone is not None and alone.rows is None  # one adapter for every token: no gather, no scatter
    skewed = np.array([1] * 100 + [0, 2, 3])
    plan = torch_ops.plan_segments(skewed)
    assert plan is not None and plan.seg_slots is not None  # slot 1 split over several segments
    assert plan.num_segments * plan.seg_len <= 2 * len(skewed) + SLOTS * plan.seg_len
    assert torch_ops.plan_segments(np.array([-1, -1])) is None
