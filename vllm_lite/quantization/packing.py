"""4-bit packing of AWQ (AutoAWQ GEMM) and GPTQ checkpoints, and their reference dequantization.

The layouts, as the published tools write them (int32 words, eight 4-bit values each, low nibble first):

* AWQ GEMM: ``qweight`` [K, N/8] and ``qzeros`` [K/G, N/8] are packed along N, with AutoAWQ's
  interleaved order: nibble i of a word holds column ``8*c + AWQ_ORDER[i]``. ``scales`` [K/G, N].
  w[k, n] = (q[k, n] - z[k // G, n]) * s[k // G, n].
* GPTQ: ``qweight`` [K/8, N] is packed along K in order (nibble j of row r holds input row 8*r + j);
  ``qzeros`` [n_groups, N/8] is packed along N in order; ``scales`` [n_groups, N]; ``g_idx`` [K] is
  each input row's group (k // G without act-order, a permutation-derived map with desc_act).
  The classic format (``checkpoint_format: gptq``) stores zero - 1; ``gptq_v2`` stores the zero.
  w[k, n] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n].

These functions are the reference every fast path (the CPU dequantize-into-buffer linear, the
Triton kernels) is tested against bit for bit. They compute in float32, where the result is exact
for half-precision scales: |q - z| <= 16 needs 5 bits and a float16 scale 11, within float32's 24.
"""

from __future__ import annotations

from typing import Optional

import torch

BITS = 4
PACK_FACTOR = 32 // BITS  # 4-bit values per int32 word
# AutoAWQ's GEMM order: nibble i of a word holds column AWQ_ORDER[i] of its 8 columns ...
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# ... so column j of the 8 sits in nibble AWQ_REVERSE_ORDER[j].
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
SEQUENTIAL_ORDER = tuple(range(PACK_FACTOR))
# How much a stored GPTQ zero is below the real one, per checkpoint_format.
GPTQ_ZERO_OFFSET = {"gptq": 1, "gptq_v2": 0}


def _check_int32(name: str, t: torch.Tensor, dims: int = 2) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != dims:
        got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise TypeError(f"{name} must be a {dims}-D int32 tensor; got {got}.")


