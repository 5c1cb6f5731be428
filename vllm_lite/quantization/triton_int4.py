"""Int4 dequantize-and-matmul on CUDA as one Triton kernel, for AWQ (GEMM packing) and GPTQ checkpoints.

out[M, N] = x[M, K] @ W[K, N] where W is never materialised: each program owns a BLOCK_M x BLOCK_N
output tile and walks K in BLOCK_K tiles. It loads each packed int32 word of a tile once (a
[BK, BN/8] or [BK/8, BN] tile, spread to one word per weight in registers; compiled for sm_90 at
16 x 64 x 64 the AWQ kernel issues 15 async copies instead of 99 and needs 15 KB of shared memory
instead of 43 KB compared with gathering one word per weight, which ``wide_load=False`` still does
so a GPU benchmark can compare the two), unpacks the nibbles, subtracts the zero point and
multiplies by the scale of each row's group, rounds to the scales' dtype (so the tile equals the
format's reference dequantization bit for bit) and feeds ``tl.dot`` with float32 accumulation. Small M (decode) splits K over programs, adding partial sums atomically into a float32
buffer, so a batch of one still fills the GPU.

Formats (see vllm_lite/testing/lora_int4_oracle.py for the spelled-out packing):
- AWQ: qweight [K, N/8], nibble i of a word holds column AWQ_ORDER[i] = [0, 2, 4, 6, 1, 3, 5, 7][i] of
  its 8, so column j sits at shift 4 * [0, 4, 1, 5, 2, 6, 3, 7][j]; qzeros [K/G, N/8] likewise.
- GPTQ: qweight [K / (32/bits), N] packs rows sequentially; qzeros [groups, N / (32/bits)] packs
  columns sequentially and holds zero - 1 (``checkpoint_format: gptq``; ``gptq_v2`` holds the zero);
  g_idx [K] maps each input row to its group, which desc_act makes an arbitrary map.

Under the CPU interpreter (TRITON_INTERPRET=1, the tests) tiles are widened to float32 before
``tl.dot``, whose interpreted bf16 path is wrong; float32 inputs use exact ("ieee") dots everywhere.
"""

from __future__ import annotations

from typing import Optional

import torch

from vllm_lite import envs

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is absent
    HAS_TRITON = False

SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
GPTQ_BITS = (2, 4, 8)
TARGET_PROGRAMS = 264  # about two programs per SM on an H100 (132 SMs)
MAX_SPLIT_K = 16


