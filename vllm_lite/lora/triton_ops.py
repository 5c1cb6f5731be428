"""LoRA gather-matmuls on CUDA as Triton kernels, punica-style: one launch serves every adapter in the batch.

``lora_shrink`` computes buf[t] = x[t] @ A[slot(t)]^T (float32) and ``lora_expand`` adds
buf[t] @ B[slot(t)]^T into a column range of y, for a batch whose tokens use different adapter slots
(slot -1: no adapter, row untouched). Two kernel shapes, one per regime:

- SGMV (segmented gather-matmul, prefill and large batches): tokens are grouped by slot with a stable
  argsort on the device (``group_tokens_by_slot``; no host sync, so it stays capturable in a CUDA
  graph). The grid is (token tiles x output tiles, slots, K splits); a program owns BLOCK_M tokens
  of ONE slot, gathers their rows, and multiplies them by that slot's weight tile with ``tl.dot``, so
  each weight tile is read once per token tile. Programs past the end of their slot's tokens exit.
- BGMV (batched gather matrix-vector, small decode batches): one program per (token, output tile)
  reads its own slot's weight tile; no grouping at all.

A layer's BGMV step (``add_lora_bgmv``, what ops.add_lora_triton runs for decode) takes ONE launch up to
FUSED_MAX_TOKENS tokens (``_bgmv_fused_kernel``: each (token, output tile) program computes its token's rank-r
shrink itself, then adds B @ h into its tile, every fused sub-projection in the same launch; decode steps are
launch-bound, so half the graph nodes beat the repeated shrink), and two above: the shrink stores its split-K
partial sums side by side ([split, T, R], plain stores into an uninitialised buffer) and one expand sums them in a
fixed order and writes every fused sub-projection. Neither has a memset (a graph node of its own) or atomics.
``lora_shrink`` / ``lora_expand`` below keep the zeroed buffer and atomics (SGMV, the fallbacks, the kernels' own
tests).

The shrink has a long reduction (hidden size) and a short output (rank), so it splits K over
programs and adds its partial sums atomically into the float32 buffer; the expand's reduction is the
rank, so it never splits and each output element is written by exactly one program (y += ... is a
plain load-add-store). Dots take the weight's dtype (the float32 buffer is rounded to it before the
expand, as vLLM does) with float32 accumulation; float32 weights use exact ("ieee") dots. Under the
CPU interpreter (TRITON_INTERPRET=1, the tests) tiles are widened to float32 before ``tl.dot``,
whose interpreted bf16 path is wrong; the rounding to the weight dtype still happens first.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from vllm_lite import envs

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is absent
    HAS_TRITON = False

# Batches of at most this many tokens take the BGMV kernel; tune with benchmarks/kernels_int4_lora.py. On the H200
# (2026-11-27, 8 adapters, rank 16, 4096 -> 4096) BGMV beat SGMV at every size measured: 1 token 194 vs 1704 us,
# 64 tokens 91 vs 535, 2048 tokens 151 vs 1151; so BGMV takes every batch a step can hold.
BGMV_MAX_TOKENS = 1 << 20
# BGMV steps of at most this many tokens take ONE launch per projection (``_bgmv_fused_kernel``: each program
# computes its token's rank-r shrink itself, then its output tile), larger ones the two launches (split-K shrink
# partials, then one expand). The fused kernel repeats the shrink once per output tile, so its cost grows with
# tokens x tiles; pick the crossing with ``benchmarks/kernels_int4_lora.py --lora-fused`` (CUDA graphs, the 100M
# Qwen2's projections). The fused path also needs a rank of at most FUSED_MAX_RANK (its shrink tile is
# [rank, BLOCK_K] in registers).
FUSED_MAX_TOKENS = 32
FUSED_MAX_RANK = 64
# The fused kernel's output tile (the widest power of two up to this that divides every sub boundary; one shrink
# per tile), its K tile and its warps; the [BLOCK_N, rank] B tile and the [rank, BLOCK_K] shrink tile each hold at
# most FUSED_TILE_ELEMS elements (registers). A wide K tile keeps a whole hidden size's loads in flight at once
# (Triton does not pipeline this loop: its loads feed no tl.dot), so the shrink is one or two round trips to L2.
FUSED_BLOCK_N = 256
FUSED_BLOCK_K = 1024
FUSED_TILE_ELEMS = 16384
# 4 warps, measured on an H100 (2026-11-28, scripts/lora_fused_gpu.sh micro, the 100M Qwen2's four projections a
# layer in CUDA graphs, rank 16, 8 slots): 12.3 / 13.6 / 14.3 / 17.5 us a layer at 1 / 8 / 16 / 32 tokens against
# 14.2 / 16.3 / 18.3 / 23.4 with 8 warps and 16.0 / 17.7 / 18.9 / 21.9 with the two launches.
FUSED_NUM_WARPS = 4
# The shrink splits its reduction until about this many programs run (an H100 has 132 SMs).
TARGET_PROGRAMS = 256
MAX_SPLIT_K = 32


class SlotGrouping(NamedTuple):
    """Tokens grouped by adapter slot: computed once per step and shared by every LoRA layer."""

    sorted_tokens: torch.Tensor  # [T] int32: token indices, slot 0's first, no-adapter tokens last
    slot_start: torch.Tensor  # [S] int32: where each slot's tokens begin in sorted_tokens
    slot_count: torch.Tensor  # [S] int32: how many tokens each slot has


def group_tokens_by_slot(token_slots: torch.Tensor, num_slots: int) -> SlotGrouping:
    """Stable device-side grouping (no host sync); a slot outside [0, num_slots) counts as no adapter."""
    slots = token_slots.long()
    key = torch.where((slots < 0) | (slots >= num_slots), num_slots, slots)
    order = torch.argsort(key, stable=True)
    sorted_key = key[order]
    ids = torch.arange(num_slots, device=key.device)
    start = torch.searchsorted(sorted_key, ids)
    count = torch.searchsorted(sorted_key, ids, right=True) - start
    return SlotGrouping(order.to(torch.int32), start.to(torch.int32), count.to(torch.int32))


# This step's token_slots (held, so its identity cannot be reused) and, once an SGMV call needed it, its grouping.
_step: Optional[list] = None


def set_step_slots(token_slots: Optional[torch.Tensor]) -> None:
    """Declare this step's token_slots: SGMV calls with this same tensor then share one grouping (None clears).

    Mirrors torch_ops.set_step_slots. Call it inside the forward (so a CUDA graph captures the sort it
    triggers), after the tensor holds this step's slots; calls passing ``grouping=`` ignore it.
    """
    global _step
    _step = None if token_slots is None else [token_slots, None, None]  # tensor, num_slots, grouping


def _grouping_for(token_slots: torch.Tensor, num_slots: int) -> SlotGrouping:
    """The step's shared grouping when token_slots is the declared tensor, else a fresh one."""
    step = _step
    if step is None or step[0] is not token_slots:
        return group_tokens_by_slot(token_slots, num_slots)
    if step[1] != num_slots:
        step[1], step[2] = num_slots, group_tokens_by_slot(token_slots, num_slots)
    return step[2]


