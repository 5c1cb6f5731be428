"""oneDNN weight prepacking for bfloat16 linear layers on CPU.

`F.linear` on CPU re-lays-out the weight for oneDNN on every call; for
decode-sized batches that dominates. Packing each weight once after loading
gives bit-identical bfloat16 results and measured 1.2-3x faster matmuls here
for 1-64 rows (e.g. 768x3072 at 16 rows: 113 -> 183 GFLOP/s). float32 is left
alone: its packed kernel rounds differently, and float32 is our exactness path.

Whether oneDNN's bf16 reorder runs on this CPU is the platform module's probe (AVX2-only CPUs
refuse it at run time although torch reports oneDNN available); where it does not, nothing is
packed, `linear` stays plain F.linear, and one log line says so.

Forwards of up to SMALL_M_MAX rows (decode of a few requests, speculative verification) go through
vllm-lite's own AVX512-BF16 kernel instead (csrc/bf16_small_m.cpp) where it is built: it streams a
second copy of each weight laid out [N/4, K/32, 4, 32] and measured 1.1-1.6x oneDNN's packed GEMM at
1-12 rows and ~1.0x at 13-16 on a 2-core Zen 4 (`benchmarks/linear_small_m.py`; PROFILE.md, "Zen 4").
Its sums run in another order, so an output may differ from oneDNN's in the last bf16 bit; a row's
result does not depend on the other rows or the thread count. float32 never takes it. The copy costs
the weights' size again in memory; $VLLM_LITE_CPU_BF16_SMALL_M=0 turns it off.

Forwards of SMALL_M_MAX + 1 to VNNI_MAX rows (a decode batch of 13-64 requests) take the same file's
broadcast GEMM (`bf16_linear_vnni`) over a third copy laid out [N/32, K/2, 32, 2]: 1.17-1.22x oneDNN's
packed GEMM at 32 rows on 1 and 2 Zen 4 cores, 1.36x at 16, 1.06-1.08x at 48-64 (the bench model's 49
weights, PROFILE.md "offline batch 32"). Same rounding rule (one float32 sum in K order, rounded once);
larger batches (prefill chunks) stay on oneDNN, which reaches ~85% of the bf16 peak there. Another copy of
the weights in memory; the same switch turns it off.

A gated SiLU MLP's gate_up weight (LlamaMLP and its kin: a MergedLinear of two equal halves feeding SiluAndMul)
gets both decode copies with its rows interleaved by blocks of 16 (`interleave_gate_up`: gate rows 16b.., then up
rows 16b.., zero rows past d) and `gate_up_interleaved = d` on the module: the C++ decoder stack
(cpu_decoder_stack.py) then runs gate_up and SiLU-and-mul as one kernel call at decode row counts
(`bf16_gate_up_small_m` / `bf16_gate_up_vnni` with silu_and_mul), without writing and reading back the [rows, 2d]
gate_up output, with the same bits as the plain kernel then fused_silu_and_mul. `linear` below runs the same
kernels without the SiLU (both halves where the plain kernel puts them, the same bits), so every other caller
sees an ordinary gate_up. oneDNN's copy and the module's weight are not interleaved.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn

from vllm_lite import envs, platform
from vllm_lite.worker.models import cpu_linear
from vllm_lite.worker.models.cpu_huge_pages import huge_page_contiguous

logger = logging.getLogger(__name__)

_ATTR = "packed_weight"
_SMALL_ATTR = "small_m_weight"  # [N/4, K/32, 4, 32] copy for bf16_linear_small_m
# rows: the kernel measured 1.1-1.6x oneDNN at 1-12 rows, 1.00-1.05x at 13-16 (benchmarks/linear_small_m.py,
# PROFILE.md); the kernel itself takes up to bf16_small_m_max_rows() = 16.
SMALL_M_MAX = 12
_GROUP, _CHUNK = 4, 32  # the kernel's layout: 4 output rows interleaved in 32-wide slices of K
_VNNI_ATTR = "vnni_weight"  # [N/32, K/2, 32, 2] copy for bf16_linear_vnni
VNNI_MAX = 64  # rows (past SMALL_M_MAX) for the VNNI kernel: measured 1.06-1.36x oneDNN at 16-64 rows
_VNNI_BLOCK = 32
_GATE_UP_ATTR = "gate_up_interleaved"  # d, where this gate_up's two copies above are interleave_gate_up's rows
GATE_UP_BLOCK = 16  # the gate_up ops' interleave (csrc/bf16_small_m.cpp, kGateUpBlock)


def small_m_kernel_available() -> bool:
    """vllm-lite's AVX512-BF16 decode kernel is built and loaded here (and not turned off)."""
    if not envs.VLLM_LITE_CPU_BF16_SMALL_M:
        return False
    from vllm_lite.worker.attention.cpu_kernels import load_cpu_ops

    if not load_cpu_ops():
        return False
    fn = getattr(torch.ops.vllm_lite, "bf16_small_m_available", None)
    return bool(fn is not None and fn())


