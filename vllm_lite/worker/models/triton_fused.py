"""Fused elementwise kernels for the decoder layers on CUDA: RMSNorm (+ residual add), SiLU/GELU-tanh-and-mul,
rotary embedding of q and k (optionally fused with the paged K/V cache write).

On CUDA each of these was a handful of torch kernels per call (a decode step of a 22-layer Llama ran ~34
kernels a layer, most of them tiny elementwise ones); here each is one launch. The CPU keeps its C++ kernels
(csrc/fused_cpu_ops.cpp); layers.py picks the path (`fused_kernel_path`).

Numerics follow the torch code they replace (layers.py), rounding where it rounds: everything is computed in
float32, and for bf16/fp16 the intermediate results torch materialises in the activation dtype are rounded to
it here too (the residual sum; the normalised value before the weight; silu(gate) before the multiply; the
cos/sin table and each rotary product). Compiled without fused multiply-adds (torch rounds each product), only
the order of the sum of squares and, on CUDA, the fast exp and rsqrt differ, so float32 results agree with
torch's to a few ulps (the rotary exactly).

layers.py imports this module on first use (`triton_fused_module()`): importing triton costs ~0.2 s that CPU
runs never pay. Everything a launch needs comes from tensor shapes and strides (no host syncs, outputs from
torch.empty), so the kernels can be captured in CUDA graphs. Runs on CPU only under TRITON_INTERPRET=1 (the
tests).
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

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_NORM_WIDTH = 65536  # one program holds a row; wider rows fall back to torch
ACTIVATIONS = ("silu", "gelu_tanh")


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1)."""
    return bool(envs.TRITON_INTERPRET)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _warps(block: int) -> int:
    return min(16, max(1, block // 256))


def _launch_options() -> dict:
    """No fused multiply-adds when compiled: torch rounds each product (x1 * cos - x2 * sin, x * x), and so do we."""
    return {} if interpreting() else {"enable_fp_fusion": False}


if HAS_TRITON:

    @triton.jit
    def _round(x, dt: tl.constexpr):
        """float32 x rounded to nearest-even in dt (float32, bfloat16 or float16), still as float32. For bf16 done
        on the bits: the interpreter truncates a float32 -> bf16 cast, where CUDA rounds (and torch too)."""
        if dt == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            y = bits.to(tl.float32, bitcast=True)
        elif dt == tl.float16:
            y = x.to(tl.float16).to(tl.float32)
        else:
            y = x
        return y

    @triton.jit
    def _rms_norm_kernel(
        x_ptr,
        res_ptr,
        w_ptr,
        y_ptr,
        res_out_ptr,
        stride_x0,
        stride_x1,
        stride_r,
        stride_y,
        stride_ro,
        n1,  # rows are (i, j), i < T, j < n1: a [T, n1, N] view (per-head norms) or n1 == 1
        N,
        eps,
        HAS_RES: tl.constexpr,
        POST_ADD: tl.constexpr,  # y = res + round(norm): res_ptr holds the addend (Gemma 2's sandwich norms)
        GEMMA: tl.constexpr,  # y = normed * (1 + w), one rounding (Gemma); else round(normed) * w
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        i = row // n1
        j = row % n1
        offs = tl.arange(0, BLOCK)
        ok = offs < N
        dt = y_ptr.dtype.element_ty
        x = tl.load(x_ptr + i * stride_x0 + j * stride_x1 + offs, mask=ok, other=0.0).to(tl.float32)
        if HAS_RES:
            r = tl.load(res_ptr + row * stride_r + offs, mask=ok, other=0.0).to(tl.float32)
            s = _round(x + r, dt)  # torch adds in the activation dtype
            tl.store(res_out_ptr + row * stride_ro + offs, s.to(dt), mask=ok)
            x = s
        var = tl.sum(x * x, axis=0) / N
        normed = x * tl.math.rsqrt(var + eps)
        w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        if GEMMA:
            y = normed * (1.0 + w)
        else:
            y = _round(normed, dt) * w
        if POST_ADD:
            y = _round(y, dt) + tl.load(res_ptr + row * stride_r + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * stride_y + offs, _round(y, dt).to(dt), mask=ok)

    @triton.jit
    def _act_and_mul_kernel(
        x_ptr,
        y_ptr,
        stride_x,
        stride_y,
        D,
        ACT: tl.constexpr,  # 0: silu, 1: gelu (tanh approximation)
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < D
        dt = y_ptr.dtype.element_ty
        g = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + row * stride_x + D + offs, mask=ok, other=0.0).to(tl.float32)
        if ACT == 0:
            a = g / (1.0 + tl.exp(-g))
        else:
            inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
            # 0.5 * g * (1 + tanh(u)) = g * sigmoid(2 u): no cancellation where tanh(u) ~ -1, saturates at +-inf
            a = g / (1.0 + tl.exp(-2.0 * inner))
        a = _round(a, dt)  # torch rounds the activation before the multiply
        tl.store(y_ptr + row * stride_y + offs, _round(a * u, dt).to(dt), mask=ok)

    @triton.jit
    def _rotate_heads(
        src_ptr,  # this token's first head
        dst_ptr,
        cos,
        sin,
        slot,  # int scalar: a negative one writes nothing (padding token)
        HEADS: tl.constexpr,
        HEADS_PAD: tl.constexpr,
        HEAD: tl.constexpr,
        HALF: tl.constexpr,
        HALF_PAD: tl.constexpr,
        COPY_TAIL: tl.constexpr,  # also copy dims [2 * HALF, HEAD) (partial rotary into another buffer)
        HEAD_PAD: tl.constexpr,
    ):
        offs_h = tl.arange(0, HEADS_PAD)
        offs_d = tl.arange(0, HALF_PAD)
        ok = (offs_h[:, None] < HEADS) & (offs_d[None, :] < HALF)
        at = offs_h[:, None] * HEAD + offs_d[None, :]
        dt = dst_ptr.dtype.element_ty
        x1 = tl.load(src_ptr + at, mask=ok, other=0.0)
        x2 = tl.load(src_ptr + at + HALF, mask=ok, other=0.0)
        # torch: x1 * cos - x2 * sin and x2 * cos + x1 * sin, each product rounded to the activation dtype
        a = _round(x1.to(tl.float32) * cos[None, :], dt)
        b = _round(x2.to(tl.float32) * sin[None, :], dt)
        c = _round(x2.to(tl.float32) * cos[None, :], dt)
        d = _round(x1.to(tl.float32) * sin[None, :], dt)
        ok = ok & ((offs_h[:, None] * 0 + slot) >= 0)
        tl.store(dst_ptr + at, _round(a - b, dt).to(dt), mask=ok)
        tl.store(dst_ptr + at + HALF, _round(c + d, dt).to(dt), mask=ok)
        if COPY_TAIL:
            offs_t = tl.arange(0, HEAD_PAD)
            tail_ok = (offs_h[:, None] < HEADS) & (offs_t[None, :] >= 2 * HALF) & (offs_t[None, :] < HEAD)
            tail_at = offs_h[:, None] * HEAD + offs_t[None, :]
            tail = tl.load(src_ptr + tail_at, mask=tail_ok, other=0.0)
            tl.store(dst_ptr + tail_at, tail, mask=tail_ok & ((offs_h[:, None] * 0 + slot) >= 0))

    @triton.jit
    def _rotary_kernel(
        pos_ptr,
        q_ptr,
        k_ptr,
        v_ptr,
        cs_ptr,
        kv_ptr,
        slot_ptr,
        stride_q,
        stride_k,
        stride_v,
        stride_cs,
        kv_half,  # elements from the key half of the cache to the value half
        NUM_Q_HEADS: tl.constexpr,
        NUM_KV_HEADS: tl.constexpr,
        Q_PAD: tl.constexpr,
        KV_PAD: tl.constexpr,
        HEAD: tl.constexpr,
        HEAD_PAD: tl.constexpr,
        HALF: tl.constexpr,  # rotary_dim // 2
        HALF_PAD: tl.constexpr,
        WRITE_KV: tl.constexpr,  # rotated k and v go to the paged cache at slot_mapping (k itself untouched)
    ):
        t = tl.program_id(0).to(tl.int64)
        pos = tl.load(pos_ptr + t).to(tl.int64)
        offs_d = tl.arange(0, HALF_PAD)
        d_ok = offs_d < HALF
        dt = q_ptr.dtype.element_ty
        # torch rotates with the table rounded to the activation dtype
        cos = _round(tl.load(cs_ptr + pos * stride_cs + offs_d, mask=d_ok, other=0.0), dt)
        sin = _round(tl.load(cs_ptr + pos * stride_cs + HALF + offs_d, mask=d_ok, other=0.0), dt)
        q_row = q_ptr + t * stride_q
        _rotate_heads(q_row, q_row, cos, sin, t, NUM_Q_HEADS, Q_PAD, HEAD, HALF, HALF_PAD, False, HEAD_PAD)
        k_row = k_ptr + t * stride_k
        if WRITE_KV:
            slot = tl.load(slot_ptr + t).to(tl.int64)
            dst = kv_ptr + tl.maximum(slot, 0) * (NUM_KV_HEADS * HEAD)  # a negative slot (padding) writes nothing
            _rotate_heads(k_row, dst, cos, sin, slot, NUM_KV_HEADS, KV_PAD, HEAD, HALF, HALF_PAD, True, HEAD_PAD)
            offs_h = tl.arange(0, KV_PAD)
            offs_e = tl.arange(0, HEAD_PAD)
            v_ok = (offs_h[:, None] < NUM_KV_HEADS) & (offs_e[None, :] < HEAD)
            at = offs_h[:, None] * HEAD + offs_e[None, :]
            v = tl.load(v_ptr + t * stride_v + at, mask=v_ok, other=0.0)
            tl.store(dst + kv_half + at, v, mask=v_ok & ((offs_h[:, None] * 0 + slot) >= 0))
        else:
            _rotate_heads(k_row, k_row, cos, sin, t, NUM_KV_HEADS, KV_PAD, HEAD, HALF, HALF_PAD, False, HEAD_PAD)


# ---------------------------------------------------------------------------- host wrappers


def _check_device(x: torch.Tensor) -> None:
    if x.device.type == "cpu" and not interpreting():
        raise ValueError("triton_fused got CPU tensors: run on CUDA, or set TRITON_INTERPRET=1 before importing.")


def rms_norm_supported(x: torch.Tensor, weight: torch.Tensor, residual: Optional[torch.Tensor] = None) -> bool:
    """rms_norm() takes these: a 2-D or 3-D x with packed last dim, a matching weight, a 2-D residual (or post-norm
    addend) like x."""
    n = x.shape[-1]
    if x.dtype not in DTYPES or x.stride(-1) != 1 or x.dim() not in (2, 3) or n > MAX_NORM_WIDTH:
        return False
    if weight.shape != (n,) or weight.stride(0) != 1 or weight.device != x.device:
        return False
    if residual is not None:
        return x.dim() == 2 and residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(-1) == 1
    return True


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: Optional[torch.Tensor] = None,
    gemma: bool = False,
    add: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(norm(x + residual) * w, x + residual) -- or (norm(x) * w, None) without a residual -- in one kernel.

    gemma: * (1 + w) in float32 with one rounding (GemmaRMSNorm) instead of round(norm) * w (RMSNorm).
    The sum is a new tensor (the residual stream's next value); x and residual are left as they are.
    add (instead of a residual): returns (add + norm(x) * w, None), the norm rounded before the add (Gemma 2's
    `hidden + post_norm(out)`)."""
    if residual is not None and add is not None:
        raise ValueError("rms_norm: give residual or add, not both.")
    _check_device(x)
    n = x.shape[-1]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    y2 = y.view(-1, n)
    rows = y2.shape[0]
    new_res = torch.empty_like(y) if residual is not None else None
    if rows == 0:
        return y, new_res
    if x.dim() == 3:
        n1, s0, s1 = x.shape[1], x.stride(0), x.stride(1)
    else:
        n1, s0, s1 = 1, x.stride(0), 0
    block = max(16, _next_pow2(n))
    r = residual if residual is not None else add if add is not None else x
    ro = new_res if new_res is not None else y
    _rms_norm_kernel[(rows,)](
        x,
        r,
        weight,
        y,
        ro,
        s0,
        s1,
        r.stride(0),
        n,
        n if new_res is not None else 0,
        n1,
        n,
        float(eps),
        HAS_RES=residual is not None,
        POST_ADD=add is not None,
        GEMMA=bool(gemma),
        BLOCK=block,
        num_warps=_warps(block),
        **_launch_options(),
    )
    return y, new_res


def act_and_mul_supported(x: torch.Tensor) -> bool:
    return x.dtype in DTYPES and x.dim() == 2 and x.stride(-1) == 1 and x.shape[-1] % 2 == 0


def act_and_mul(x: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """act(x[:, :d]) * x[:, d:] for x [T, 2d] (a fused gate_up output): silu or gelu_tanh, one kernel."""
    if act not in ACTIVATIONS:
        raise ValueError(f"act must be one of {ACTIVATIONS}, got {act!r}.")
    _check_device(x)
    t, d = x.shape[0], x.shape[1] // 2
    y = torch.empty((t, d), dtype=x.dtype, device=x.device)
    if t == 0 or d == 0:
        return y
    block = min(1024, max(16, _next_pow2(d)))
    _act_and_mul_kernel[(t, triton.cdiv(d, block))](
        x,
        y,
        x.stride(0),
        y.stride(0),
        d,
        ACT=ACTIVATIONS.index(act),
        BLOCK=block,
        num_warps=_warps(block),
        **_launch_options(),
    )
    return y


def rotary_supported(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_dim: int,
    rotary_dim: int,
) -> bool:
    """rotary() takes these: 2-D q/k of whole heads with packed last dims, one dtype; an int positions vector;
    a float32 [P, rotary_dim] table; an even rotary_dim <= head_dim."""
    return (
        query.dtype in DTYPES
        and key.dtype == query.dtype
        and query.dim() == 2
        and key.dim() == 2
        and query.stride(-1) == 1
        and key.stride(-1) == 1
        and query.shape[1] % head_dim == 0
        and key.shape[1] % head_dim == 0
        and key.shape[0] == query.shape[0]
        and positions.dim() == 1
        and positions.shape[0] >= query.shape[0]
        and positions.dtype in (torch.int64, torch.int32)
        and cos_sin_cache.dtype == torch.float32
        and cos_sin_cache.dim() == 2
        and cos_sin_cache.stride(-1) == 1
        and cos_sin_cache.shape[1] == rotary_dim
        and rotary_dim % 2 == 0
        and 0 < rotary_dim <= head_dim
    )


def _launch_rotary(positions, query, key, value, cos_sin_cache, head_dim, rotary_dim, kv_cache, slot_mapping):
    t = query.shape[0]
    if t == 0:
        return
    hq, hk = query.shape[1] // head_dim, key.shape[1] // head_dim
    write = kv_cache is not None
    _rotary_kernel[(t,)](
        positions,
        query,
        key,
        value if write else key,
        cos_sin_cache,
        kv_cache if write else key,
        slot_mapping if write else positions,
        query.stride(0),
        key.stride(0),
        value.stride(0) if write else 0,
        cos_sin_cache.stride(0),
        kv_cache.stride(0) if write else 0,
        NUM_Q_HEADS=hq,
        NUM_KV_HEADS=hk,
        Q_PAD=_next_pow2(hq),
        KV_PAD=_next_pow2(hk),
        HEAD=head_dim,
        HEAD_PAD=max(16, _next_pow2(head_dim)),
        HALF=rotary_dim // 2,
        HALF_PAD=max(16, _next_pow2(rotary_dim // 2)),
        WRITE_KV=write,
        num_warps=4,
        **_launch_options(),
    )


def rotary(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_dim: int,
    rotary_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """NeoX rotary (rotate halves of the first rotary_dim of each head) of query [T, H*D] and key [T, KVH*D],
    in place, one kernel; returns them. positions: [>= T] rows of cos_sin_cache ([P, rotary_dim]: cos | sin)."""
    _check_device(query)
    _launch_rotary(positions, query, key, None, cos_sin_cache, head_dim, rotary_dim, None, None)
    return query, key


def rotary_write_kv_supported(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> bool:
    """rotary_write_kv() takes these: v like k, a contiguous [2, blocks, block_size, KVH, D] cache of k's dtype."""
    return (
        value.shape == key.shape
        and value.dtype == key.dtype
        and value.stride(-1) == 1
        and kv_cache.dtype == key.dtype
        and kv_cache.dim() == 5
        and kv_cache.is_contiguous()
        and kv_cache.shape[3] * kv_cache.shape[4] == key.shape[1]
        and slot_mapping.dim() == 1
        and slot_mapping.shape[0] >= key.shape[0]
    )


def rotary_write_kv(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_dim: int,
    rotary_dim: int,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """rotary() of query (in place) and of key, whose rotated rows go with value's straight into the paged
    cache (token t at slot_mapping[t]; a negative slot writes nothing), all in one kernel. key itself is not
    changed. Returns query."""
    _check_device(query)
    head = kv_cache.shape[4]
    if head != head_dim:
        raise ValueError(f"kv_cache head_size {head} != head_dim {head_dim}.")
    _launch_rotary(positions, query, key, value, cos_sin_cache, head_dim, rotary_dim, kv_cache, slot_mapping)
    return query
