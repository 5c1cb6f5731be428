"""How close a bf16 linear kernel must come to exact math: shared by the CPU bf16 kernel tests."""

from __future__ import annotations

from typing import Optional

import torch


def linear_reference_and_bound(
    x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 x @ w.T (+ bias) and an error bound: one bf16 ulp of the result plus float32 summation slack."""
    ref = x.double() @ w.double().t() + (bias.double() if bias is not None else 0)
    terms = x.double().abs() @ w.double().abs().t()
    return ref, ref.abs() * 2.0**-7 + terms * 2.0**-18
