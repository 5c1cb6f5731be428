"""Float64 oracles and format packers for the LoRA gather-matmul and int4 (AWQ/GPTQ) kernels.

Written from the formats' published descriptions, independently of the kernels, so a kernel and its
oracle do not share a mistake:

- LoRA (punica's SGMV/BGMV contract): each token t with slot s = token_slots[t] >= 0 gets
  shrink[t] = x[t] @ A[s]^T and y[t, off:off+out] += shrink[t] @ B[s]^T; slot -1 means no adapter.
- AWQ GEMM packing (AutoAWQ ``WQLinear_GEMM``): qweight [K, N/8] int32 packs 8 output columns per
  int32 along N; nibble i (bits 4i..4i+3) of packed column c holds column 8c + AWQ_ORDER[i] with
  AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]. qzeros [K/G, N/8] packs zeros the same way; scales [K/G, N].
  w[k, n] = (q[k, n] - z[k // G, n]) * s[k // G, n].
- GPTQ (``checkpoint_format: gptq``): qweight [K / (32/bits), N] packs consecutive input rows
  sequentially (nibble i of row r holds k = r * 32/bits + i); qzeros [groups, N / (32/bits)] packs
  output columns sequentially and stores zero - 1 (wrapped to ``bits``), so the reader adds 1 back;
  ``gptq_v2`` stores the zero itself. w[k, n] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n]; without
  desc_act g_idx[k] = k // G, with desc_act it is the group of k's position in the activation order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ int32 holds column AWQ_ORDER[i] of its 8


def lora_shrink_ref(x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """[T, R] float64: x[t] @ lora_a[slot]^T per token, zero rows for slot -1 (or a slot past the table)."""
    slots = token_slots.long().cpu()
    x64, a64 = x.double().cpu(), lora_a.double().cpu()
    out = torch.zeros(x.shape[0], lora_a.shape[1], dtype=torch.float64)
    for s in range(lora_a.shape[0]):
        rows = slots == s
        out[rows] = x64[rows] @ a64[s].T
    return out


def lora_expand_ref(
    y: torch.Tensor, buf: torch.Tensor, lora_b: torch.Tensor, token_slots: torch.Tensor, out_offset: int = 0
) -> torch.Tensor:
    """y (float64 copy) with buf[t] @ lora_b[slot]^T added to columns [off, off + out) of adapter rows."""
    slots = token_slots.long().cpu()
    out = y.double().cpu().clone()
    buf64, b64 = buf.double().cpu(), lora_b.double().cpu()
    cols = slice(out_offset, out_offset + lora_b.shape[1])
    for s in range(lora_b.shape[0]):
        rows = slots == s
        out[rows, cols] += buf64[rows] @ b64[s].T
    return out


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words held in int64 -> the int32 with the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _nibble(words: torch.Tensor, i: int, bits: int) -> torch.Tensor:
    return (words.long() >> (bits * i)) & ((1 << bits) - 1)


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """[R, N] ints in [0, 16) -> [R, N/8] int32 in AutoAWQ's interleaved nibble order."""
    v = values.long().view(values.shape[0], -1, 8)
    words = torch.zeros(v.shape[:2], dtype=torch.int64)
    for i, col in enumerate(AWQ_ORDER):
        words |= v[:, :, col] << (4 * i)
    return _to_int32(words)


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """[R, N/8] int32 -> [R, N] int64, undoing AWQ_ORDER."""
    out = torch.empty(packed.shape[0], packed.shape[1], 8, dtype=torch.int64)
    for i, col in enumerate(AWQ_ORDER):
        out[:, :, col] = _nibble(packed, i, 4)
    return out.view(packed.shape[0], -1)


def pack_gptq_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """[K, N] ints -> [K / (32/bits), N] int32: consecutive rows packed low bits first (GPTQ qweight)."""
    per = 32 // bits
    v = values.long().view(-1, per, values.shape[1])
    words = torch.zeros(v.shape[0], v.shape[2], dtype=torch.int64)
    for i in range(per):
        words |= v[:, i, :] << (bits * i)
    return _to_int32(words)


