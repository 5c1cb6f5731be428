"""Grouped expert matmuls on CUDA in one Triton kernel per projection (the fused-MoE layer's GPU path).

Token-expert pairs are sorted by expert and each expert's run padded to a multiple of BLOCK_M, all on
the device (no host sync, so it stays capturable): a program owns BLOCK_M pairs of ONE expert and a
BLOCK_N slice of the output, gathers its rows of the input by pair (or by token for the first
projection) and multiplies by that expert's weight tile. Two launches: x -> [gate | up] per pair,
then silu(gate) * up -> down per pair scaled by the routing weight; the k pairs of each token are
summed after. Programs past the last expert's run do nothing (the grid is an upper bound).

Runs on CPU only under TRITON_INTERPRET=1 (the tests). Float32 inputs use exact ("ieee") dots.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_lite import envs

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is absent
    HAS_TRITON = False

BLOCK_M = 16


def align_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs [P], block_expert [P / block_m]) with P an upper bound known without a host sync.

    sorted_pairs holds pair indices (t * k + j) grouped by expert, each expert's run padded with the
    sentinel T * k to a multiple of block_m; block_expert[b] is the expert of block b, or -1 past the end.
    """
    flat = topk_ids.reshape(-1)
    n = flat.numel()
    device = flat.device
    # scatter_add, not bincount: CUDA's bincount reads the largest id back to the host (a sync that also
    # breaks CUDA-graph capture).
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(
        0, flat.long(), torch.ones_like(flat, dtype=torch.int64)
    )
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    count_start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    dest = padded_start[expert_of] + torch.arange(n, device=device) - count_start[expert_of]
    capacity = (n + num_experts * (block_m - 1) + block_m - 1) // block_m * block_m
    sorted_pairs = torch.full((capacity,), n, dtype=torch.int64, device=device)
    sorted_pairs[dest] = order
    block_start = torch.arange(0, capacity, block_m, device=device)
    block_expert = torch.searchsorted(padded_end, block_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, torch.full_like(block_expert, -1))
    return sorted_pairs, block_expert


if HAS_TRITON:
    # The kernel's loop over K takes a different form under the interpreter (see _expert_gemm). A global
    # constexpr rather than a parameter: Triton picks its interpreter for the whole process at import anyway.
    _INTERPRET = tl.constexpr(bool(envs.TRITON_INTERPRET))

    @triton.jit
    def _expert_k_tile(
        acc, a_ptr, w_ptr, rows, row_ok, expert, offs_n, n_ok, k0, k_in,
        stride_am, stride_we, stride_wn, stride_wk, IEEE: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """acc += a[rows, k0:k0 + BLOCK_K] @ w[expert, offs_n, k0:k0 + BLOCK_K]^T (one K tile, inlined)."""
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < k_in
        a = tl.load(
            a_ptr + rows[:, None] * stride_am + offs_k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0
        )
        w = tl.load(
            w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk,
            mask=k_ok[:, None] & n_ok[None, :],
            other=0.0,
        )
        if IEEE:
            acc += tl.dot(a, w, input_precision="ieee")
        else:
            acc += tl.dot(a, w)
        return acc

    @triton.jit(do_not_specialize=["num_pairs"])  # tokens x top_k changes every step: no compile per new kind
    def _expert_gemm(
        a_ptr,
        w_ptr,
        c_ptr,
        sorted_pairs_ptr,
        block_expert_ptr,
        pair_weight_ptr,
        num_pairs,
        n_out,
        k_in,
        top_k,
        stride_am,
        stride_we,
        stride_wn,
        stride_wk,
        stride_cm,
        A_BY_TOKEN: tl.constexpr,
        SCALE: tl.constexpr,
        IEEE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """c[pair, n] = sum_k a[row(pair), k] * w[e, n, k] (* weight[pair]) for this block's pairs of expert e."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        expert = tl.load(block_expert_ptr + pid_m)
        if expert < 0:
            return
        pairs = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        row_ok = pairs < num_pairs
        rows = pairs // top_k if A_BY_TOKEN else pairs
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < n_out
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if _INTERPRET:
            # Triton 3.6's interpreter keeps scalars as 1-element arrays that range() cannot take as a
            # bound; a while loop only needs their truth value. Compiled, the for loop stays (scf.for).
            k0 = 0
            while k0 < k_in:
                acc = _expert_k_tile(
                    acc, a_ptr, w_ptr, rows, row_ok, expert, offs_n, n_ok, k0, k_in,
                    stride_am, stride_we, stride_wn, stride_wk, IEEE, BLOCK_K,
                )  # fmt: skip
                k0 += BLOCK_K
        else:
            for k0 in range(0, k_in, BLOCK_K):
                acc = _expert_k_tile(
                    acc, a_ptr, w_ptr, rows, row_ok, expert, offs_n, n_ok, k0, k_in,
                    stride_am, stride_we, stride_wn, stride_wk, IEEE, BLOCK_K,
                )  # fmt: skip
        if SCALE:
            acc = acc * tl.load(pair_weight_ptr + pairs, mask=row_ok, other=0.0)[:, None]
        tl.store(
            c_ptr + pairs[:, None] * stride_cm + offs_n[None, :],
            acc.to(c_ptr.dtype.element_ty),
            mask=row_ok[:, None] & n_ok[None, :],
        )


def _launch(a, w, c, sorted_pairs, block_expert, pair_weights, top_k, by_token, scale) -> None:
    n_out, k_in = w.shape[1], w.shape[2]
    block_n = 64 if n_out >= 64 else 32
    block_k = 32
    grid = (block_expert.numel(), triton.cdiv(n_out, block_n))
    _expert_gemm[grid](
        a,
        w,
        c,
        sorted_pairs,
        block_expert,
        pair_weights,
        c.shape[0],
        n_out,
        k_in,
        top_k,
        a.stride(0),
        w.stride(0),
        w.stride(1),
        w.stride(2),
        c.stride(0),
        A_BY_TOKEN=by_token,
        SCALE=scale,
        IEEE=a.dtype == torch.float32,
        BLOCK_M=BLOCK_M,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )


def triton_grouped_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """Same result as fused_moe.grouped_experts, computed by the Triton kernel (x, w13, w2 contiguous)."""
    t, k = topk_ids.shape
    num_experts, two_i, h = w13.shape
    if t == 0:
        return torch.zeros_like(x)
    sorted_pairs, block_expert = align_pairs(topk_ids, num_experts, BLOCK_M)
    pair_weights = topk_weights.reshape(-1).float().contiguous()
    gate_up = torch.empty(t * k, two_i, dtype=x.dtype, device=x.device)
    _launch(x, w13, gate_up, sorted_pairs, block_expert, pair_weights, k, True, False)
    inter = two_i // 2
    act = (F.silu(gate_up[:, :inter]) * gate_up[:, inter:]).contiguous()
    # Scaled and stored in float32, summed over the k experts of each token, cast once.
    down = torch.empty(t * k, h, dtype=torch.float32, device=x.device)
    _launch(act, w2, down, sorted_pairs, block_expert, pair_weights, k, False, True)
    return down.view(t, k, h).sum(dim=1).to(x.dtype)