if HAS_TRITON:

    @triton.jit
    def _int4_k_tile(
        acc, x_rows, qweight_ptr, qzeros_ptr, scales_ptr, g_idx_ptr, k0, K, N, group_size, m_ok, offs_n, n_ok, pid_n,
        word_n, shift_n, stride_xk, stride_qw, stride_qz, stride_s,
        AWQ: tl.constexpr, BITS: tl.constexpr, ZERO_OFFSET: tl.constexpr, HAS_G_IDX: tl.constexpr,
        ONE_GROUP_PER_TILE: tl.constexpr, X_F32: tl.constexpr, INTERPRET: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, WIDE_LOAD: tl.constexpr,
    ):  # fmt: skip
        """acc += x[:, k0:k0 + BLOCK_K] @ dequant(W)[k0:k0 + BLOCK_K, offs_n] (one K tile, inlined)."""
        PACK: tl.constexpr = 32 // BITS
        MASK: tl.constexpr = (1 << BITS) - 1
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        tile_ok = k_ok[:, None] & n_ok[None, :]
        a = tl.load(x_rows + offs_k[None, :] * stride_xk, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if AWQ:
            if WIDE_LOAD:
                # Each word once ([BK, BN/8], vectorisable), repeated 8 times along N in registers.
                offs_w = pid_n * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)
                words = tl.load(
                    qweight_ptr + offs_k.to(tl.int64)[:, None] * stride_qw + offs_w[None, :],
                    mask=k_ok[:, None] & (offs_w < N // 8)[None, :],
                    other=0,
                )
                words = tl.reshape(tl.broadcast_to(words[:, :, None], (BLOCK_K, BLOCK_N // 8, 8)), (BLOCK_K, BLOCK_N))
            else:
                words = tl.load(
                    qweight_ptr + offs_k.to(tl.int64)[:, None] * stride_qw + word_n[None, :], mask=tile_ok, other=0
                )
            q = (words >> shift_n[None, :]) & MASK
        else:
            if WIDE_LOAD:
                # Each word once ([BK/PACK, BN]), repeated PACK times along K in registers.
                rows = (k0 // PACK + tl.arange(0, BLOCK_K // PACK)).to(tl.int64)
                words = tl.load(
                    qweight_ptr + rows[:, None] * stride_qw + offs_n[None, :],
                    mask=(rows < K // PACK)[:, None] & n_ok[None, :],
                    other=0,
                )
                words = tl.reshape(
                    tl.broadcast_to(words[:, None, :], (BLOCK_K // PACK, PACK, BLOCK_N)), (BLOCK_K, BLOCK_N)
                )
            else:
                rows = (offs_k // PACK).to(tl.int64)
                words = tl.load(qweight_ptr + rows[:, None] * stride_qw + offs_n[None, :], mask=tile_ok, other=0)
            q = (words >> ((offs_k % PACK) * BITS)[:, None]) & MASK
        if ONE_GROUP_PER_TILE:
            # The tile lies in one group: one row of zeros and scales, broadcast over the tile.
            g = k0 // group_size
            zw = tl.load(qzeros_ptr + g * stride_qz + word_n, mask=n_ok, other=0)
            z = ((zw >> shift_n) & MASK) + ZERO_OFFSET
            s = tl.load(scales_ptr + g * stride_s + offs_n, mask=n_ok, other=0.0)
            w = ((q - z[None, :]).to(tl.float32) * s.to(tl.float32)[None, :]).to(s.dtype)
        else:
            if HAS_G_IDX:
                g = tl.load(g_idx_ptr + offs_k, mask=k_ok, other=0)
            else:
                g = offs_k // group_size
            zw = tl.load(qzeros_ptr + g[:, None] * stride_qz + word_n[None, :], mask=tile_ok, other=0)
            z = ((zw >> shift_n[None, :]) & MASK) + ZERO_OFFSET
            s = tl.load(scales_ptr + g[:, None] * stride_s + offs_n[None, :], mask=tile_ok, other=0.0)
            w = ((q - z).to(tl.float32) * s.to(tl.float32)).to(s.dtype)
        w = w.to(a.dtype)
        if X_F32:
            acc += tl.dot(a, w, input_precision="ieee")
        elif INTERPRET:
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, w)
        return acc

    # M (the step's row count) and split_k vary from step to step: not specialised on (Triton would otherwise compile
    # a variant for M == 1, M % 16 == 0, each SPLIT_K value...). The variants left: the block config of _blocks(M)
    # and ATOMIC (split or not), per dtype and format.
    @triton.jit(do_not_specialize=["M", "split_k"])
    def _int4_gemm_kernel(
        x_ptr,
        qweight_ptr,
        qzeros_ptr,
        scales_ptr,
        g_idx_ptr,
        out_ptr,
        M,
        N,
        K,
        group_size,
        stride_xm,
        stride_xk,
        stride_qw,
        stride_qz,
        stride_s,
        stride_om,
        split_k,
        AWQ: tl.constexpr,
        BITS: tl.constexpr,
        ZERO_OFFSET: tl.constexpr,
        HAS_G_IDX: tl.constexpr,
        ONE_GROUP_PER_TILE: tl.constexpr,
        ATOMIC: tl.constexpr,
        X_F32: tl.constexpr,
        INTERPRET: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        WIDE_LOAD: tl.constexpr,
    ):
        """out[m, n] (+)= sum_k x[m, k] * ((q[k, n] - z[g(k), n]) * s[g(k), n]) over this program's K tiles."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        PACK: tl.constexpr = 32 // BITS
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = offs_m < M
        n_ok = offs_n < N
        word_n = offs_n // PACK  # the packed column of each output column (AWQ qweight, both formats' qzeros)
        if AWQ:
            j = offs_n % 8
            shift_n = ((j % 2) * 4 + j // 2) * 4  # the inverse of AWQ's interleave
        else:
            shift_n = (offs_n % PACK) * BITS
        x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if INTERPRET:
            # Triton 3.6's interpreter keeps scalars as 1-element arrays that range() cannot take as a
            # bound; a while loop only needs their truth value. Compiled, the for loop stays (scf.for).
            k0 = pid_k * BLOCK_K
            while k0 < K:
                acc = _int4_k_tile(
                    acc, x_rows, qweight_ptr, qzeros_ptr, scales_ptr, g_idx_ptr, k0, K, N, group_size, m_ok, offs_n,
                    n_ok, pid_n, word_n, shift_n, stride_xk, stride_qw, stride_qz, stride_s, AWQ, BITS, ZERO_OFFSET,
                    HAS_G_IDX, ONE_GROUP_PER_TILE, X_F32, INTERPRET, BLOCK_N, BLOCK_K, WIDE_LOAD,
                )  # fmt: skip
                k0 += BLOCK_K * split_k
        else:
            for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * split_k):
                acc = _int4_k_tile(
                    acc, x_rows, qweight_ptr, qzeros_ptr, scales_ptr, g_idx_ptr, k0, K, N, group_size, m_ok, offs_n,
                    n_ok, pid_n, word_n, shift_n, stride_xk, stride_qw, stride_qz, stride_s, AWQ, BITS, ZERO_OFFSET,
                    HAS_G_IDX, ONE_GROUP_PER_TILE, X_F32, INTERPRET, BLOCK_N, BLOCK_K, WIDE_LOAD,
                )  # fmt: skip
        out = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
        mask = m_ok[:, None] & n_ok[None, :]
        if ATOMIC:
            tl.atomic_add(out, acc, mask=mask)
        else:
            tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _blocks(m: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) by batch size: decode is weight-bound, prefill compute-bound."""
    if m <= 16:
        return 16, 64, 64
    if m <= 32:
        return 32, 64, 64
    if m <= 64:
        return 64, 64, 32
    return 128, 128, 32


def _check_common(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor) -> None:
    if not HAS_TRITON:
        raise RuntimeError("the int4 Triton kernels need the 'triton' package (pip install 'vllm-lite[triton]')")
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K], got shape {list(x.shape)}")
    if x.dtype not in SCALE_DTYPES:
        raise TypeError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    for name, t in (("qweight", qweight), ("qzeros", qzeros)):
        if t.dtype != torch.int32 or t.dim() != 2:
            raise TypeError(f"{name} must be a 2-D int32 tensor, got {t.dtype} with shape {list(t.shape)}")
    if scales.dtype not in SCALE_DTYPES or scales.dim() != 2:
        raise TypeError(
            f"scales must be a 2-D float16/bfloat16/float32 tensor, got {scales.dtype} {list(scales.shape)}"
        )
    devices = {str(t.device) for t in (x, qweight, qzeros, scales)}
    if len(devices) != 1:
        raise ValueError(f"int4 gemm inputs must share one device, got {sorted(devices)}")
    for name, t in (("qweight", qweight), ("qzeros", qzeros), ("scales", scales)):
        if t.stride(1) != 1:
            raise ValueError(f"{name} must have contiguous rows (stride 1 along its last dimension)")


def _launch(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: Optional[torch.Tensor],
    group_size: int,
    n: int,
    awq: bool,
    bits: int,
    zero_offset: int,
    split_k: Optional[int],
    wide_load: bool,
) -> torch.Tensor:
    m, k = x.shape
    if split_k is not None and not 1 <= split_k <= MAX_SPLIT_K:
        raise ValueError(f"split_k must lie in [1, {MAX_SPLIT_K}], got {split_k}")
    if x.device.type != "cuda" and not envs.TRITON_INTERPRET:
        raise ValueError("the int4 Triton kernels got CPU tensors: run on CUDA, or set TRITON_INTERPRET=1 first.")
    if m == 0 or n == 0:
        return torch.zeros(m, n, dtype=x.dtype, device=x.device)
    block_m, block_n, block_k = _blocks(m)
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    if split_k is None:
        split_k = 1
        while tiles * split_k < TARGET_PROGRAMS and split_k * 2 * block_k <= k and split_k < MAX_SPLIT_K:
            split_k *= 2
    one_group = g_idx is None and group_size % block_k == 0
    if split_k > 1:
        out = torch.zeros(m, n, dtype=torch.float32, device=x.device)
    else:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), split_k)
    _int4_gemm_kernel[grid](
        x,
        qweight,
        qzeros,
        scales,
        g_idx if g_idx is not None else qzeros,  # unread without HAS_G_IDX
        out,
        m,
        n,
        k,
        group_size,
        x.stride(0),
        x.stride(1),
        qweight.stride(0),
        qzeros.stride(0),
        scales.stride(0),
        out.stride(0),
        split_k,
        AWQ=awq,
        BITS=bits,
        ZERO_OFFSET=zero_offset,
        HAS_G_IDX=g_idx is not None,
        ONE_GROUP_PER_TILE=one_group,
        ATOMIC=split_k > 1,
        X_F32=x.dtype == torch.float32,
        INTERPRET=bool(envs.TRITON_INTERPRET),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        WIDE_LOAD=wide_load,
        num_warps=4,
        num_stages=3,
    )
    return out.to(x.dtype) if split_k > 1 else out


def awq_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    *,
    split_k: Optional[int] = None,
    wide_load: bool = True,
) -> torch.Tensor:
    """[M, N] in x's dtype: x @ W for an AutoAWQ GEMM-packed W (qweight [K, N/8], qzeros [K/G, N/8], scales [K/G, N]).

    ``split_k`` forces the reduction split (by default it grows while the grid is small); ``wide_load``
    False gathers each packed word once per output column instead (tests, benchmarks).
    """
    _check_common(x, qweight, qzeros, scales)
    k = x.shape[1]
    n = scales.shape[1]
    if group_size <= 0 or k % group_size:
        raise ValueError(f"group_size {group_size} must be positive and divide K = {k}")
    if n % 8 or tuple(qweight.shape) != (k, n // 8):
        raise ValueError(f"qweight must be [K, N/8] = [{k}, {n // 8}] with N % 8 == 0, got {list(qweight.shape)}")
    if tuple(qzeros.shape) != (k // group_size, n // 8):
        raise ValueError(f"qzeros must be [K/G, N/8] = [{k // group_size}, {n // 8}], got {list(qzeros.shape)}")
    if scales.shape[0] != k // group_size:
        raise ValueError(f"scales must be [K/G, N] = [{k // group_size}, {n}], got {list(scales.shape)}")
    return _launch(x, qweight, qzeros, scales, None, group_size, n, True, 4, 0, split_k, wide_load)


def gptq_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: Optional[torch.Tensor],
    bits: int = 4,
    *,
    checkpoint_format: str = "gptq",
    group_size: Optional[int] = None,
    split_k: Optional[int] = None,
    wide_load: bool = True,
) -> torch.Tensor:
    """[M, N] in x's dtype: x @ W for a GPTQ-packed W (qweight [K/8, N], qzeros [groups, N/8], scales [groups, N]).

    g_idx [K] int32 gives each input row's group (any map, so desc_act works); ``g_idx=None`` with
    ``group_size`` means the plain k // group_size map (a faster path: one zero/scale row per tile).
    ``checkpoint_format`` "gptq" stores zeros minus one, "gptq_v2" stores them as they are.
    ``split_k`` and ``wide_load`` as in ``awq_gemm``.
    """
    _check_common(x, qweight, qzeros, scales)
    if bits not in GPTQ_BITS:
        raise ValueError(f"bits must be one of {GPTQ_BITS}, got {bits}")
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise ValueError(f"checkpoint_format must be 'gptq' or 'gptq_v2', got {checkpoint_format!r}")
    pack = 32 // bits
    k = x.shape[1]
    n = scales.shape[1]
    groups = scales.shape[0]
    if k % pack or n % pack or tuple(qweight.shape) != (k // pack, n):
        raise ValueError(f"qweight must be [K/{pack}, N] = [{k // pack}, {n}], got {list(qweight.shape)}")
    if tuple(qzeros.shape) != (groups, n // pack):
        raise ValueError(f"qzeros must be [groups, N/{pack}] = [{groups}, {n // pack}], got {list(qzeros.shape)}")
    if g_idx is None:
        if group_size is None or group_size <= 0 or k % group_size or k // group_size != groups:
            raise ValueError(f"without g_idx, group_size must divide K = {k} into {groups} groups, got {group_size}")
    else:
        if g_idx.dtype not in (torch.int32, torch.int64) or tuple(g_idx.shape) != (k,):
            raise ValueError(f"g_idx must be an int32 tensor of shape [{k}], got {g_idx.dtype} {list(g_idx.shape)}")
        if g_idx.device != x.device:
            raise ValueError(f"g_idx is on {g_idx.device}, x on {x.device}")
        group_size = 1  # unused: every row's group is read from g_idx
    zero_offset = 1 if checkpoint_format == "gptq" else 0
    return _launch(x, qweight, qzeros, scales, g_idx, group_size, n, False, bits, zero_offset, split_k, wide_load)


def sort_gptq_act_order(
    qweight: torch.Tensor, g_idx: torch.Tensor, num_groups: int, bits: int = 4
) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """(qweight with its input rows sorted by group, perm) for a desc_act layer; None when groups are uneven.

    Done once at load time: with rows in group order, g_idx becomes k // G, so ``gptq_gemm(x[:, perm],
    qweight_sorted, qzeros, scales, None, group_size=G)`` takes the one-group-per-tile path (one row of
    zeros and scales per K tile, not a gather per weight) at the cost of one gather of x's columns.
    Like exllama's act-order reordering; equal to the unsorted product up to summation order.
    """
    if bits not in GPTQ_BITS:
        raise ValueError(f"bits must be one of {GPTQ_BITS}, got {bits}")
    pack = 32 // bits
    k = qweight.shape[0] * pack
    if tuple(g_idx.shape) != (k,) or num_groups <= 0 or k % num_groups:
        raise ValueError(f"g_idx must have shape [{k}] and {num_groups} groups must divide K = {k}")
    group_size = k // num_groups
    perm = torch.argsort(g_idx.long(), stable=True)
    counts = torch.bincount(g_idx.long(), minlength=num_groups)
    if counts.numel() != num_groups or bool((counts != group_size).any()):
        return None  # uneven groups (a hand-made g_idx): keep the per-row map
    mask = (1 << bits) - 1
    shifts = torch.arange(pack, device=qweight.device, dtype=torch.int64) * bits
    values = ((qweight.long().unsqueeze(1) >> shifts.view(1, -1, 1)) & mask).reshape(k, -1)  # [K, N]
    values = values.index_select(0, perm).view(k // pack, pack, -1)
    words = (values << shifts.view(1, -1, 1)).sum(1)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.contiguous(), perm
