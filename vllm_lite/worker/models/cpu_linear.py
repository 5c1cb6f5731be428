"""A faster float32 linear on CPU for the wide projections (MLP gate_up, LM head) at batch >= 16.

Why: torch's CPU `F.linear` runs MKL sgemm, which on AVX2 hosts (Zen 3) multiplies a batch of rows
by a wide weight (768 -> 6144, 768 -> 32000) 1.1-1.9x slower than it multiplies the same rows by
the weight's 768-output slices one after the other (benchmarks/linear.py; benchmarks/PROFILE.md,
"float32 linear"). Each output element is then the same dot product computed by the same kernel,
so the result is bit-identical to `F.linear` -- which keeps float32 greedy tokens equal to Hugging
Face's, unlike oneDNN's packed float32 weights (faster still, but rounded differently).

The rule, from those measurements: float32 CPU weight with at least MIN_OUT_FEATURES outputs, an
input of MIN_ROWS..MAX_ROWS rows, one torch thread (with more, each slice is its own OpenMP region,
and a shared host's preempted threads make every barrier slow; not measured to win, so not used). Bit-identity is not assumed: the first input of each
(shape, rows, bias, threads) is run both ways and compared; a mismatch (another BLAS, another CPU)
keeps that case on `F.linear` for good and logs a warning. The first use of blocks per weight shape
is logged once. VLLM_LITE_CPU_LINEAR_SLICES=0 turns it off (benchmarks' A/B).
"""

from __future__ import annotations

import logging
import threading
from typing import Optional

import torch
import torch.nn.functional as F

from vllm_lite import envs

logger = logging.getLogger(__name__)

BLOCK = 768  # output features per slice: the fastest block size measured for both wide shapes
MIN_OUT_FEATURES = 4096  # gate_up (6144) and the LM head (32000) of the bench checkpoint; not qkv/o/down
MIN_ROWS = 16  # below this the slices are no faster (m = 1: 0.8-1.0x)
MAX_THREADS = 1  # measured at one torch thread (the engine core's count on 2 cores); more: unmeasured
MAX_ROWS = 128  # measured: 1.03-1.15x at 128 rows, 1.0x at 256, 0.87-1.01x at 512 (prefill chunks)

_lock = threading.Lock()
_checked: dict[tuple[int, int, int, bool, int], bool] = {}  # case -> blocks are bit-identical there
_announced: set[tuple[int, int]] = set()
_on: Optional[bool] = None  # VLLM_LITE_CPU_LINEAR_SLICES, read once


def applies(rows: int, weight: torch.Tensor, x_dtype: torch.dtype) -> bool:
    """The measured rule: which (rows, weight) the blocked product is for."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and x_dtype == torch.float32
        and weight.dim() == 2
        and weight.shape[0] >= MIN_OUT_FEATURES
        and MIN_ROWS <= rows <= MAX_ROWS
        and torch.get_num_threads() <= MAX_THREADS
    )


def blocked_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """F.linear over BLOCK-output slices of the weight (views, no copy), concatenated."""
    weights = weight.split(BLOCK, 0)
    biases = bias.split(BLOCK, 0) if bias is not None else [None] * len(weights)
    return torch.cat([F.linear(x, w, b) for w, b in zip(weights, biases)], dim=-1)


def plan(rows: int, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> str:
    """What `linear` runs for this case: "blocks", "f_linear", or "unchecked" (blocks once verified)."""
    if not applies(rows, weight, weight.dtype):
        return "f_linear"
    ok = _checked.get(_case(rows, weight, bias))
    return "unchecked" if ok is None else "blocks" if ok else "f_linear"


def _enabled() -> bool:
    global _on
    if _on is None:
        _on = bool(envs.VLLM_LITE_CPU_LINEAR_SLICES)
    return _on


def _case(rows: int, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> tuple[int, int, int, bool, int]:
    return (weight.shape[1], weight.shape[0], rows, bias is not None, torch.get_num_threads())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Same result as F.linear(x, weight, bias), bit for bit; faster where the rule applies."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if x.requires_grad or not applies(rows, weight, x.dtype) or not _enabled():
        return F.linear(x, weight, bias)
    case = _case(rows, weight, bias)
    ok = _checked.get(case)
    if ok is None:
        return _verify(case, x, weight, bias)
    if not ok:
        return F.linear(x, weight, bias)
    x2 = x.reshape(rows, x.shape[-1])
    return blocked_linear(x2, weight, bias).view(*x.shape[:-1], weight.shape[0])


def _verify(
    case: tuple[int, int, int, bool, int], x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]
) -> torch.Tensor:
    """First input of a case: run both ways, keep blocks only if bit-identical; returns F.linear's result."""
    want = F.linear(x, weight, bias)
    got = blocked_linear(x.reshape(case[2], x.shape[-1]), weight, bias).view(want.shape)
    same = torch.equal(got, want)
    with _lock:
        _checked[case] = same
        shape = (case[0], case[1])
        if same and shape not in _announced:
            _announced.add(shape)
            logger.info(
                "float32 linear %dx%d on CPU: %d-output slices for %d-%d rows (bit-identical to F.linear)",
                case[0],
                case[1],
                BLOCK,
                MIN_ROWS,
                MAX_ROWS,
            )
        elif not same:
            logger.warning(
                "float32 linear %dx%d at %d rows: sliced product differs from F.linear here; keeping F.linear",
                case[0],
                case[1],
                case[2],
            )
    return want
