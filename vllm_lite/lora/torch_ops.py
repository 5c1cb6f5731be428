"""Batched LoRA in plain torch (CPU, and any device without the Triton kernels).

Every token t of a step carries ``token_slots[t]``, the device slot of its adapter (-1: none, adds nothing).
What a layer runs is ``add_lora``: the step's tokens with an adapter are laid out once per step
(``set_step_slots``; every layer shares the step's ``token_slots`` tensor) as ``num_segments`` segments of
``seg_len`` rows, each segment one slot's tokens (padded), so a projection's whole delta is one ``bmm``
for the shrink and one per fused sub-projection for the expand, with no loop over slots or requests: the
CPU counterpart of punica's SGMV. Segments are the slots themselves when their token counts are even enough
(the slots' weights are then a view, not a copy); otherwise a slot's tokens are split into several
segments of ``ceil(tokens / slots)`` rows and the segments' weights gathered, so padding never more than
about doubles the rows whatever the mix.

Measured on this AVX2 host (8 adapters rank 16, 100M Qwen2 shapes; benchmarks/lora_throughput.py ``--micro``,
one thread, median us, 32 tokens / 2048 tokens): qkv_proj segments 447 / 8,063, one matmul per slot
(``lora_shrink``/``lora_expand``, kept for comparison) 1,159 / 14,132, every slot's A stacked as one matmul
with columns masked per token (max_loras times the LoRA flops) 626 / 21,945, each token's A/B gathered and
one bmm (``*_gather``) 3,175 / 447,386; gate_up_proj 1,026 / 37,348 vs 1,932 / 46,400 per slot, 1,585 /
46,487 stacked (down_proj at 2048 tokens is the one shape where per-slot matmuls lead: 7.9 vs 10.5 ms).
In the engine (``--ops``, 1 thread) segments keep 0.92x the base model's output tok/s, one
matmul per slot 0.83x; with 2 threads on a loaded host per-slot matmuls fall to 0.44x (each small op is an
OpenMP region), segments 0.88x.

Decode-sized steps (<= KERNEL_MAX_TOKENS tokens) now run csrc's ``lora_add_cpu`` instead (one call per projection
for every slot, over the layer's transposed B, ``lora_bt``): on Zen 4, 2 threads, 32 tokens, bf16 qkv_proj 244 ->
77 us, gate_up 311 -> 129 us; end to end 8 adapters / base bf16 0.79-0.90 (segments 0.70-0.78), float32 0.94
(0.88) (benchmarks/PROFILE.md, "LoRA on CPU"). Prefill-sized steps stay on segments, which win there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Union

import numpy as np
import torch

# Gather each token's A/B and bmm up to this many gathered elements, else group by slot (``lora_shrink`` /
# ``lora_expand`` only, which ``add_lora`` does not use). Off (0): in the engine it lost to grouping.
GATHER_MAX_ELEMENTS = 0

# Steps of at most this many tokens run csrc's lora_add_cpu where it is built, larger ones segments (bmm).
KERNEL_MAX_TOKENS = 64
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)
_KERNEL: list[Optional[Callable[..., None]]] = []  # [op or None] once looked up (kernel_op)


@dataclass(frozen=True)
class SegmentPlan:
    """One step's tokens with an adapter as equal-length segments of one slot each (see the module doc)."""

    num_segments: int
    seg_len: int
    # Segment i uses slot slot_lo + i (weights a view) when seg_slots is None, else slot seg_slots[i].
    slot_lo: int
    seg_slots: Optional[torch.Tensor]  # [num_segments] int64
    rows: Optional[torch.Tensor]  # [num_segments * seg_len] int64: each row's token (pads: 0); None: row = token
    pad: Optional[torch.Tensor]  # [num_segments, seg_len, 1] bool: pad rows (zeroed after the shrink); None: none
    # [T] int64: the row each token's delta is read back from (no adapter: a pad row, whose delta is 0), so the
    # expand writes y with one gather and one dense add (index_add_ into y's column slice was 3-5x slower).
    token_rows: Optional[torch.Tensor]
    no_adapter: Optional[torch.Tensor]  # [T, 1] bool: tokens to zero after that gather, when no pad row exists