def _small_m_op(x: torch.Tensor, blocked: torch.Tensor, n: int, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return torch.ops.vllm_lite.bf16_linear_small_m(x, blocked, n, bias)


def block_weight(w: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N/4, K/32, 4, 32]: each group of 4 output rows' 32-wide K slices, one after another (in huge pages
    where the host has them: the kernel streams this copy from DRAM every decode step; cpu_huge_pages.py)."""
    n, k = w.shape
    return huge_page_contiguous(w.detach().reshape(n // _GROUP, _GROUP, k // _CHUNK, _CHUNK).permute(0, 2, 1, 3))


def vnni_kernel_available() -> bool:
    """The 13-64 row kernel (bf16_linear_vnni) is built here (with the small-m kernel, same switch)."""
    return small_m_kernel_available() and hasattr(torch.ops.vllm_lite, "bf16_linear_vnni")


def _vnni_op(x: torch.Tensor, wv: torch.Tensor, n: int, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return torch.ops.vllm_lite.bf16_linear_vnni(x, wv, n, bias)


def vnni_weight(w: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N/32, K/2, 32, 2]: per block of 32 outputs, each pair of K for the 32 outputs in turn (in huge pages
    where the host has them, as block_weight)."""
    n, k = w.shape
    return huge_page_contiguous(w.detach().reshape(n // _VNNI_BLOCK, _VNNI_BLOCK, k // 2, 2).permute(0, 2, 1, 3))


def interleave_gate_up(w: torch.Tensor, d: int) -> torch.Tensor:
    """[2d, K] (gate rows, then up rows) -> [2 * d_pad, K], d_pad = d rounded up to GATE_UP_BLOCK: for each block b,
    gate rows [16b, 16b + 16) then up rows [16b, 16b + 16), rows past d zero. The order the gate_up ops read, so
    each of their 32-output blocks holds gate j and up d + j together."""
    k = w.shape[1]
    d_pad = -(-d // GATE_UP_BLOCK) * GATE_UP_BLOCK
    halves = torch.zeros(2, d_pad, k, dtype=w.dtype)
    halves[:, :d] = w.detach().reshape(2, d, k)
    return halves.reshape(2, d_pad // GATE_UP_BLOCK, GATE_UP_BLOCK, k).transpose(0, 1).reshape(2 * d_pad, k)


def _gate_up_small_m_op(
    x: torch.Tensor, blocked: torch.Tensor, d: int, bias: Optional[torch.Tensor], silu_and_mul: bool
) -> torch.Tensor:
    return torch.ops.vllm_lite.bf16_gate_up_small_m(x, blocked, d, bias, silu_and_mul)


def _gate_up_vnni_op(
    x: torch.Tensor, wv: torch.Tensor, d: int, bias: Optional[torch.Tensor], silu_and_mul: bool
) -> torch.Tensor:
    return torch.ops.vllm_lite.bf16_gate_up_vnni(x, wv, d, bias, silu_and_mul)


# The two classes silu_gate_ups looks for, by name: layers and parallel_linear import this module, so importing
# them here would close an import cycle (tests/test_import_graph.py).
_SILU_AND_MUL = ("vllm_lite.worker.models.layers", "SiluAndMul")
_MERGED_LINEAR = ("vllm_lite.worker.models.parallel_linear", "MergedLinear")


def _is_class(cls: type, where: tuple[str, str]) -> bool:
    return (cls.__module__, cls.__qualname__) == where


def silu_gate_ups(model: nn.Module) -> dict[int, int]:
    """id(gate_up module) -> d for every gated SiLU MLP in `model` (a MergedLinear of two halves of d rows, gate
    then up, whose output goes to a SiluAndMul): the gate_up weights whose decode copies prepacking interleaves."""
    out = {}
    for m in model.modules():
        gu, act = m._modules.get("gate_up_proj"), m._modules.get("act")
        if not _is_class(type(act), _SILU_AND_MUL) or not any(_is_class(c, _MERGED_LINEAR) for c in type(gu).__mro__):
            continue
        if set(gu.shards) != {0, 1}:
            continue
        d = gu.shards[0][1]
        if gu.shards[0] == (0, d) and gu.shards[1] == (d, d) and gu.weight.shape[0] == 2 * d > 0:
            out[id(gu)] = d
    return out


def maybe_prepack(model: nn.Module, device: torch.device, dtype: torch.dtype, batch_hint: int = 64) -> int:
    """Prepack a freshly loaded model where it applies (bf16 on CPU, $VLLM_LITE_PREPACK on); returns how many."""
    if device.type != "cpu" or dtype != torch.bfloat16 or not envs.VLLM_LITE_PREPACK:
        return 0
    return prepack_linear_weights(model, batch_hint)


def prepack_linear_weights(model: nn.Module, batch_hint: int = 64, fuse_gate_up: bool = True) -> int:
    """Attach a packed copy of every bfloat16 CPU weight used as a matmul; returns how many.

    `fuse_gate_up` False keeps gated SiLU MLPs' gate_up copies in the plain layout (no fused SiLU: the path
    before it, for tests and A/B timing).

    The original weight of a parallel linear layer is released (it is never read
    again); the LM head's is kept, as a tied head shares it with the embedding.
    Where oneDNN cannot pack bf16 on this CPU, packs nothing and logs that once.
    """
    support = platform.onednn_bf16_prepack()
    if not support.ok:
        logger.info("weight prepacking unavailable (%s); using plain F.linear", support.reason)
        return 0
    head = getattr(model, "lm_head", None)
    small_m = small_m_kernel_available()
    vnni = vnni_kernel_available()  # implies small_m
    fused = fuse_gate_up and small_m and hasattr(torch.ops.vllm_lite, "bf16_gate_up_vnni")
    gate_ups = silu_gate_ups(model) if fused else {}
    n = 0
    for module in model.modules():
        w = getattr(module, "weight", None)
        if not isinstance(w, torch.Tensor) or w.dim() != 2 or w.dtype != torch.bfloat16 or w.device.type != "cpu":
            continue
        # Only float layers whose forward goes through `linear()` below, and the LM head.
        is_linear = getattr(module, "supports_prepack", False) and getattr(module, "quant_method", None) is None
        if not (is_linear or module is head):
            continue
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), batch_hint)
        except RuntimeError as e:  # the probe passed but this shape did not: keep the rest plain
            logger.warning("weight prepacking stopped after %d weights (%s); the rest use plain F.linear", n, e)
            break
        setattr(module, _ATTR, packed)
        d = gate_ups.get(id(module))
        copy_of = w if d is None else interleave_gate_up(w, d)  # the same kernels' rules on the plain shape
        if small_m and w.shape[0] % _GROUP == 0 and w.shape[1] % _CHUNK == 0:
            setattr(module, _SMALL_ATTR, block_weight(copy_of))
        if vnni and w.shape[0] % _VNNI_BLOCK == 0 and w.shape[1] % 2 == 0:
            setattr(module, _VNNI_ATTR, vnni_weight(copy_of))
        if d is not None and (_SMALL_ATTR in module.__dict__ or _VNNI_ATTR in module.__dict__):
            setattr(module, _GATE_UP_ATTR, d)
        if is_linear:
            module.weight.data = torch.empty((0, w.shape[1]), dtype=w.dtype)
        n += 1
    if n:
        logger.info(
            "prepacked %d bfloat16 linear weights for oneDNN%s",
            n,
            f"; decode rows (<= {SMALL_M_MAX}, <= {VNNI_MAX}) use the AVX512-BF16 kernels" if small_m else "",
        )
    return n


def linear(x: torch.Tensor, module: nn.Module, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """F.linear through the packed weight when there is one; an int4 layer's own matmul when it is one."""
    method = getattr(module, "quant_method", None)
    if method is not None:
        return method.apply(module, x, bias)
    packed = getattr(module, _ATTR, None)
    if packed is None:
        return cpu_linear.linear(x, module.weight, bias)  # F.linear, faster for wide float32 CPU weights
    if x.dim() != 2:
        shape = x.shape
        return linear(x.reshape(-1, shape[-1]), module, bias).view(*shape[:-1], -1)
    if x.shape[0] <= SMALL_M_MAX and x.dtype == torch.bfloat16:
        blocked = getattr(module, _SMALL_ATTR, None)
        if blocked is not None:
            d = module.__dict__.get(_GATE_UP_ATTR)
            if d is not None:
                return _gate_up_small_m_op(x, blocked, d, bias, False)
            n_out = blocked.shape[0] * _GROUP
            return _small_m_op(x, blocked, n_out, bias)
    elif x.shape[0] <= VNNI_MAX and x.dtype == torch.bfloat16:
        wv = getattr(module, _VNNI_ATTR, None)
        if wv is not None:
            d = module.__dict__.get(_GATE_UP_ATTR)
            if d is not None:
                return _gate_up_vnni_op(x, wv, d, bias, False)
            return _vnni_op(x, wv, wv.shape[0] * _VNNI_BLOCK, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