if HAS_TRITON:
    # The BGMV kernel's loop over K takes a different form under the interpreter (the SGMV kernel gets
    # INTERPRET as a parameter). A global constexpr: Triton picks its interpreter for the whole process at import.
    _INTERPRET = tl.constexpr(bool(envs.TRITON_INTERPRET))

    @triton.jit
    def _dot_tile(a, w, acc, W_F32: tl.constexpr, INTERPRET: tl.constexpr):
        """acc += a @ w with a rounded to w's dtype; exact for float32, float32-widened when interpreted."""
        a = a.to(w.dtype)
        if W_F32:
            acc += tl.dot(a, w, input_precision="ieee")
        elif INTERPRET:
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, w)
        return acc

    @triton.jit
    def _sgmv_k_tile(
        acc, in_ptr, w_base, tokens, row_ok, offs_n, n_ok, k0, k_in, stride_in_t, stride_in_k, stride_w_n, stride_w_k,
        W_F32: tl.constexpr, INTERPRET: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """acc += in[tokens, k0:k0 + BLOCK_K] @ w[slot, offs_n, k0:k0 + BLOCK_K]^T (one K tile, inlined)."""
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < k_in
        a = tl.load(
            in_ptr + tokens[:, None] * stride_in_t + offs_k[None, :] * stride_in_k,
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        w = tl.load(
            w_base + offs_n[None, :] * stride_w_n + offs_k[:, None] * stride_w_k,
            mask=k_ok[:, None] & n_ok[None, :],
            other=0.0,
        )
        return _dot_tile(a, w, acc, W_F32, INTERPRET)

    @triton.jit
    def _bgmv_k_tile(
        acc, in_ptr, w_base, t, offs_n, n_ok, k0, k_in, stride_in_t, stride_in_k, stride_w_n, stride_w_k,
        BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """acc += w[slot, offs_n, k0:k0 + BLOCK_K] @ in[t, k0:k0 + BLOCK_K] (one K tile, inlined)."""
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < k_in
        w = tl.load(
            w_base + offs_n[:, None] * stride_w_n + offs_k[None, :] * stride_w_k,
            mask=n_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        a = tl.load(in_ptr + t * stride_in_t + offs_k * stride_in_k, mask=k_ok, other=0.0)
        a = a.to(w.dtype).to(tl.float32)
        acc += tl.sum(w.to(tl.float32) * a[None, :], axis=1)
        return acc

    @triton.jit
    def _bgmv_k_loop(
        acc, in_ptr, w_base, t, offs_n, n_ok, pid_k, k_in, stride_in_t, stride_in_k, stride_w_n, stride_w_k,
        SPLIT_K: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """acc plus this program's K tiles (pid_k, pid_k + SPLIT_K, ...) of one token's BGMV product. As in
        _sgmv_kernel: a while loop under the interpreter, the for loop (scf.for) compiled."""
        if _INTERPRET:
            k0 = pid_k * BLOCK_K
            while k0 < k_in:
                acc = _bgmv_k_tile(
                    acc, in_ptr, w_base, t, offs_n, n_ok, k0, k_in, stride_in_t, stride_in_k, stride_w_n, stride_w_k,
                    BLOCK_K,
                )  # fmt: skip
                k0 += BLOCK_K * SPLIT_K
        else:
            for k0 in range(pid_k * BLOCK_K, k_in, BLOCK_K * SPLIT_K):
                acc = _bgmv_k_tile(
                    acc, in_ptr, w_base, t, offs_n, n_ok, k0, k_in, stride_in_t, stride_in_k, stride_w_n, stride_w_k,
                    BLOCK_K,
                )  # fmt: skip
        return acc

    @triton.jit
    def _sgmv_kernel(
        in_ptr,
        w_ptr,
        out_ptr,
        sorted_tokens_ptr,
        slot_start_ptr,
        slot_count_ptr,
        n_out,
        k_in,
        stride_in_t,
        stride_in_k,
        stride_w_s,
        stride_w_n,
        stride_w_k,
        stride_out_t,
        stride_out_n,
        ACCUMULATE: tl.constexpr,
        SPLIT_K: tl.constexpr,
        W_F32: tl.constexpr,
        INTERPRET: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """out[tok, n] (+)= sum_k in[tok, k] * w[slot, n, k] for BLOCK_M of this slot's tokens."""
        pid = tl.program_id(0)
        slot = tl.program_id(1)
        pid_k = tl.program_id(2)
        num_n = tl.cdiv(n_out, BLOCK_N)
        pid_m = pid // num_n
        pid_n = pid % num_n
        count = tl.load(slot_count_ptr + slot)
        if pid_m * BLOCK_M >= count:
            return
        start = tl.load(slot_start_ptr + slot)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = offs_m < count
        tokens = tl.load(sorted_tokens_ptr + start + offs_m, mask=row_ok, other=0).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < n_out
        w_base = w_ptr + slot.to(tl.int64) * stride_w_s
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if INTERPRET:
            # Triton 3.6's interpreter keeps scalars as 1-element arrays that range() cannot take as a
            # bound; a while loop only needs their truth value. Compiled, the for loop stays (scf.for).
            k0 = pid_k * BLOCK_K
            while k0 < k_in:
                acc = _sgmv_k_tile(
                    acc, in_ptr, w_base, tokens, row_ok, offs_n, n_ok, k0, k_in,
                    stride_in_t, stride_in_k, stride_w_n, stride_w_k, W_F32, INTERPRET, BLOCK_K,
                )  # fmt: skip
                k0 += BLOCK_K * SPLIT_K
        else:
            for k0 in range(pid_k * BLOCK_K, k_in, BLOCK_K * SPLIT_K):
                acc = _sgmv_k_tile(
                    acc, in_ptr, w_base, tokens, row_ok, offs_n, n_ok, k0, k_in,
                    stride_in_t, stride_in_k, stride_w_n, stride_w_k, W_F32, INTERPRET, BLOCK_K,
                )  # fmt: skip
        out = out_ptr + tokens[:, None] * stride_out_t + offs_n[None, :] * stride_out_n
        mask = row_ok[:, None] & n_ok[None, :]
        if ACCUMULATE:
            prev = tl.load(out, mask=mask, other=0.0).to(tl.float32)
            tl.store(out, (prev + acc).to(out_ptr.dtype.element_ty), mask=mask)
        elif SPLIT_K > 1:
            tl.atomic_add(out, acc, mask=mask)
        else:
            tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _bgmv_kernel(
        in_ptr,
        w_ptr,
        out_ptr,
        slots_ptr,
        num_slots,
        n_out,
        k_in,
        stride_in_t,
        stride_in_k,
        stride_w_s,
        stride_w_n,
        stride_w_k,
        stride_out_t,
        stride_out_n,
        ACCUMULATE: tl.constexpr,
        SPLIT_K: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """out[t, n] (+)= sum_k in[t, k] * w[slot(t), n, k] for one token: a gathered matrix-vector product."""
        t = tl.program_id(0).to(tl.int64)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        slot = tl.load(slots_ptr + t).to(tl.int64)
        if (slot < 0) | (slot >= num_slots):
            return
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < n_out
        w_base = w_ptr + slot * stride_w_s
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        acc = _bgmv_k_loop(
            acc, in_ptr, w_base, t, offs_n, n_ok, pid_k, k_in, stride_in_t, stride_in_k, stride_w_n, stride_w_k,
            SPLIT_K, BLOCK_K,
        )  # fmt: skip
        out = out_ptr + t * stride_out_t + offs_n * stride_out_n
        if ACCUMULATE:
            prev = tl.load(out, mask=n_ok, other=0.0).to(tl.float32)
            tl.store(out, (prev + acc).to(out_ptr.dtype.element_ty), mask=n_ok)
        elif SPLIT_K > 1:
            tl.atomic_add(out, acc, mask=n_ok)
        else:
            tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=n_ok)


if HAS_TRITON:

    @triton.jit
    def _bgmv_expand_subs_kernel(
        in_ptr, w0_ptr, w1_ptr, w2_ptr, out_ptr, slots_ptr, num_slots, n_out, rank, start1, start2,
        stride_in_t, stride_in_k, stride_w0_s, stride_w1_s, stride_w2_s, stride_w_n, stride_w_k, stride_out_t,
        stride_out_n, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """y[t, n] += sum_r in[t, sub(n) * rank + r] * w_sub(n)[slot(t), n - start(sub(n)), r] for the (up to 3)
        sub-projections laid side by side in y's columns [0, n_out): sub 1 starts at column start1, sub 2 at
        start2 (n_out when absent). One launch expands every sub of a fused projection (q|k|v, gate|up)."""
        t = tl.program_id(0).to(tl.int64)
        pid_n = tl.program_id(1)
        slot = tl.load(slots_ptr + t).to(tl.int64)
        if (slot < 0) | (slot >= num_slots):
            return
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < n_out
        sub = (offs_n >= start1).to(tl.int32) + (offs_n >= start2).to(tl.int32)
        local_n = offs_n - tl.where(sub == 0, 0, tl.where(sub == 1, start1, start2))
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        k0 = 0
        while k0 < rank:
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < rank
            ok = n_ok[:, None] & k_ok[None, :]
            w_off = local_n[:, None] * stride_w_n + offs_k[None, :] * stride_w_k
            s0 = sub[:, None] == 0
            s1 = sub[:, None] == 1
            s2 = sub[:, None] == 2
            w = tl.load(w0_ptr + slot * stride_w0_s + w_off, mask=ok & s0, other=0.0)
            w += tl.load(w1_ptr + slot * stride_w1_s + w_off, mask=ok & s1, other=0.0)
            w += tl.load(w2_ptr + slot * stride_w2_s + w_off, mask=ok & s2, other=0.0)
            a = tl.load(
                in_ptr + t * stride_in_t + (sub[:, None] * rank + offs_k[None, :]) * stride_in_k, mask=ok, other=0.0
            )
            a = a.to(w.dtype).to(tl.float32)  # the float32 buffer rounded to the weights' dtype, as _bgmv_k_tile
            acc += tl.sum(w.to(tl.float32) * a, axis=1)
            k0 += BLOCK_K
        out = out_ptr + t * stride_out_t + offs_n * stride_out_n
        prev = tl.load(out, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(out, (prev + acc).to(out_ptr.dtype.element_ty), mask=n_ok)


if HAS_TRITON:

    @triton.jit
    def _bgmv_shrink_partials_kernel(
        in_ptr, w_ptr, out_ptr, slots_ptr, num_slots, n_out, k_in, stride_in_t, stride_in_k, stride_w_s, stride_w_n,
        stride_w_k, stride_out_s, stride_out_t, stride_out_n, SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """out[pid_k, t, n] = sum over this program's K tiles (pid_k, pid_k + SPLIT_K, ...) of in[t, k] * w[slot(t),
        n, k]: the BGMV shrink's split-K partial sums, each stored by exactly one program (no atomics, so the buffer
        needs no zeroing first). Rows of tokens without an adapter are not written (their expand reads nothing)."""
        t = tl.program_id(0).to(tl.int64)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        slot = tl.load(slots_ptr + t).to(tl.int64)
        if (slot < 0) | (slot >= num_slots):
            return
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < n_out
        w_base = w_ptr + slot * stride_w_s
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        acc = _bgmv_k_loop(
            acc, in_ptr, w_base, t, offs_n, n_ok, pid_k, k_in, stride_in_t, stride_in_k, stride_w_n, stride_w_k,
            SPLIT_K, BLOCK_K,
        )  # fmt: skip
        tl.store(out_ptr + pid_k.to(tl.int64) * stride_out_s + t * stride_out_t + offs_n * stride_out_n, acc, mask=n_ok)

    @triton.jit
    def _bgmv_expand_partials_kernel(
        in_ptr, w0_ptr, w1_ptr, w2_ptr, out_ptr, slots_ptr, num_slots, n_out, rank, start1, start2,
        stride_in_s, stride_in_t, stride_in_k, stride_w0_s, stride_w1_s, stride_w2_s, stride_w_n, stride_w_k,
        stride_out_t, stride_out_n, SPLIT: tl.constexpr, SPLIT_PAD: tl.constexpr, N_SUB: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """y[t, n] += sum_r buf[t, sub * rank + r] * w_sub[slot(t), n - start(sub), r], buf[t] being the sum of the
        SPLIT partial rows in[0..SPLIT-1, t] (the shrink's, summed here in a fixed order, then rounded to the
        weights' dtype as _bgmv_k_tile rounds its input). The (up to 3) subs lie side by side in y's columns
        [0, n_out), sub 1 from start1, sub 2 from start2 (n_out when absent); BLOCK_N divides start1 and start2, so
        a program's columns belong to one sub and read one [rank] slice of buf."""
        t = tl.program_id(0).to(tl.int64)
        pid_n = tl.program_id(1)
        slot = tl.load(slots_ptr + t).to(tl.int64)
        if (slot < 0) | (slot >= num_slots):
            return
        n0 = pid_n * BLOCK_N
        col0 = ((n0 >= start1).to(tl.int32) + (n0 >= start2).to(tl.int32)) * rank  # this tile's sub's buf columns
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < n_out
        sub = (offs_n >= start1).to(tl.int32) + (offs_n >= start2).to(tl.int32)  # the same for every column here
        local_n = offs_n - tl.where(sub == 0, 0, tl.where(sub == 1, start1, start2))
        offs_s = tl.arange(0, SPLIT_PAD)
        s_ok = offs_s < SPLIT
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        k0 = 0
        while k0 < rank:
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < rank
            ok = n_ok[:, None] & k_ok[None, :]
            w_off = local_n[:, None] * stride_w_n + offs_k[None, :] * stride_w_k
            w = tl.load(w0_ptr + slot * stride_w0_s + w_off, mask=ok & (sub[:, None] == 0), other=0.0)
            if N_SUB > 1:
                w += tl.load(w1_ptr + slot * stride_w1_s + w_off, mask=ok & (sub[:, None] == 1), other=0.0)
            if N_SUB > 2:
                w += tl.load(w2_ptr + slot * stride_w2_s + w_off, mask=ok & (sub[:, None] == 2), other=0.0)
            parts = tl.load(
                in_ptr + offs_s[:, None] * stride_in_s + t * stride_in_t + (col0 + offs_k)[None, :] * stride_in_k,
                mask=s_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            a = tl.sum(parts, axis=0).to(w.dtype).to(tl.float32)
            acc += tl.sum(w.to(tl.float32) * a[None, :], axis=1)
            k0 += BLOCK_K
        out = out_ptr + t * stride_out_t + offs_n * stride_out_n
        prev = tl.load(out, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(out, (prev + acc).to(out_ptr.dtype.element_ty), mask=n_ok)

    @triton.jit
    def _fused_shrink_tile(
        h, x_ptr, a_base, t, offs_r, r_ok, k0, k_in, stride_x_t, stride_x_k, stride_a_r, stride_a_k,
        BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """h += a[offs_r, k0:k0 + BLOCK_K] @ x[t, k0:k0 + BLOCK_K] (one K tile of the fused kernel's shrink)."""
        offs_k = k0 + tl.arange(0, BLOCK_K)[None, :]  # x read as a [1, BLOCK_K] row: A's layout, no conversion
        k_ok = offs_k < k_in
        a = tl.load(a_base + offs_r[:, None] * stride_a_r + offs_k * stride_a_k, mask=r_ok[:, None] & k_ok, other=0.0)
        xv = tl.load(x_ptr + t * stride_x_t + offs_k * stride_x_k, mask=k_ok, other=0.0)
        xv = xv.to(a.dtype).to(tl.float32)
        h += tl.sum(a.to(tl.float32) * xv, axis=1)
        return h

    @triton.jit
    def _bgmv_fused_kernel(
        x_ptr, a_ptr, w0_ptr, w1_ptr, w2_ptr, out_ptr, slots_ptr, num_slots, n_out, k_in, rank, start1, start2,
        stride_x_t, stride_x_k, stride_a_s, stride_a_r, stride_a_k, stride_w0_s, stride_w1_s, stride_w2_s,
        stride_w_n, stride_w_k, stride_out_t, stride_out_n, N_SUB: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """A whole BGMV LoRA delta in one launch: program (t, pid_n) computes h = A_sub[slot(t)] @ x[t] (rank
        values, float32 accumulation, rounded to the weights' dtype) for the one sub its output tile lies in, then
        y[t, tile] += B_sub[slot(t)][tile] @ h. The (up to 3) subs lie side by side in y's columns [0, n_out), sub 1
        from start1, sub 2 from start2 (n_out when absent); BLOCK_N divides both, so a tile is one sub's. Every
        output element is written by one program (plain load-add-store: no atomics, no scratch buffer); rows of
        tokens without an adapter are not touched. The shrink is repeated per tile: cheap for decode-sized steps.
        The tile's B and y are loaded before the shrink, so their round trip overlaps it: a program waits on
        memory about twice (its slot, then everything else at once for hidden sizes up to BLOCK_K)."""
        t = tl.program_id(0).to(tl.int64)
        pid_n = tl.program_id(1)
        slot = tl.load(slots_ptr + t).to(tl.int64)
        if (slot < 0) | (slot >= num_slots):
            return
        n0 = pid_n * BLOCK_N
        sub = (n0 >= start1).to(tl.int32) + (n0 >= start2).to(tl.int32)  # this tile's sub
        w_base = w0_ptr + slot * stride_w0_s
        col0 = n0 * 0
        if N_SUB > 1:
            if sub == 1:
                w_base = w1_ptr + slot * stride_w1_s
                col0 = start1 + n0 * 0
        if N_SUB > 2:
            if sub == 2:
                w_base = w2_ptr + slot * stride_w2_s
                col0 = start2 + n0 * 0
        offs_r = tl.arange(0, BLOCK_R)
        r_ok = offs_r < rank
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < n_out
        w = tl.load(
            w_base + (offs_n - col0)[:, None] * stride_w_n + offs_r[None, :] * stride_w_k,
            mask=n_ok[:, None] & r_ok[None, :],
            other=0.0,
        )
        out = out_ptr + t * stride_out_t + offs_n * stride_out_n
        prev = tl.load(out, mask=n_ok, other=0.0)
        a_base = a_ptr + slot * stride_a_s + (sub * rank).to(tl.int64) * stride_a_r
        h = tl.zeros((BLOCK_R,), dtype=tl.float32)
        if _INTERPRET:  # as _bgmv_k_loop: a while loop under the interpreter, the for loop (scf.for) compiled
            k0 = 0
            while k0 < k_in:
                h = _fused_shrink_tile(
                    h, x_ptr, a_base, t, offs_r, r_ok, k0, k_in, stride_x_t, stride_x_k, stride_a_r, stride_a_k,
                    BLOCK_K,
                )  # fmt: skip
                k0 += BLOCK_K
        else:
            for k0 in range(0, k_in, BLOCK_K):
                h = _fused_shrink_tile(
                    h, x_ptr, a_base, t, offs_r, r_ok, k0, k_in, stride_x_t, stride_x_k, stride_a_r, stride_a_k,
                    BLOCK_K,
                )  # fmt: skip
        h = h.to(w.dtype).to(tl.float32)  # rounded to the weights' dtype, as the two launches do
        acc = tl.sum(w.to(tl.float32) * h[None, :], axis=1)
        tl.store(out, (prev.to(tl.float32) + acc).to(out_ptr.dtype.element_ty), mask=n_ok)


def _uniform_block_n(sizes: list[int], hi: int = 64) -> Optional[int]:
    """The largest power-of-two tile in [16, hi] that divides every sub's size but the last (so no tile of output
    columns straddles two subs), or None."""
    block = hi
    while block >= 16:
        if all(n % block == 0 for n in sizes[:-1]):
            return block
        block //= 2
    return None


def add_lora_bgmv(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: list[torch.Tensor],
    out_offsets: list[int],
    token_slots: torch.Tensor,
    *,
    split_k: Optional[int] = None,
    fused: Optional[bool] = None,
    block_n: Optional[int] = None,
    block_k: Optional[int] = None,
    num_warps: Optional[int] = None,
) -> bool:
    """ops.add_lora for a BGMV step without a memset: ONE launch (``_bgmv_fused_kernel``) for steps of at most
    FUSED_MAX_TOKENS tokens, else two: the shrink stores its split-K partial sums ([split, T, n_sub * r], float32,
    uninitialised: every row a token with an adapter reads is written) and one expand sums them and adds every sub's
    delta. Applies when the step takes BGMV, the (1-3) subs' outputs lie side by side from out_offsets[0], a
    power-of-two tile of 16-64 columns divides every sub boundary and the B's share their row/column strides;
    returns False (nothing done) otherwise, for the caller's shrink + expand.

    ``fused`` forces one launch (True; the rank must be at most FUSED_MAX_RANK) or two (False); ``block_n``,
    ``block_k`` and ``num_warps`` set the fused kernel's tiles and warps (default FUSED_BLOCK_N, FUSED_BLOCK_K and
    FUSED_NUM_WARPS; tests, benchmarks).
    Against lora_shrink + lora_expand(_subs) it drops the zeroing of the shrink's buffer (a memset node per
    projection in a captured graph) and the split-K atomics; the partials are summed in a fixed order."""
    n_sub = len(lora_b)
    num_tokens = x.shape[0]
    if not 1 <= n_sub <= 3 or num_tokens == 0 or _resolve_method(None, num_tokens) != "bgmv":
        return False
    b0 = lora_b[0]
    if any(b.stride()[1:] != b0.stride()[1:] or b.shape[0] != b0.shape[0] or b.shape[2] != b0.shape[2] for b in lora_b):
        return False
    sizes = [b.shape[1] for b in lora_b]
    if any(out_offsets[i] + sizes[i] != out_offsets[i + 1] for i in range(n_sub - 1)):
        return False
    block_64 = _uniform_block_n(sizes)
    rank = b0.shape[2]
    if block_64 is None or x.dim() != 2 or lora_a.dim() != 3 or lora_a.shape[1] != n_sub * rank:
        return False
    if lora_a.shape[2] != x.shape[1] or lora_a.shape[0] != b0.shape[0]:
        raise ValueError(f"lora_a {list(lora_a.shape)} does not fit x {list(x.shape)} and lora_b {list(b0.shape)}")
    n_out = sum(sizes)
    off = out_offsets[0]
    if y.dim() != 2 or y.shape[0] != num_tokens or off < 0 or off + n_out > y.shape[1]:
        raise ValueError(f"y {list(y.shape)} does not hold {num_tokens} rows of columns [{off}, {off + n_out})")
    if split_k is not None and not 1 <= split_k <= MAX_SPLIT_K:
        raise ValueError(f"split_k must lie in [1, {MAX_SPLIT_K}], got {split_k}")
    if fused is None:
        fused = num_tokens <= FUSED_MAX_TOKENS and rank <= FUSED_MAX_RANK
    elif fused and rank > FUSED_MAX_RANK:
        raise ValueError(f"the fused BGMV kernel takes ranks up to {FUSED_MAX_RANK}, got {rank}")
    for name, block in (("block_n", block_n), ("block_k", block_k)):
        if block is not None and (block < 16 or block & (block - 1)):
            raise ValueError(f"{name} must be a power of two of at least 16, got {block}")
    _check_slots(token_slots, num_tokens)
    _check_device(y, x, lora_a, *lora_b, token_slots)
    w = list(lora_b) + [b0] * (3 - n_sub)  # unread past n_sub
    start1 = sizes[0] if n_sub > 1 else n_out
    start2 = sizes[0] + sizes[1] if n_sub > 2 else n_out
    target = y[:, off : off + n_out]
    num_slots, r_all, k_in = lora_a.shape
    if fused:
        block_r = max(2, triton.next_power_of_2(rank))
        widest = max(16, FUSED_TILE_ELEMS // block_r)
        tile_n = _uniform_block_n(sizes, min(block_n or FUSED_BLOCK_N, widest)) or block_64
        tile_k = _pow2_block(k_in, 16, min(block_k or FUSED_BLOCK_K, widest))
        _bgmv_fused_kernel[(num_tokens, triton.cdiv(n_out, tile_n))](
            x, lora_a, w[0], w[1], w[2], target, token_slots, num_slots, n_out, k_in, rank, start1, start2,
            x.stride(0), x.stride(1), *lora_a.stride(), w[0].stride(0), w[1].stride(0), w[2].stride(0),
            b0.stride(1), b0.stride(2), target.stride(0), target.stride(1), N_SUB=n_sub, BLOCK_N=tile_n,
            BLOCK_R=block_r,
            BLOCK_K=tile_k, num_warps=num_warps or FUSED_NUM_WARPS,
        )  # fmt: skip
        return True
    shrink_n = _pow2_block(r_all, 16, 128)
    shrink_k = _pow2_block(k_in, 16, 128)
    tiles = triton.cdiv(r_all, shrink_n)
    split = split_k or _split_k(num_tokens * tiles, k_in, shrink_k)
    parts = torch.empty((split, num_tokens, r_all), dtype=torch.float32, device=x.device)
    _bgmv_shrink_partials_kernel[(num_tokens, tiles, split)](
        x, lora_a, parts, token_slots, num_slots, r_all, k_in, x.stride(0), x.stride(1), *lora_a.stride(),
        *parts.stride(), SPLIT_K=split, BLOCK_N=shrink_n, BLOCK_K=shrink_k, num_warps=4,
    )  # fmt: skip
    _bgmv_expand_partials_kernel[(num_tokens, triton.cdiv(n_out, block_64))](
        parts, w[0], w[1], w[2], target, token_slots, num_slots, n_out, rank, start1, start2, *parts.stride(),
        w[0].stride(0), w[1].stride(0), w[2].stride(0), b0.stride(1), b0.stride(2), target.stride(0),
        target.stride(1), SPLIT=split, SPLIT_PAD=max(2, triton.next_power_of_2(split)), N_SUB=n_sub,
        BLOCK_N=block_64, BLOCK_K=_pow2_block(rank, 16, 64), num_warps=4,
    )  # fmt: skip
    return True


def lora_expand_subs(y: torch.Tensor, buf: torch.Tensor, lora_b: list[torch.Tensor], token_slots: torch.Tensor,
                     out_offset: int) -> bool:  # fmt: skip
    """y[:, out_offset:] += every sub's buf columns @ its B (``lora_expand`` of each sub in turn, in ONE launch)
    when the subs' outputs are adjacent from out_offset, there are at most 3, the step takes BGMV and the B's
    share their row/column strides; returns False (nothing done) otherwise, for the caller's per-sub loop."""
    n_sub = len(lora_b)
    if not 1 < n_sub <= 3 or _resolve_method(None, y.shape[0]) != "bgmv" or y.shape[0] == 0:
        return False
    b0 = lora_b[0]
    if any(b.stride()[1:] != b0.stride()[1:] or b.shape[0] != b0.shape[0] or b.shape[2] != b0.shape[2] for b in lora_b):
        return False
    rank = b0.shape[2]
    if buf.dim() != 2 or buf.shape[1] != n_sub * rank or buf.shape[0] != y.shape[0]:
        return False
    sizes = [b.shape[1] for b in lora_b]
    n_out = sum(sizes)
    if out_offset < 0 or out_offset + n_out > y.shape[1]:
        raise ValueError(f"out_offset {out_offset} + the subs' {n_out} rows exceed y's {y.shape[1]} columns")
    _check_slots(token_slots, y.shape[0])
    _check_device(y, buf, *lora_b, token_slots)
    start1 = sizes[0]
    start2 = sizes[0] + sizes[1] if n_sub == 3 else n_out
    w = list(lora_b) + [b0] * (3 - n_sub)  # unread past n_sub (start2 == n_out)
    target = y[:, out_offset : out_offset + n_out]
    block_n = _pow2_block(n_out, 16, 64)
    block_k = _pow2_block(rank, 16, 64)
    grid = (y.shape[0], triton.cdiv(n_out, block_n))
    _bgmv_expand_subs_kernel[grid](
        buf, w[0], w[1], w[2], target, token_slots, b0.shape[0], n_out, rank, start1, start2,
        buf.stride(0), buf.stride(1), w[0].stride(0), w[1].stride(0), w[2].stride(0), b0.stride(1), b0.stride(2),
        target.stride(0), target.stride(1), BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
    )  # fmt: skip
    return True


def _interpreting() -> bool:
    return bool(envs.TRITON_INTERPRET)


def _check_device(*tensors: torch.Tensor) -> None:
    if not HAS_TRITON:
        raise RuntimeError("the LoRA Triton kernels need the 'triton' package (pip install 'vllm-lite[triton]')")
    device = tensors[0].device
    if any(t.device != device for t in tensors):
        raise ValueError(f"LoRA kernel inputs must share one device, got {sorted({str(t.device) for t in tensors})}")
    if device.type != "cuda" and not _interpreting():
        raise ValueError("the LoRA Triton kernels got CPU tensors: run on CUDA, or set TRITON_INTERPRET=1 first.")


def _check_slots(token_slots: torch.Tensor, num_tokens: int) -> None:
    if token_slots.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"token_slots must be int32 (or int64), got {token_slots.dtype}")
    if token_slots.dim() != 1 or token_slots.shape[0] != num_tokens:
        raise ValueError(f"token_slots must have shape [{num_tokens}], got {list(token_slots.shape)}")


def _pow2_block(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, triton.next_power_of_2(max(n, 1))))


def _split_k(programs: int, k_in: int, block_k: int) -> int:
    """Split the reduction until about TARGET_PROGRAMS run, keeping at least one K tile per split."""
    split = 1
    while programs * split < TARGET_PROGRAMS and split * 2 * block_k <= k_in and split < MAX_SPLIT_K:
        split *= 2
    return split


def _resolve_method(method: Optional[str], num_tokens: int) -> str:
    if method is None:
        return "bgmv" if num_tokens <= BGMV_MAX_TOKENS else "sgmv"
    if method not in ("sgmv", "bgmv"):
        raise ValueError(f"method must be 'sgmv' or 'bgmv', got {method!r}")
    return method


def _launch(
    inp: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    token_slots: torch.Tensor,
    accumulate: bool,
    method: str,
    grouping: Optional[SlotGrouping],
    split_k: Optional[int],
) -> None:
    """out[t, :] (+)= inp[t] @ w[slot(t)]^T through one kernel launch (out may be a column view)."""
    num_tokens, k_in = inp.shape
    num_slots, n_out = w.shape[0], w.shape[1]
    if num_tokens == 0 or num_slots == 0 or n_out == 0:
        return
    strides = (*inp.stride(), *w.stride(), *out.stride())
    if method == "bgmv":
        block_n = _pow2_block(n_out, 16, 64 if accumulate else 128)
        block_k = _pow2_block(k_in, 16, 64 if accumulate else 128)
        programs = num_tokens * triton.cdiv(n_out, block_n)
        split = 1 if accumulate else (split_k or _split_k(programs, k_in, block_k))
        grid = (num_tokens, triton.cdiv(n_out, block_n), split)
        _bgmv_kernel[grid](
            inp,
            w,
            out,
            token_slots,
            num_slots,
            n_out,
            k_in,
            *strides,
            ACCUMULATE=accumulate,
            SPLIT_K=split,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            num_warps=4,
        )
        return
    if grouping is None:
        grouping = _grouping_for(token_slots, num_slots)
    block_m = 16 if num_tokens <= 256 else 32  # upper bound on tiles: sparse slots waste less
    block_n = _pow2_block(n_out, 16, 64 if not accumulate else 128)
    block_k = _pow2_block(k_in, 16, 64 if not accumulate else 32)
    tiles = triton.cdiv(num_tokens, block_m) * triton.cdiv(n_out, block_n)
    split = 1 if accumulate else (split_k or _split_k(tiles, k_in, block_k))
    grid = (tiles, num_slots, split)
    _sgmv_kernel[grid](
        inp,
        w,
        out,
        grouping.sorted_tokens,
        grouping.slot_start,
        grouping.slot_count,
        n_out,
        k_in,
        *strides,
        ACCUMULATE=accumulate,
        SPLIT_K=split,
        W_F32=w.dtype == torch.float32,
        INTERPRET=_interpreting(),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=4,
    )


def lora_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    token_slots: torch.Tensor,
    *,
    grouping: Optional[SlotGrouping] = None,
    method: Optional[str] = None,
    split_k: Optional[int] = None,
) -> torch.Tensor:
    """[T, R] float32: x[t] @ lora_a[slot(t)]^T, zero rows where the slot is -1.

    x [T, in]; lora_a [S, R, in] (R = the max rank, unused rows zero); token_slots [T] int32.
    ``grouping`` (from ``group_tokens_by_slot``), or ``set_step_slots`` once per step, saves the
    per-call sort when many layers share one step; ``method`` forces "sgmv" or "bgmv" and ``split_k`` the reduction split (tests, benchmarks).
    """
    if x.dim() != 2 or lora_a.dim() != 3:
        raise ValueError(f"x must be [T, in] and lora_a [S, R, in], got {list(x.shape)} and {list(lora_a.shape)}")
    if lora_a.shape[2] != x.shape[1]:
        raise ValueError(f"lora_a's input size {lora_a.shape[2]} != x's hidden size {x.shape[1]}")
    _check_slots(token_slots, x.shape[0])
    method = _resolve_method(method, x.shape[0])
    if split_k is not None and not 1 <= split_k <= MAX_SPLIT_K:
        raise ValueError(f"split_k must lie in [1, {MAX_SPLIT_K}], got {split_k}")
    _check_device(x, lora_a, token_slots)
    buf = torch.zeros(x.shape[0], lora_a.shape[1], dtype=torch.float32, device=x.device)
    _launch(x, lora_a, buf, token_slots, False, method, grouping, split_k)
    return buf


def lora_expand(
    y: torch.Tensor,
    buf: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    out_offset: int = 0,
    *,
    grouping: Optional[SlotGrouping] = None,
    method: Optional[str] = None,
) -> None:
    """In place: y[t, off:off + out] += buf[t] @ lora_b[slot(t)]^T, cast to y's dtype; slot -1 rows unchanged.

    y [T, >= off + out]; buf [T, R] (lora_shrink's output); lora_b [S, out, R]. Several projections
    packed in one y (q|k|v, gate|up) take one call each with their ``out_offset``.
    """
    if y.dim() != 2 or buf.dim() != 2 or lora_b.dim() != 3:
        raise ValueError(
            f"y must be [T, N], buf [T, R] and lora_b [S, out, R], got {list(y.shape)}, {list(buf.shape)} "
            f"and {list(lora_b.shape)}"
        )
    if buf.shape[0] != y.shape[0]:
        raise ValueError(f"buf has {buf.shape[0]} rows but y has {y.shape[0]}")
    if lora_b.shape[2] != buf.shape[1]:
        raise ValueError(f"lora_b's rank {lora_b.shape[2]} != buf's rank {buf.shape[1]}")
    if out_offset < 0 or out_offset + lora_b.shape[1] > y.shape[1]:
        raise ValueError(
            f"out_offset {out_offset} + lora_b's output size {lora_b.shape[1]} exceeds y's {y.shape[1]} columns"
        )
    _check_slots(token_slots, y.shape[0])
    method = _resolve_method(method, y.shape[0])
    _check_device(y, buf, lora_b, token_slots)
    target = y[:, out_offset : out_offset + lora_b.shape[1]]
    _launch(buf, lora_b, target, token_slots, True, method, grouping, None)
