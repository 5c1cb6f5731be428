"""The LoRA shrink/expand a layer calls: the Triton kernels for CUDA tensors when they import, else torch.

Both take the same arguments (``triton_ops`` and ``torch_ops`` share one signature), so the choice is per
call, by the device of the input.
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


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    return _pick("lora_shrink", x)(x, lora_a, token_slots)


def lora_expand(
    y: torch.Tensor, buf: torch.Tensor, lora_b: torch.Tensor, token_slots: torch.Tensor, out_offset: int = 0
) -> None:
    _pick("lora_expand", y)(y, buf, lora_b, token_slots, out_offset)