def pack_gptq_cols(values: torch.Tensor, bits: int) -> torch.Tensor:
    """[G, N] ints -> [G, N / (32/bits)] int32: consecutive columns packed low bits first (GPTQ qzeros)."""
    per = 32 // bits
    v = values.long().view(values.shape[0], -1, per)
    words = torch.zeros(v.shape[:2], dtype=torch.int64)
    for i in range(per):
        words |= v[:, :, i] << (bits * i)
    return _to_int32(words)


def dequantize_awq_ref(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int):
    """[K, N] in scales' dtype: (q - z) * s rounded once, as a dequantizer in that dtype gives it."""
    q = unpack_awq(qweight.cpu())
    z = unpack_awq(qzeros.cpu()).repeat_interleave(group_size, dim=0)
    s = scales.cpu().double().repeat_interleave(group_size, dim=0)
    return ((q - z).double() * s).to(scales.dtype)


def dequantize_gptq_ref(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor,
    bits: int = 4,
    zero_offset: int = 1,
) -> torch.Tensor:
    """[K, N] in scales' dtype; zero_offset 1 for ``checkpoint_format: gptq``, 0 for ``gptq_v2``."""
    per = 32 // bits
    qw, qz = qweight.cpu(), qzeros.cpu()
    q = torch.stack([_nibble(qw, i, bits) for i in range(per)], dim=1).view(-1, qw.shape[1])
    z = torch.stack([_nibble(qz, i, bits) for i in range(per)], dim=2).view(qz.shape[0], -1) + zero_offset
    g = g_idx.long().cpu()
    return ((q - z[g]).double() * scales.cpu().double()[g]).to(scales.dtype)


@dataclass
class Int4Case:
    """A random quantized weight in one format, its integer truth, and an input batch."""

    x: torch.Tensor  # [M, K]
    qweight: torch.Tensor
    qzeros: torch.Tensor
    scales: torch.Tensor
    group_size: int
    weight: torch.Tensor  # [K, N] float64: the truth the packed tensors encode, rounded to scales' dtype
    g_idx: Optional[torch.Tensor] = None  # GPTQ only
    bits: int = 4


def random_awq_case(m: int, k: int, n: int, group_size: int, dtype: torch.dtype, seed: int = 0) -> Int4Case:
    """AWQ-packed random weights (integers drawn first, so the truth does not depend on any unpacker)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (k, n), generator=g)
    z = torch.randint(0, 16, (k // group_size, n), generator=g)
    s = (torch.rand(k // group_size, n, generator=g) * 0.02 + 0.005).to(dtype)
    weight = (q - z.repeat_interleave(group_size, 0)).double() * s.double().repeat_interleave(group_size, 0)
    x = torch.randn(m, k, generator=g).to(dtype)
    return Int4Case(x, pack_awq(q), pack_awq(z), s, group_size, weight.to(dtype).double())


def act_order_g_idx(k: int, group_size: int, generator: torch.Generator) -> torch.Tensor:
    """GPTQ desc_act's group map: rows quantized in a permuted order, groups cut along that order."""
    perm = torch.randperm(k, generator=generator)
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[perm] = (torch.arange(k) // group_size).to(torch.int32)
    return g_idx


def random_gptq_case(
    m: int,
    k: int,
    n: int,
    group_size: int,
    dtype: torch.dtype,
    desc_act: bool = False,
    bits: int = 4,
    zero_offset: int = 1,
    seed: int = 0,
) -> Int4Case:
    """GPTQ-packed random weights; zeros avoid 0 in the classic format (stored zero - 1 must not wrap)."""
    g = torch.Generator().manual_seed(seed)
    top = 1 << bits
    groups = k // group_size
    q = torch.randint(0, top, (k, n), generator=g)
    z = torch.randint(zero_offset, top, (groups, n), generator=g)
    s = (torch.rand(groups, n, generator=g) * 0.02 + 0.005).to(dtype)
    g_idx = act_order_g_idx(k, group_size, g) if desc_act else (torch.arange(k) // group_size).to(torch.int32)
    gi = g_idx.long()
    weight = (q - z[gi]).double() * s.double()[gi]
    x = torch.randn(m, k, generator=g).to(dtype)
    return Int4Case(
        x,
        pack_gptq_rows(q, bits),
        pack_gptq_cols(z - zero_offset, bits),
        s,
        group_size,
        weight.to(dtype).double(),
        g_idx,
        bits,
    )
