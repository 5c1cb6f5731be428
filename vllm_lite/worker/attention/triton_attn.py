"""Triton attention backend for GPUs: one paged-attention kernel for the whole mixed batch, one KV writer.

Attention grid: (query tiles, KV heads). A program owns BLOCK_Q query tokens of one request and
all GROUP query heads that share its KV head, packed as BLOCK_M = BLOCK_Q * GROUP rows (GQA reads
each key tile once for the whole group). Query tile i of request b has program id
query_start_loc[b] // BLOCK_Q + b + i, an upper-bound numbering that needs no host-side scan:
a program finds its request by binary search over query_start_loc, and surplus programs do no
work. Keys are gathered per token through the block table (any block size), in tiles of TILE_N,
with an online softmax so no [query, context] matrix exists. With a sliding window W a program
starts at the first key its earliest query sees (p - W + 1): blocks before it may be freed.
Logit soft-capping (Gemma 2) is c * tanh(s / c), written with exp (no tanh in every Triton).

Runs on CPU only under TRITON_INTERPRET=1 (the tests), where bf16 tiles are widened to float32
before tl.dot; on CUDA, bf16 tiles go to tensor cores with float32 accumulation and float32
inputs use exact ("ieee") dots.
"""

from __future__ import annotations

from typing import Optional

import torch