def plan_segments(token_slots: Union[torch.Tensor, np.ndarray]) -> Optional[SegmentPlan]:
    """Lay out a step's tokens by slot (vectorised numpy, once per step); None when no token has an adapter."""
    if isinstance(token_slots, torch.Tensor):
        device = token_slots.device
        slots = token_slots.detach().to("cpu").numpy().astype(np.int64, copy=False)
    else:
        device = torch.device("cpu")
        slots = np.asarray(token_slots, dtype=np.int64)
    tokens = np.flatnonzero(slots >= 0)
    n = len(tokens)
    if n == 0:
        return None
    order = np.argsort(slots[tokens], kind="stable")
    tok_sorted = tokens[order]
    slot_sorted = slots[tok_sorted]
    uniq, first, counts = np.unique(slot_sorted, return_index=True, return_counts=True)
    which = np.repeat(np.arange(len(uniq)), counts)  # index into uniq of each sorted token
    rank = np.arange(n) - first[which]  # position of each token among its slot's tokens
    lo, span, longest = int(uniq[0]), int(uniq[-1]) - int(uniq[0]) + 1, int(counts.max())
    seg_slots: Optional[np.ndarray] = None
    if span * longest <= 2 * n:  # the slots lo..hi themselves (absent ones are all padding)
        seg_len, num_segments = longest, span
        seg, pos = slot_sorted - lo, rank
    else:  # split each slot's tokens into segments of about n / slots rows
        seg_len = -(-n // len(uniq))
        per_slot = -(-counts // seg_len)
        num_segments = int(per_slot.sum())
        seg = (np.cumsum(per_slot) - per_slot)[which] + rank // seg_len
        pos = rank % seg_len
        seg_slots = np.repeat(uniq, per_slot)
        if np.array_equal(seg_slots, np.arange(lo, lo + num_segments)):
            seg_slots = None  # consecutive slots, one segment each: a view again
    at = seg * seg_len + pos
    total = num_segments * seg_len
    rows = np.zeros(total, dtype=np.int64)
    rows[at] = tok_sorted
    pad = np.ones(total, dtype=bool)
    pad[at] = False
    has_pad = bool(pad.any())
    identity = not has_pad and total == len(slots) and bool((rows == np.arange(total)).all())
    token_rows = np.zeros(len(slots), dtype=np.int64)
    if has_pad:
        token_rows[:] = int(np.argmax(pad))  # the first pad row
    token_rows[tok_sorted] = at
    no_adapter = None if has_pad or n == len(slots) else (slots < 0).reshape(-1, 1)

    def dev(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(device, non_blocking=True)

    return SegmentPlan(
        num_segments=num_segments,
        seg_len=seg_len,
        slot_lo=lo,
        seg_slots=None if seg_slots is None else dev(seg_slots),
        rows=None if identity else dev(rows),
        pad=dev(pad.reshape(num_segments, seg_len, 1)) if has_pad else None,
        token_rows=None if identity else dev(token_rows),
        no_adapter=None if no_adapter is None else dev(no_adapter),
    )


def _slot_weights(w: torch.Tensor, plan: SegmentPlan) -> torch.Tensor:
    """[num_segments, ...]: each segment's slot of a [max_loras, ...] slot tensor (a view where it can be)."""
    if plan.seg_slots is None:
        return w.narrow(0, plan.slot_lo, plan.num_segments)
    return w.index_select(0, plan.seg_slots)


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: list[torch.Tensor],
    out_offsets: list[int],
    token_slots: torch.Tensor,
    lora_bt: Optional[torch.Tensor] = None,
) -> None:
    """In place: y[t, off_i : off_i + out_i] += B_i[slot[t]] @ A_i[slot[t]] @ x[t] for every sub-projection i.

    x [T, in]; lora_a [S, n_sub * r, in] (sub i's A in rows i*r ... (i+1)*r); lora_b[i] [S, out_i, r] (scaled);
    tokens with slot -1 are untouched. ``lora_bt`` [S, r, N] (each sub's B transposed into its own output
    columns of y), where the layer keeps one, lets a step of at most KERNEL_MAX_TOKENS tokens run csrc's kernel
    (one call for every slot, see the module doc); otherwise, and without the kernel, ``add_lora_segments``.
    """
    if lora_bt is not None and x.shape[0] <= KERNEL_MAX_TOKENS:
        op = _KERNEL[0] if _KERNEL else kernel_op()
        if op is not None and _kernel_fits(y, x, lora_a, lora_bt, token_slots):
            op(y, x, lora_a, lora_bt, token_slots, out_offsets, [b.shape[1] for b in lora_b])
            return
    add_lora_segments(y, x, lora_a, lora_b, out_offsets, token_slots)


def _kernel_fits(
    y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_bt: torch.Tensor, token_slots: torch.Tensor
) -> bool:
    """What csrc's op takes: CPU, float32/bfloat16 all alike, int32 slots, unit column strides (cheapest first)."""
    dtype = y.dtype
    return (
        x.dtype is dtype
        and lora_bt.dtype is dtype
        and lora_a.dtype is dtype
        and dtype in _KERNEL_DTYPES
        and token_slots.dtype is torch.int32
        and y.stride(-1) == 1
        and x.stride(-1) == 1
        and not y.is_cuda
    )


def kernel_op() -> Optional[Callable[..., None]]:
    """torch.ops.vllm_lite.lora_add_cpu once csrc's CPU kernels load here and have it; None: torch only."""
    if not _KERNEL:
        from vllm_lite.worker.attention.cpu_kernels import cpu_op

        op = cpu_op("lora_add_cpu")
        # The overload itself: calling it skips the packet's overload resolution (a few us a call).
        _KERNEL.append(None if op is None else getattr(op, "default", op))
    return _KERNEL[0]


def set_kernel_op(op: Optional[Callable[..., None]]) -> None:
    """Use this op as csrc's kernel (None: none, every step takes segments); for tests and benchmarks."""
    _KERNEL[:] = [op]


def add_lora_segments(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: list[torch.Tensor],
    out_offsets: list[int],
    token_slots: torch.Tensor,
    lora_bt: Optional[torch.Tensor] = None,
) -> None:
    """``add_lora`` by segments: two bmm-shaped products per sub-projection, batched over segments."""
    plan = step_plan(token_slots)
    if plan is None:
        return
    nseg, m = plan.num_segments, plan.seg_len
    xs = x if plan.rows is None else x.index_select(0, plan.rows)
    a = _slot_weights(lora_a, plan)
    buf = torch.bmm(xs.reshape(nseg, m, x.shape[1]).to(a.dtype), a.transpose(1, 2))  # [nseg, m, n_sub * r]
    if plan.pad is not None:
        buf.masked_fill_(plan.pad, 0)  # pad rows gathered token 0: their delta must be 0
    r = lora_a.shape[1] // len(lora_b)
    for i, (b_all, off) in enumerate(zip(lora_b, out_offsets)):
        b = _slot_weights(b_all, plan)
        part = buf if len(lora_b) == 1 else buf[:, :, i * r : (i + 1) * r]
        delta = torch.bmm(part, b.transpose(1, 2)).view(nseg * m, -1).to(y.dtype)
        if plan.token_rows is not None:
            delta = delta.index_select(0, plan.token_rows)
            if plan.no_adapter is not None:
                delta.masked_fill_(plan.no_adapter, 0)
        y.narrow(1, off, b_all.shape[1]).add_(delta)


# The step's token_slots (held, so its identity cannot be reused) and what is built from them on first use:
# its segment plan ("plan") and slot groups ("groups", by ``lora_shrink``/``lora_expand``); see `set_step_slots`.
# A step that runs csrc's kernel builds neither.
_step: Optional[tuple[torch.Tensor, dict]] = None


def step_plan(token_slots: torch.Tensor) -> Optional[SegmentPlan]:
    """The segment plan of these token_slots: the step's, built once, when they are the step's tensor."""
    step = _step
    if step is not None and step[0] is token_slots:
        if "plan" not in step[1]:
            step[1]["plan"] = plan_segments(token_slots)
        return step[1]["plan"]
    return plan_segments(token_slots)


def _groups(token_slots: torch.Tensor) -> list[tuple[int, Optional[torch.Tensor]]]:
    slots = [s for s in torch.unique(token_slots).tolist() if s >= 0]
    if len(slots) == 1 and bool((token_slots == slots[0]).all()):
        return [(slots[0], None)]
    return [(s, torch.nonzero(token_slots == s).squeeze(1)) for s in slots]


def set_step_slots(token_slots: Optional[torch.Tensor]) -> None:
    """This step's slots: its segments are planned once, on first use, for every layer's call with this tensor."""
    global _step
    _step = None if token_slots is None else (token_slots, {})


def slot_groups(token_slots: torch.Tensor) -> list[tuple[int, Optional[torch.Tensor]]]:
    """[(slot, indices of its tokens)] for the slots present (indices None: every token is in that slot)."""
    step = _step
    if step is not None and step[0] is token_slots:
        if "groups" not in step[1]:
            step[1]["groups"] = _groups(token_slots)
        return step[1]["groups"]
    return _groups(token_slots)


def _gather_pays(groups: list[tuple[int, Optional[torch.Tensor]]], num_tokens: int, weight: torch.Tensor) -> bool:
    """Several adapters in a small batch (decode): gathering each token's matrix (one bmm) beats one matmul per
    slot, whose per-op cost dominates there; past GATHER_MAX_ELEMENTS gathered, grouping wins (see module doc)."""
    return len(groups) > 1 and num_tokens * weight.shape[1] * weight.shape[2] <= GATHER_MAX_ELEMENTS


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """buf[t] = A[slot[t]] @ x[t] -> float32 [T, R]; rows of tokens without an adapter are 0."""
    groups = slot_groups(token_slots)
    if _gather_pays(groups, x.shape[0], lora_a):
        return lora_shrink_gather(x, lora_a, token_slots)
    buf = torch.zeros((x.shape[0], lora_a.shape[1]), dtype=torch.float32, device=x.device)
    for s, idx in groups:
        a = lora_a[s]
        if idx is None:
            buf.copy_(torch.matmul(x, a.t()))
        else:
            buf.index_copy_(0, idx, torch.matmul(x.index_select(0, idx), a.t()).to(torch.float32))
    return buf


def lora_expand(
    y: torch.Tensor, buf: torch.Tensor, lora_b: torch.Tensor, token_slots: torch.Tensor, out_offset: int = 0
) -> None:
    """y[t, out_offset : out_offset + out] += B[slot[t]] @ buf[t], in place; tokens without an adapter untouched."""
    groups = slot_groups(token_slots)
    if _gather_pays(groups, y.shape[0], lora_b):
        lora_expand_gather(y, buf, lora_b, token_slots, out_offset)
        return
    out = lora_b.shape[1]
    target = y.narrow(1, out_offset, out)
    for s, idx in groups:
        b = lora_b[s]
        if idx is None:
            target.add_(torch.matmul(buf.to(b.dtype), b.t()).to(y.dtype))
        else:
            delta = torch.matmul(buf.index_select(0, idx).to(b.dtype), b.t()).to(y.dtype)
            target.index_add_(0, idx, delta)


def lora_shrink_gather(x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """lora_shrink by gathering each token's A and one bmm (the alternative the benchmark compares)."""
    valid = (token_slots >= 0).unsqueeze(1)
    a = lora_a.index_select(0, token_slots.clamp(min=0).long())  # [T, R, in]
    buf = torch.bmm(a, x.unsqueeze(-1).to(a.dtype)).squeeze(-1).to(torch.float32)
    return buf * valid


def lora_expand_gather(
    y: torch.Tensor, buf: torch.Tensor, lora_b: torch.Tensor, token_slots: torch.Tensor, out_offset: int = 0
) -> None:
    """lora_expand by gathering each token's B and one bmm."""
    valid = (token_slots >= 0).unsqueeze(1)
    b = lora_b.index_select(0, token_slots.clamp(min=0).long())  # [T, out, R]
    delta = torch.bmm(b, buf.unsqueeze(-1).to(b.dtype)).squeeze(-1) * valid
    y.narrow(1, out_offset, lora_b.shape[1]).add_(delta.to(y.dtype))