def _shifts(order: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Bit shift of each logical position's nibble: position j lives in nibble `inverse(order)[j]`."""
    nibble_of = [0] * PACK_FACTOR
    for nibble, pos in enumerate(order):
        nibble_of[pos] = nibble
    return torch.tensor(nibble_of, dtype=torch.int32, device=device) * BITS


def unpack_cols(packed: torch.Tensor, order: tuple[int, ...] = SEQUENTIAL_ORDER) -> torch.Tensor:
    """[R, C] int32 packed along columns -> [R, 8*C] int32 values in [0, 15]."""
    r, c = packed.shape
    vals = (packed.unsqueeze(-1) >> _shifts(order, packed.device)) & 0xF
    return vals.reshape(r, c * PACK_FACTOR)


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """[R, C] int32 packed along rows (GPTQ's qweight) -> [8*R, C] int32 values in [0, 15]."""
    r, c = packed.shape
    vals = (packed.unsqueeze(1) >> _shifts(SEQUENTIAL_ORDER, packed.device).view(1, -1, 1)) & 0xF
    return vals.reshape(r * PACK_FACTOR, c)


def _to_int32_words(words: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2**32) -> the int32 with the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _check_nibbles(values: torch.Tensor) -> torch.Tensor:
    if values.dtype.is_floating_point or values.dtype == torch.bool:
        raise TypeError(f"values to pack must be an integer tensor; got {values.dtype}.")
    v = values.to(torch.int64)
    if v.numel() and (int(v.min()) < 0 or int(v.max()) > 15):
        raise ValueError("4-bit values must lie in [0, 15].")
    return v


def pack_cols(values: torch.Tensor, order: tuple[int, ...] = SEQUENTIAL_ORDER) -> torch.Tensor:
    """[R, 8*C] values in [0, 15] -> [R, C] int32 words, nibble i holding column order[i] of each 8."""
    v = _check_nibbles(values)
    r, n = v.shape
    if n % PACK_FACTOR:
        raise ValueError(f"columns to pack ({n}) must be a multiple of {PACK_FACTOR}.")
    v = v.view(r, n // PACK_FACTOR, PACK_FACTOR)[..., list(order)]
    shifts = torch.arange(PACK_FACTOR, dtype=torch.int64, device=v.device) * BITS
    return _to_int32_words((v << shifts).sum(-1))


def pack_rows(values: torch.Tensor) -> torch.Tensor:
    """[8*R, C] values in [0, 15] -> [R, C] int32 words, nibble j holding row 8*r + j (GPTQ's qweight)."""
    v = _check_nibbles(values)
    k, c = v.shape
    if k % PACK_FACTOR:
        raise ValueError(f"rows to pack ({k}) must be a multiple of {PACK_FACTOR}.")
    shifts = (torch.arange(PACK_FACTOR, dtype=torch.int64, device=v.device) * BITS).view(1, -1, 1)
    return _to_int32_words((v.view(k // PACK_FACTOR, PACK_FACTOR, c) << shifts).sum(1))


def _expand_groups(t: torch.Tensor, group_size: int, k: int) -> torch.Tensor:
    if group_size == -1:
        group_size = k
    if group_size <= 0 or k % group_size:
        raise ValueError(f"group_size={group_size} must divide the input size {k} (or be -1).")
    if t.shape[0] != k // group_size:
        raise ValueError(f"expected {k // group_size} groups of {group_size} rows; got {t.shape[0]}.")
    return t.repeat_interleave(group_size, dim=0)


def dequantize_awq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """AutoAWQ GEMM tensors -> the float weight [K, N] (input rows, output columns), in `dtype`.

    qweight [K, N/8] int32, qzeros [K/G, N/8] int32, scales [K/G, N]; group_size -1 is one group."""
    _check_int32("qweight", qweight)
    _check_int32("qzeros", qzeros)
    k, n = qweight.shape[0], qweight.shape[1] * PACK_FACTOR
    if scales.dim() != 2 or scales.shape[1] != n or qzeros.shape[1] * PACK_FACTOR != n:
        raise ValueError(
            f"AWQ shapes disagree: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, "
            f"scales {tuple(scales.shape)}."
        )
    q = unpack_cols(qweight, AWQ_ORDER)
    z = _expand_groups(unpack_cols(qzeros, AWQ_ORDER), group_size, k)
    s = _expand_groups(scales.float(), group_size, k)
    return ((q - z).float() * s).to(dtype)


def dequantize_gptq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: Optional[torch.Tensor],
    checkpoint_format: str = "gptq",
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """GPTQ tensors -> the float weight [K, N] (input rows, output columns), in `dtype`.

    qweight [K/8, N] int32, qzeros [n_groups, N/8] int32, scales [n_groups, N], g_idx [K] (int32 or
    int64; None means k // (K / n_groups)). checkpoint_format "gptq" stores zero - 1, "gptq_v2" the zero."""
    _check_int32("qweight", qweight)
    _check_int32("qzeros", qzeros)
    if checkpoint_format not in GPTQ_ZERO_OFFSET:
        raise ValueError(f"checkpoint_format {checkpoint_format!r} is not one of {sorted(GPTQ_ZERO_OFFSET)}.")
    k, n = qweight.shape[0] * PACK_FACTOR, qweight.shape[1]
    groups = scales.shape[0]
    if scales.dim() != 2 or scales.shape[1] != n or qzeros.shape != (groups, n // PACK_FACTOR):
        raise ValueError(
            f"GPTQ shapes disagree: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, "
            f"scales {tuple(scales.shape)}."
        )
    if g_idx is None:
        if k % groups:
            raise ValueError(f"{groups} groups do not divide the input size {k}; pass g_idx.")
        g_idx = torch.arange(k, device=qweight.device) // (k // groups)
    if g_idx.shape != (k,) or g_idx.dtype.is_floating_point:
        raise ValueError(f"g_idx must be an integer tensor of shape ({k},); got {g_idx.dtype} {tuple(g_idx.shape)}.")
    g = g_idx.long()
    if k and (int(g.min()) < 0 or int(g.max()) >= groups):
        raise ValueError(f"g_idx values must lie in [0, {groups}).")
    q = unpack_rows(qweight)
    z = unpack_cols(qzeros) + GPTQ_ZERO_OFFSET[checkpoint_format]
    return ((q - z.index_select(0, g)).float() * scales.float().index_select(0, g)).to(dtype)
