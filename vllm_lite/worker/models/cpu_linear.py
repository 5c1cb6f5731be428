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

Before the slices, float32 forwards of KERNEL_MIN_ROWS..KERNEL_MAX_ROWS rows without a bias go through csrc's
`f32_linear_kblocked` (csrc/f32_linear_cpu.cpp) where it is built: it sums each output as MKL's sgemm does on
Zen 4 (one FMA chain per block of kc inputs, the blocks' partial sums added in order; kc = K up to 192, K/2
below 384, else 192), so its result equals F.linear's bit for bit, at ~185 GFLOP/s on 2 Zen 4 cores where MKL
ran the decode shapes of small models at 35-130 (LM head [64, 256] x [256, 8000]: 2.77 -> 1.39 ms; gate_up
[64, 768] x [768, 6144]: 6.3 -> 3.2 ms; PROFILE.md, "MoE on CPU, third pass"). Nothing is assumed: the first
input of each (K, N, rows, threads) is run both ways over the candidate kc values; the first that equals F.linear
bit for bit is kept for that case, and where none does (another BLAS or CPU; MKL's path for 8-output weights,
e.g. a MoE router) the case stays on the slices / F.linear for good, logged once per shape.
VLLM_LITE_CPU_LINEAR_KBLOCKED=0 turns it off.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
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

KERNEL_MIN_ROWS = 8  # MKL sums 1-4 rows in another order, 5-7 partly (measured on Zen 4)
KERNEL_MAX_ROWS = 512  # measured 1.5-2.6x MKL at 8-256 rows; ~1.0x at 1309-2048 (prefill chunks keep MKL)
KERNEL_MIN_OUT = 16  # MKL's 8-output products (a MoE router) sum in another order

_lock = threading.Lock()
_kc: dict[tuple[int, int, int, int], int] = {}  # case -> the kc that equals F.linear there; 0: none does
_kc_known: dict[int, int] = {}  # K -> the kc found for it last: the first candidate for its next case
_kernel_warned: set[tuple[int, int]] = set()
_kernel_on: Optional[bool] = None  # VLLM_LITE_CPU_LINEAR_KBLOCKED, read once
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


def kc_candidates(k: int) -> list[int]:
    """K-block sizes to try for an input width k, the one measured for MKL on Zen 4 first."""
    rule = k if k <= 192 else (k // 2 if k < 384 else 192)
    out: list[int] = []
    for kc in (rule, k, 192, k // 2, 128, 256, 96, 64):
        if 0 < kc <= k and kc not in out:
            out.append(kc)
    return out


@functools.cache
def _kernel_op() -> Optional[Callable[..., torch.Tensor]]:
    """csrc's f32_linear_kblocked where it is built and loaded here, else None."""
    from vllm_lite.worker.attention.cpu_kernels import cpu_op

    available = cpu_op("f32_linear_kblocked_available")
    return cpu_op("f32_linear_kblocked") if available is not None and available() else None


def _kernel_enabled() -> bool:
    global _kernel_on
    if _kernel_on is None:
        _kernel_on = bool(envs.VLLM_LITE_CPU_LINEAR_KBLOCKED)
    return _kernel_on


def kernel_applies(rows: int, weight: torch.Tensor, x_dtype: torch.dtype, bias: Optional[torch.Tensor]) -> bool:
    """Which (rows, weight) the k-blocked kernel is tried for (each case is still checked once)."""
    return (
        bias is None
        and weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and x_dtype == torch.float32
        and weight.dim() == 2
        and weight.is_contiguous()
        and weight.shape[0] >= KERNEL_MIN_OUT
        and weight.shape[1] > 0
        and KERNEL_MIN_ROWS <= rows <= KERNEL_MAX_ROWS
        and _kernel_enabled()
        and _kernel_op() is not None
    )


def _kernel_case(rows: int, weight: torch.Tensor) -> tuple[int, int, int, int]:
    return (weight.shape[1], weight.shape[0], rows, torch.get_num_threads())


def _kernel_linear(x2: torch.Tensor, weight: torch.Tensor) -> Optional[torch.Tensor]:
    """x2 @ weight.T by the kernel where its case is known to equal F.linear; F.linear's result on a case's first
    input (the check); None where the case is known not to (the caller's other paths)."""
    case = _kernel_case(x2.shape[0], weight)
    kc = _kc.get(case)
    op = _kernel_op()
    if kc is not None:
        return op(x2, weight, kc) if kc else None
    want = F.linear(x2, weight)
    # The check also runs on a seeded random input of the same shape: a degenerate first input (zeros, repeated
    # rows) sums the same in any order and would let a wrong kc through.
    probe = torch.randn(x2.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float32)
    want_probe = F.linear(probe, weight)
    k = case[0]
    first = _kc_known.get(k)
    cands = kc_candidates(k)
    if first is not None:
        cands = [first] + [c for c in cands if c != first]
    found = 0
    for c in cands:
        if torch.equal(op(probe, weight, c), want_probe) and torch.equal(op(x2, weight, c), want):
            found = c
            break
    with _lock:
        _kc[case] = found
        if found:
            _kc_known[k] = found
        elif (k, case[1]) not in _kernel_warned:
            _kernel_warned.add((k, case[1]))
            logger.info(
                "float32 linear %dx%d at %d rows: f32_linear_kblocked sums differently from F.linear here "
                "(kc tried: %s); keeping F.linear",
                k,
                case[1],
                case[2],
                cands,
            )
    return want


def blocked_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """F.linear over BLOCK-output slices of the weight (views, no copy), concatenated."""
    weights = weight.split(BLOCK, 0)
    biases = bias.split(BLOCK, 0) if bias is not None else [None] * len(weights)
    return torch.cat([F.linear(x, w, b) for w, b in zip(weights, biases)], dim=-1)


def plan(rows: int, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> str:
    """What `linear` runs for this case: "kernel", "blocks", "f_linear", or "unchecked" (not yet checked)."""
    if kernel_applies(rows, weight, weight.dtype, bias):
        kc = _kc.get(_kernel_case(rows, weight))
        if kc is None:
            return "unchecked"
        if kc:
            return "kernel"
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
    if torch.compiler.is_compiling():  # a traced graph: the per-case checks would guard it on every row count
        return F.linear(x, weight, bias)
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if not grad and kernel_applies(rows, weight, x.dtype, bias):
        x2 = x.reshape(rows, x.shape[-1])
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        y = _kernel_linear(x2, weight)
        if y is not None:
            return y.view(*x.shape[:-1], weight.shape[0])
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