from vllm_lite import envs
from vllm_lite.worker.attention.backend import AttentionBackend, AttentionMetadata

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is absent
    HAS_TRITON = False


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1)."""
    return bool(envs.TRITON_INTERPRET)


if HAS_TRITON:

    @triton.jit
    def _attend_key_tile(
        m_i,
        l_i,
        acc,
        q,
        pos,
        row_ok,
        start_n,
        num_keys,
        kv_ptr,
        table_row_ptr,  # this request's block-table row
        kv_half,
        kvh,
        offs_d,
        d_ok,
        scale,
        window,
        soft_cap,
        BLOCK_SIZE: tl.constexpr,
        NUM_KV_HEADS: tl.constexpr,
        HEAD_SIZE: tl.constexpr,
        TILE_N: tl.constexpr,
        DOT_IN_BF16: tl.constexpr,
        USE_WINDOW: tl.constexpr,
        USE_SOFT_CAP: tl.constexpr,
    ):
        """One online-softmax step over keys [start_n, start_n + TILE_N): returns the new (m_i, l_i, acc)."""
        offs_n = start_n + tl.arange(0, TILE_N)
        n_ok = offs_n < num_keys
        blk = tl.load(table_row_ptr + offs_n // BLOCK_SIZE, mask=n_ok, other=0)
        tok_off = (blk.to(tl.int64) * BLOCK_SIZE + offs_n % BLOCK_SIZE) * (NUM_KV_HEADS * HEAD_SIZE) + kvh * HEAD_SIZE
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(kv_ptr + tok_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(kv_ptr + kv_half + tok_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if DOT_IN_BF16:
            s = tl.dot(q, tl.trans(k))
        else:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        s = s * scale
        if USE_SOFT_CAP:
            # c * tanh(s / c) = c * (1 - 2 / (exp(2 s / c) + 1)); saturates correctly at +-inf.
            s = soft_cap * (1.0 - 2.0 / (tl.exp(2.0 * s / soft_cap) + 1.0))
        allowed = (offs_n[None, :] <= pos[:, None]) & n_ok[None, :] & row_ok[:, None]
        if USE_WINDOW:
            allowed = allowed & (offs_n[None, :] > pos[:, None] - window)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if DOT_IN_BF16:
            pv = tl.dot(p.to(v.dtype), v)
        else:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        acc = acc * alpha[:, None] + pv
        return m_new, l_i, acc

    # The step's request count and block-table width change from step to step: specialised (== 1, % 16 == 0,
    # other) each new combination would be a fresh compile (hundreds of ms) in the middle of serving, e.g. the
    # first single-request prefill after a warm-up of batches.
    @triton.jit(do_not_specialize=["num_reqs", "stride_bt"])
    def _paged_attention_kernel(
        out_ptr,
        q_ptr,
        kv_ptr,
        block_table_ptr,
        seq_lens_ptr,
        query_start_loc_ptr,
        scale,
        window,
        soft_cap,
        num_reqs,
        stride_q_tok,
        stride_q_head,
        stride_o_tok,
        stride_o_head,
        stride_bt,
        kv_half,  # elements from the key half of the cache to the value half
        BLOCK_SIZE: tl.constexpr,
        NUM_KV_HEADS: tl.constexpr,
        GROUP: tl.constexpr,
        HEAD_SIZE: tl.constexpr,
        HEAD_PAD: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        BLOCK_M: tl.constexpr,
        TILE_N: tl.constexpr,
        DOT_IN_BF16: tl.constexpr,
        INTERPRET: tl.constexpr,
        USE_WINDOW: tl.constexpr,
        USE_SOFT_CAP: tl.constexpr,
    ):
        pid = tl.program_id(0)
        kvh = tl.program_id(1)

        # Request b: the last one whose first tile id (qsl[b] // BLOCK_Q + b) is <= pid.
        # Built from pid so both stay int32 tensors even when Triton specialises num_reqs == 1 to a constant.
        lo = pid * 0
        hi = pid * 0 + num_reqs - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            first = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
            if first <= pid:
                lo = mid
            else:
                hi = mid - 1
        b = lo
        q_start = tl.load(query_start_loc_ptr + b)
        q_len = tl.load(query_start_loc_ptr + b + 1) - q_start
        tile = pid - (q_start // BLOCK_Q + b)
        seq_len = tl.load(seq_lens_ptr + b)
        ctx = seq_len - q_len  # position of the request's first query token

        offs_m = tl.arange(0, BLOCK_M)
        q_local = tile * BLOCK_Q + offs_m // GROUP
        head = kvh * GROUP + offs_m % GROUP
        row_ok = (offs_m < BLOCK_Q * GROUP) & (q_local < q_len)
        offs_d = tl.arange(0, HEAD_PAD)
        d_ok = offs_d < HEAD_SIZE
        tok = (q_start + q_local).to(tl.int64)

        q = tl.load(
            q_ptr + tok[:, None] * stride_q_tok + head[:, None] * stride_q_head + offs_d[None, :],
            mask=row_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        if not DOT_IN_BF16:
            q = q.to(tl.float32)
        pos = ctx + q_local

        tile_end = tl.minimum((tile + 1) * BLOCK_Q, q_len)
        num_keys = tl.where(tile * BLOCK_Q < q_len, ctx + tile_end, 0)
        key_begin = num_keys * 0
        if USE_WINDOW:
            key_begin = tl.maximum(ctx + tile * BLOCK_Q - window + 1, 0)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
        if INTERPRET:
            # Triton 3.6's interpreter keeps scalars as 1-element arrays that range() cannot take as a
            # bound; a while loop only needs their truth value. Compiled, the for loop stays (scf.for).
            start_n = key_begin
            while start_n < num_keys:
                m_i, l_i, acc = _attend_key_tile(
                    m_i,
                    l_i,
                    acc,
                    q,
                    pos,
                    row_ok,
                    start_n,
                    num_keys,
                    kv_ptr,
                    block_table_ptr + b * stride_bt,
                    kv_half,
                    kvh,
                    offs_d,
                    d_ok,
                    scale,
                    window,
                    soft_cap,
                    BLOCK_SIZE,
                    NUM_KV_HEADS,
                    HEAD_SIZE,
                    TILE_N,
                    DOT_IN_BF16,
                    USE_WINDOW,
                    USE_SOFT_CAP,
                )
                start_n += TILE_N
        else:
            for start_n in range(key_begin, num_keys, TILE_N):
                m_i, l_i, acc = _attend_key_tile(
                    m_i,
                    l_i,
                    acc,
                    q,
                    pos,
                    row_ok,
                    start_n,
                    num_keys,
                    kv_ptr,
                    block_table_ptr + b * stride_bt,
                    kv_half,
                    kvh,
                    offs_d,
                    d_ok,
                    scale,
                    window,
                    soft_cap,
                    BLOCK_SIZE,
                    NUM_KV_HEADS,
                    HEAD_SIZE,
                    TILE_N,
                    DOT_IN_BF16,
                    USE_WINDOW,
                    USE_SOFT_CAP,
                )

        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            out_ptr + tok[:, None] * stride_o_tok + head[:, None] * stride_o_head + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )

    @triton.jit
    def _write_kv_kernel(
        key_ptr,
        value_ptr,
        kv_ptr,
        slot_ptr,
        stride_k_tok,
        stride_v_tok,
        kv_half,
        ROW: tl.constexpr,  # num_kv_heads * head_size
        ROW_PAD: tl.constexpr,
    ):
        t = tl.program_id(0)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        offs = tl.arange(0, ROW_PAD)
        ok = (offs < ROW) & ((offs * 0 + slot) >= 0)  # negative slot = padding token, nothing to write
        k = tl.load(key_ptr + t.to(tl.int64) * stride_k_tok + offs, mask=ok)
        v = tl.load(value_ptr + t.to(tl.int64) * stride_v_tok + offs, mask=ok)
        tl.store(kv_ptr + slot * ROW + offs, k, mask=ok)
        tl.store(kv_ptr + kv_half + slot * ROW + offs, v, mask=ok)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class TritonBackend(AttentionBackend):
    """Paged attention and KV writes as Triton kernels (CUDA; CPU only under TRITON_INTERPRET=1)."""

    name = "triton"
    # Attention(..., rotary_emb=) may rotate k while writing it to the cache (models/triton_fused.py's
    # rotary_write_kv: the write_kv kernel's job plus the rotation, one launch) instead of calling write_kv.
    fuses_rotary_kv_write = True

    def __init__(self, tile_n: int = 32) -> None:
        if not HAS_TRITON:
            raise RuntimeError("TritonBackend needs the 'triton' package: pip install 'vllm-lite[triton]'.")
        if tile_n < 16 or tile_n & (tile_n - 1):
            raise ValueError(f"tile_n must be a power of two >= 16, got {tile_n}.")
        self.tile_n = tile_n

    @staticmethod
    def _check_device(t: torch.Tensor) -> None:
        if t.device.type == "cpu" and not interpreting():
            raise ValueError("TritonBackend got CPU tensors: run on CUDA, or set TRITON_INTERPRET=1 before importing.")

    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        self._check_device(kv_cache)
        n = key.shape[0]
        if n == 0:
            return
        _, _, _, kvh, d = kv_cache.shape
        if key.shape[1:] != (kvh, d) or value.shape != key.shape:
            raise ValueError(
                f"key/value must have shape [T, {kvh}, {d}], got {tuple(key.shape)} and {tuple(value.shape)}."
            )
        key, value = _packed_rows(key.to(kv_cache.dtype)), _packed_rows(value.to(kv_cache.dtype))
        if not kv_cache.is_contiguous():
            raise ValueError("kv_cache must be contiguous.")
        row = kvh * d
        _write_kv_kernel[(n,)](
            key,
            value,
            kv_cache,
            slot_mapping[:n],
            key.stride(0),
            value.stride(0),
            kv_cache.stride(0),
            ROW=row,
            ROW_PAD=_next_pow2(row),
        )

    def forward(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: Optional[int] = None,
        logits_soft_cap: Optional[float] = None,
    ) -> torch.Tensor:
        self._check_device(kv_cache)
        n, num_heads, head_size = query.shape
        _, _, block_size, num_kv_heads, cache_head = kv_cache.shape
        if cache_head != head_size:
            raise ValueError(f"kv_cache head_size {cache_head} != query head_size {head_size}.")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}.")
        if query.dtype != kv_cache.dtype:
            raise TypeError(f"query dtype {query.dtype} must equal kv_cache dtype {kv_cache.dtype}.")
        if not kv_cache.is_contiguous():
            raise ValueError("kv_cache must be contiguous.")
        q = query if query.stride(-1) == 1 else query.contiguous()
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        b = metadata.num_reqs
        if n == 0 or b == 0:
            return out
        group = num_heads // num_kv_heads
        block_m = 16 if metadata.max_query_len * group <= 16 else 64
        block_m = max(block_m, _next_pow2(group))
        block_q = block_m // group
        grid = (n // block_q + b, num_kv_heads)
        _paged_attention_kernel[grid](
            out,
            q,
            kv_cache,
            metadata.block_table,
            metadata.seq_lens,
            metadata.query_start_loc,
            float(scale),
            int(sliding_window or 0),
            float(logits_soft_cap or 1.0),
            b,
            q.stride(0),
            q.stride(1),
            out.stride(0),
            out.stride(1),
            metadata.block_table.stride(0),
            kv_cache.stride(0),
            BLOCK_SIZE=block_size,
            NUM_KV_HEADS=num_kv_heads,
            GROUP=group,
            HEAD_SIZE=head_size,
            HEAD_PAD=max(16, _next_pow2(head_size)),
            BLOCK_Q=block_q,
            BLOCK_M=block_m,
            TILE_N=self.tile_n,
            DOT_IN_BF16=(q.dtype == torch.bfloat16 and not interpreting()),
            INTERPRET=interpreting(),
            USE_WINDOW=bool(sliding_window),
            USE_SOFT_CAP=bool(logits_soft_cap),
        )
        return out


def _packed_rows(t: torch.Tensor) -> torch.Tensor:
    """Rows may be strided (a slice of a fused projection) but each [KVH, D] row must be packed."""
    if t.stride(2) == 1 and t.stride(1) == t.shape[2]:
        return t
    return t.contiguous()
