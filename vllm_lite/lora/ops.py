"""The LoRA delta a layer adds: the Triton kernels for CUDA tensors when they import, else torch.

``add_lora`` is what a layer calls: on CUDA the Triton kernels (``triton_ops``: one launch per projection for
decode-sized steps, else a shrink then an expand for every fused sub-projection), elsewhere
``torch_ops.add_lora`` (csrc's one-call kernel for decode-sized steps, else segments of one slot each, two
bmm's). The choice is per call, by the device of the input. ``lora_shrink``/``lora_expand`` (same signature in
both modules) stay callable on their own for kernels' tests and benchmarks.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from vllm_lite.lora import torch_ops

_triton: Optional[Any] = None
_triton_tried = False


def _triton_ops() -> Optional[Any]:
    """vllm_lite.lora.triton_ops, or None where Triton (or the module) is missing."""
    global _triton, _triton_tried
    if not _triton_tried:
        _triton_tried = True
        try:
            from vllm_lite.lora import triton_ops

            _triton = triton_ops
        except Exception:  # noqa: BLE001 -- no triton, no CUDA build, or the kernels not written yet
            _triton = None
    return _triton


def _pick(name: str, x: torch.Tensor) -> Callable[..., Any]:
    if x.is_cuda:
        mod = _triton_ops()
        if mod is not None and hasattr(mod, name):
            return getattr(mod, name)
    return getattr(torch_ops, name)


def set_step_slots(token_slots: Optional[torch.Tensor]) -> None:
    """This step's per-token slots, grouped once for every layer's calls (by the ops that will run them)."""
    mod = _triton_ops() if token_slots is None or token_slots.is_cuda else None
    triton_runs = mod is not None and hasattr(mod, "set_step_slots")
    torch_ops.set_step_slots(None if triton_runs and token_slots is not None else token_slots)
    if triton_runs:
        mod.set_step_slots(token_slots)


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    return _pick("lora_shrink", x)(x, lora_a, token_slots)


def lora_expand(
    y: torch.Tensor, buf: torch.Tensor, lora_b: torch.Tensor, token_slots: torch.Tensor, out_offset: int = 0
) -> None:
    _pick("lora_expand", y)(y, buf, lora_b, token_slots, out_offset)


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: list[torch.Tensor],
    out_offsets: list[int],
    token_slots: torch.Tensor,
    lora_bt: Optional[torch.Tensor] = None,
) -> None:
    """In place: y[t, off_i : off_i + out_i] += B_i[slot[t]] @ A_i[slot[t]] @ x[t] per sub-projection i.

    lora_a [S, n_sub * r, in] (sub i's A in rows i*r ... (i+1)*r), lora_b[i] [S, out_i, r]; slot -1: untouched.
    lora_bt [S, r, N]: the same B's transposed into y's columns, which CPU layers keep for csrc's kernel.
    """
    if lora_bt is not None:  # kept by CPU layers only: csrc's kernel or segments (looked up per call: --ops swaps it)
        torch_ops.add_lora(y, x, lora_a, lora_b, out_offsets, token_slots, lora_bt=lora_bt)
        return
    mod = _triton_ops() if x.is_cuda else None
    if mod is None or not hasattr(mod, "lora_shrink"):
        torch_ops.add_lora(y, x, lora_a, lora_b, out_offsets, token_slots)
        return
    add_lora_triton(mod, y, x, lora_a, lora_b, out_offsets, token_slots)


def add_lora_triton(
    mod: Any,
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: list[torch.Tensor],
    out_offsets: list[int],
    token_slots: torch.Tensor,
) -> None:
    """add_lora through the Triton kernels of ``mod`` (triton_ops). A BGMV step whose subs sit side by side (every
    decode step of a Llama-family layer) takes ``add_lora_bgmv``: up to FUSED_MAX_TOKENS tokens one fused kernel
    (each program its token's shrink, then its output tile of every sub), above that a shrink storing split-K
    partial sums and one expand for every sub that sums them; a captured CUDA graph holds 1 or 2 kernels per
    projection and no memset.
    Otherwise one shrink for every sub-projection (into a zeroed buffer), then one expand for all the subs when they
    sit side by side and BGMV runs (``lora_expand_subs``), else one per sub reading its columns of the shrink's
    buffer as a strided view (the kernels take strides): no copies."""
    bgmv = getattr(mod, "add_lora_bgmv", None)
    if bgmv is not None and bgmv(y, x, lora_a, lora_b, out_offsets, token_slots):
        return
    buf = mod.lora_shrink(x, lora_a, token_slots)
    r = lora_a.shape[1] // len(lora_b)
    adjacent = all(out_offsets[i] + lora_b[i].shape[1] == out_offsets[i + 1] for i in range(len(lora_b) - 1))
    expand_subs = getattr(mod, "lora_expand_subs", None)
    if adjacent and expand_subs is not None and expand_subs(y, buf, lora_b, token_slots, out_offsets[0]):
        return  # every sub in one launch (q|k|v, gate|up)
    for i, (b, off) in enumerate(zip(lora_b, out_offsets)):
        part = buf if len(lora_b) == 1 else buf[:, i * r : (i + 1) * r]
        mod.lora_expand(y, part, b, token_slots, off)
