"""Batched LoRA shrink/expand in plain torch (CPU, and any device without the Triton kernels).

Same signatures as ``triton_ops``: every token t of a step carries ``token_slots[t]``, the device slot of
its adapter (-1: none, adds nothing). Tokens are grouped by slot once per step (``set_step_slots``: every
layer shares the step's ``token_slots`` tensor), then each slot's tokens go through one
matmul: a loop over at most ``max_loras`` slots, never over requests. The alternative, gathering each
token's A and B and one bmm, is kept behind ``GATHER_MAX_ELEMENTS`` (off: it lost in the engine benchmark;
benchmarks/lora_throughput.py ``--ops`` times each way).
"""

from __future__ import annotations

from typing import Optional

import torch

# Gather each token's A/B and bmm up to this many gathered elements, else group by slot. Off (0): in the
# engine (benchmarks/lora_throughput.py, 100M Qwen2, 8 adapters rank 16, 8 prompts, float32, AVX2) grouped
# gave 1.5x the output tokens per CPU second of gathering below 2^19 elements, in each of 3 interleaved repeats,
# although one layer alone under heavy load (8 tokens, 768 -> 2304) had timed gather 5.6x faster (64 tokens:
# grouped 1.26x, 256: 2.5x). Kept selectable so the two can be measured again on other machines.
GATHER_MAX_ELEMENTS = 0

# The step's token_slots (held, so its identity cannot be reused) and its groups; see `set_step_slots`.
_step: Optional[tuple[torch.Tensor, list[tuple[int, Optional[torch.Tensor]]]]] = None


def _groups(token_slots: torch.Tensor) -> list[tuple[int, Optional[torch.Tensor]]]:
    slots = [s for s in torch.unique(token_slots).tolist() if s >= 0]
    if len(slots) == 1 and bool((token_slots == slots[0]).all()):
        return [(slots[0], None)]
    return [(s, torch.nonzero(token_slots == s).squeeze(1)) for s in slots]


def set_step_slots(token_slots: Optional[torch.Tensor]) -> None:
    """Group this step's tokens once; every layer's call with this same tensor reuses the groups."""
    global _step
    _step = None if token_slots is None else (token_slots, _groups(token_slots))


def slot_groups(token_slots: torch.Tensor) -> list[tuple[int, Optional[torch.Tensor]]]:
    """[(slot, indices of its tokens)] for the slots present (indices None: every token is in that slot)."""
    step = _step
    if step is not None and step[0] is token_slots:
        return step[1]
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
