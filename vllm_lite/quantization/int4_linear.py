"""The int4 linear method: a quantized layer's parameters, how checkpoint shards load into them, its forward.

A layer holds its weight as int4 the whole time. Loading keeps the checkpoint's own layout (AWQ GEMM or
GPTQ), so merged layers (q/k/v, gate/up) concatenate their projections along N (packed N for AWQ's
qweight and both formats' qzeros) and tensor parallelism slices N (column) or K (row, whole groups) as
it slices float weights. After loading, `process_weights_after_loading` picks the forward:

* CUDA with the Triton kernels importable: the checkpoint layout stays, `awq_gemm` / `gptq_gemm` run.
* Otherwise (CPU): the weight is repacked once to [N, K/8] int32 (packed along K, in order) with zeros
  [N, G] uint8 and scales [N, G] in the checkpoint's dtype. A forward of more than SMALL_M_MAX rows
  (prefill) dequantizes it into one buffer shared by all layers (in the compute dtype, [N, K] as F.linear
  takes it) then calls F.linear: the dequantized values equal `dequantize_awq` / `dequantize_gptq` bit for
  bit, so it computes exactly what the same model with the dequantized weights in float32 computes. A
  forward of at most SMALL_M_MAX rows (decode) runs csrc's direct kernel (`int4_linear_small_m`), which
  multiplies the packed nibbles into x without writing the weight out: the same weight values, summed in
  another order (close to, not bit-equal with, F.linear). Act-order layers (a real g_idx) always dequantize.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from vllm_lite.quantization.packing import (
    AWQ_ORDER,
    GPTQ_ZERO_OFFSET,
    PACK_FACTOR,
    SEQUENTIAL_ORDER,
    pack_cols,
    unpack_cols,
    unpack_rows,
)
from vllm_lite.quantization.quant_config import QuantizationConfig

logger = logging.getLogger(__name__)

QUANT_PARAMS = ("qweight", "qzeros", "scales", "g_idx")

_current: list[Optional[QuantizationConfig]] = [None]


@contextlib.contextmanager
def quantized_linears(config: Optional[QuantizationConfig]) -> Iterator[None]:
    """Build the model's parallel linear layers int4 (with `config`) while this is entered."""
    saved = _current[0]
    _current[0] = config
    try:
        yield
    finally:
        _current[0] = saved


def current_quant_method() -> Optional["Int4LinearMethod"]:
    """The method for a linear layer being built now (None: a plain float layer)."""
    config = _current[0]
    return None if config is None else Int4LinearMethod(config)


@dataclass(frozen=True)
class _Layout:
    """Where one checkpoint tensor's N and K lie: dim and how many columns/rows one element covers."""

    n_dim: Optional[int]
    n_unit: int
    k_dim: Optional[int]  # None: not split along K (replicated on every row-parallel rank)
    k_unit: int


def _layouts(config: QuantizationConfig, group: int, k_split_groups: bool) -> dict[str, _Layout]:
    gk = 0 if k_split_groups else None
    if config.quant_method == "awq":
        return {
            "qweight": _Layout(1, PACK_FACTOR, 0, 1),
            "qzeros": _Layout(1, PACK_FACTOR, gk, group),
            "scales": _Layout(1, 1, gk, group),
        }
    return {
        "qweight": _Layout(1, 1, 0, PACK_FACTOR),
        "qzeros": _Layout(1, PACK_FACTOR, gk, group),
        "scales": _Layout(1, 1, gk, group),
        "g_idx": _Layout(None, 1, 0, 1),
    }


class Int4LinearMethod:
    """AWQ/GPTQ int4 weights for one linear layer (vLLM's `quant_method`): create, load, post-process, apply."""

    def __init__(self, config: QuantizationConfig) -> None:
        self.config = config

    # ------------------------------------------------------------------ parameters

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, input_size_full: int) -> None:
        """Register the checkpoint-shaped int4 parameters for this rank's [out_features, in_features] slice."""
        c = self.config
        group = input_size_full if c.group_size == -1 else c.group_size
        # Row-parallel ranks hold whole groups of K; act-order and single-group layers keep every group.
        k_split = in_features != input_size_full and c.group_size != -1 and not c.desc_act
        what = f"{c.quant_method} layer [{out_features} x {in_features}]"
        if out_features % PACK_FACTOR:
            raise ValueError(f"{what}: output size per rank must be a multiple of {PACK_FACTOR}.")
        if input_size_full % group or (k_split and in_features % group):
            raise ValueError(
                f"{what}: group_size={c.group_size} must divide the input size per rank ({in_features}) "
                "and in all; lower tensor_parallel_size."
            )
        if in_features % PACK_FACTOR:
            raise ValueError(f"{what}: input size per rank must be a multiple of {PACK_FACTOR}.")
        groups = (in_features if k_split else input_size_full) // group
        layer.group = group
        layer.input_size_full = input_size_full
        layer.layouts = _layouts(c, group, k_split)
        n8 = out_features // PACK_FACTOR
        if c.quant_method == "awq":
            shapes = {"qweight": (in_features, n8), "qzeros": (groups, n8), "scales": (groups, out_features)}
        else:
            shapes = {
                "qweight": (in_features // PACK_FACTOR, out_features),
                "qzeros": (groups, n8),
                "scales": (groups, out_features),
                "g_idx": (in_features,),
            }
        for name, shape in shapes.items():
            # Scales load as float32 (exact for float16/bfloat16) and keep that dtype while the model's
            # floating tensors take the compute dtype; they go back to the checkpoint's dtype after loading.
            dtype = torch.float32 if name == "scales" else torch.int32
            p = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
            p.keep_dtype = True
            layer.register_parameter(name, p)
        layer.scales_dtype = None  # the checkpoint's, learnt when the scales load
        layer.g_idx_shards: set[Any] = set()

    # ------------------------------------------------------------------ loading

    def load(
        self,
        layer: nn.Module,
        param: torch.Tensor,
        loaded: Any,
        read_shard: Callable[..., torch.Tensor],
        n_range: Optional[tuple[int, int, int]] = None,
        k_start: Optional[int] = None,
        shard_id: Any = None,
    ) -> None:
        """Copy one checkpoint tensor (or this rank's part of it) into `param`.

        n_range = (offset in this layer's columns, first source column, number of columns) for merged or
        column-parallel layers; k_start = this rank's first input row for row-parallel ones."""
        name = next((n for n in QUANT_PARAMS if getattr(layer, n, None) is param), None)
        if name is None:
            raise ValueError(f"{type(layer).__name__}: {tuple(param.shape)} is not one of its int4 parameters.")
        lay = layer.layouts[name]
        dst = param.data
        src_dims: dict[int, tuple[int, int]] = {}
        if n_range is not None and lay.n_dim is not None:
            off, start, size = n_range
            if off % lay.n_unit or start % lay.n_unit or size % lay.n_unit:
                raise ValueError(
                    f"{name}: a shard of {size} columns at {start} is not whole packed words of {lay.n_unit}."
                )
            dst = dst.narrow(lay.n_dim, off // lay.n_unit, size // lay.n_unit)
            src_dims[lay.n_dim] = (start // lay.n_unit, size // lay.n_unit)
        if k_start is not None and lay.k_dim is not None:
            if k_start % lay.k_unit:
                raise ValueError(f"{name}: row shard at {k_start} is not a whole number of groups/words.")
            src_dims[lay.k_dim] = (k_start // lay.k_unit, dst.shape[lay.k_dim])
        src = _read(loaded, src_dims, read_shard)
        if src.shape != dst.shape:
            raise ValueError(
                f"{name}: checkpoint shape {tuple(src.shape)} does not match model shape {tuple(dst.shape)}."
            )
        if name == "scales":
            if not src.dtype.is_floating_point:
                raise ValueError(f"scales must be floating point, got {src.dtype}.")
            layer.scales_dtype = src.dtype
        elif src.dtype.is_floating_point:
            raise ValueError(f"{name} must be an integer tensor, got {src.dtype}.")
        if name == "g_idx":
            src = src.to(torch.int32)
            if layer.layouts["scales"].k_dim is not None and k_start is not None:
                src = src - k_start // layer.group  # this rank's groups are numbered from 0
            if layer.g_idx_shards and not torch.equal(dst, src):
                raise ValueError(
                    f"g_idx of shard {shard_id!r} differs from the other projections fused with it; "
                    "fused projections (q/k/v, gate/up) must share one act-order."
                )
            layer.g_idx_shards.add(shard_id)
        with torch.no_grad():
            dst.copy_(src)

    # ------------------------------------------------------------------ after loading

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Choose the forward: Triton kernels on CUDA (checkpoint layout), else the CPU dequantize layout."""
        c = self.config
        device = layer.qweight.device
        scales_dtype = layer.scales_dtype or torch.float16
        layer.scales.data = layer.scales.data.to(scales_dtype)
        if c.quant_method == "gptq":
            g = layer.g_idx.data.long()
            groups = layer.scales.shape[0]
            if int(g.min()) < 0 or int(g.max()) >= groups:
                raise ValueError(f"g_idx values must lie in [0, {groups}); got [{int(g.min())}, {int(g.max())}].")
        layer.triton = _kernels_for(device)
        if layer.triton is not None:
            self._prepare_triton(layer)
            return
        q, z, s, g_idx = checkpoint_to_nk(c, layer.qweight.data, layer.qzeros.data, layer.scales.data, _g(layer))
        n, k = q.shape
        for name in QUANT_PARAMS:
            if name in layer._parameters:
                del layer._parameters[name]
        layer.register_buffer("qweight_nk", pack_cols(q).contiguous(), persistent=False)
        layer.register_buffer("zeros_ng", z.to(torch.uint8).contiguous(), persistent=False)
        layer.register_buffer("scales_ng", s.contiguous(), persistent=False)
        # A g_idx of k // group is the plain grouping: drop it and broadcast groups instead of gathering.
        plain = g_idx is None or torch.equal(g_idx, torch.arange(k, device=g_idx.device) // (k // z.shape[1]))
        layer.register_buffer("g_idx_k", None if plain else g_idx.long(), persistent=False)

    def _prepare_triton(self, layer: nn.Module) -> None:
        """GPTQ: a plain g_idx becomes None (the kernel's one-group-per-tile path); an act-order one has its
        rows sorted by group once (x's columns are gathered per call instead), as exllama does."""
        layer.act_perm = None
        if self.config.quant_method != "gptq":
            return
        g = layer.g_idx.data
        groups = layer.scales.shape[0]
        k = g.shape[0]
        if torch.equal(g.long(), torch.arange(k, device=g.device) // (k // groups)):
            layer.g_idx_kernel = None
            return
        layer.g_idx_kernel = g
        from vllm_lite.quantization.triton_int4 import sort_gptq_act_order

        sorted_ = sort_gptq_act_order(layer.qweight.data, g, groups)
        if sorted_ is not None:
            layer.qweight.data, layer.act_perm = sorted_[0], sorted_[1]
            layer.g_idx_kernel = None

    # ------------------------------------------------------------------ forward

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """y = x W^T (+ bias) with W from the int4 weight."""
        if layer.triton is not None:
            return self._apply_triton(layer, x, bias)
        y = small_m_linear(layer, x, bias)
        if y is not None:
            return y
        w = dequantize_nk(layer, x.dtype)
        return F.linear(x, w, bias)

    def _apply_triton(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        awq_gemm, gptq_gemm = layer.triton
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.config.quant_method == "awq":
            y = awq_gemm(x2, layer.qweight, layer.qzeros, layer.scales, layer.group)
        else:
            if layer.act_perm is not None:
                x2 = x2.index_select(1, layer.act_perm)
            y = gptq_gemm(
                x2,
                layer.qweight,
                layer.qzeros,
                layer.scales,
                layer.g_idx_kernel,
                4,
                checkpoint_format=self.config.checkpoint_format,
                group_size=None if layer.g_idx_kernel is not None else layer.group,
            )
        y = y.to(x.dtype)
        if bias is not None:
            y = y + bias
        return y.view(*shape[:-1], -1)


def _g(layer: nn.Module) -> Optional[torch.Tensor]:
    return layer.g_idx.data if "g_idx" in layer._parameters else None


def _read(loaded: Any, dims: dict[int, tuple[int, int]], read_shard: Callable[..., torch.Tensor]) -> torch.Tensor:
    """Read only the part of `loaded` given by {dim: (start, size)} (the first dim lazily from disk)."""
    if not dims:
        return read_shard(loaded)
    items = sorted(dims.items())
    (d0, (s0, n0)), rest = items[0], items[1:]
    t = read_shard(loaded, d0, s0, n0)
    for d, (s, n) in rest:
        t = t.narrow(d, s, n)
    return t


def checkpoint_to_nk(
    config: QuantizationConfig,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Checkpoint tensors -> (q [N, K] in 0..15, zeros [N, G] int32, scales [N, G], g_idx [K] or None)."""
    if config.quant_method == "awq":
        q = unpack_cols(qweight, AWQ_ORDER)  # [K, N]
        z = unpack_cols(qzeros, AWQ_ORDER)
    else:
        q = unpack_rows(qweight)
        z = unpack_cols(qzeros, SEQUENTIAL_ORDER) + GPTQ_ZERO_OFFSET[config.checkpoint_format]
    return q.t().contiguous(), z.t().contiguous(), scales.t().contiguous(), g_idx


_SHIFTS: dict[torch.device, torch.Tensor] = {}
_BUFFERS: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _shifts(device: torch.device) -> torch.Tensor:
    if device not in _SHIFTS:
        _SHIFTS[device] = torch.arange(0, 32, 4, dtype=torch.int32, device=device)
    return _SHIFTS[device]


def _buffer(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One dequantization buffer per (dtype, device), grown to the largest layer and reused by all."""
    buf = _BUFFERS.get((dtype, device))
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=dtype, device=device)
        _BUFFERS[(dtype, device)] = buf
    return buf[:numel]


# torch.ops.vllm_lite.int4_dequant_nk (csrc/int4_cpu.cpp) once the worker has loaded the CPU kernels.
_NATIVE: list[Optional[Callable[..., None]]] = [None]
# torch.ops.vllm_lite.int4_linear_small_m, registered alongside it (None: small forwards dequantize too).
_SMALL_M: list[Optional[Callable[..., torch.Tensor]]] = [None]
_NATIVE_DTYPES = (torch.float32, torch.bfloat16)

# Forwards of at most this many rows run the direct kernel, larger ones dequantize + F.linear. Measured
# (benchmarks/int4.py --layers-only --num-threads 1, the bench Qwen2's four layer shapes, AVX2 Zen 3, load ~2.3):
# the direct kernel is 5-7x faster than dequantize + F.linear at m=1, 2.2-3x at m=8, 1.25-1.7x at m=16 and
# about even at m=24 (its cost grows linearly with m past ~4 rows; dequantization's is fixed).
SMALL_M_MAX = 16


def set_native_dequantize(op: Optional[Callable[..., None]]) -> None:
    """Use `op(out, qweight_nk, zeros_ng, scales_ng, g_idx)` for CPU dequantization (None: the torch ops),
    and with it the library's direct small-m kernel when that library has one."""
    _NATIVE[0] = op
    small = None
    if op is not None:
        try:
            small = torch.ops.vllm_lite.int4_linear_small_m
        except (AttributeError, RuntimeError):  # a library built from sources without the kernel
            small = None
    _SMALL_M[0] = small


def small_m_linear(layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """x W^T (+ bias) by the direct kernel when x has at most SMALL_M_MAX rows and the layer suits it (CPU,
    plain groups, float32/bfloat16); None: dequantize instead."""
    op = _SMALL_M[0]
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if (
        op is None
        or rows == 0
        or rows > SMALL_M_MAX
        or layer.g_idx_k is not None
        or x.device.type != "cpu"
        or x.dtype not in _NATIVE_DTYPES
    ):
        return None
    y = op(x.reshape(rows, k), layer.qweight_nk, layer.zeros_ng, layer.scales_ng, bias)
    return y.view(*x.shape[:-1], y.shape[-1])


def dequantize_nk(
    layer: nn.Module, dtype: torch.dtype, out: Optional[torch.Tensor] = None, native: bool = True
) -> torch.Tensor:
    """The layer's weight [N, K] in `dtype`, dequantized from its CPU layout into the shared buffer (or `out`).

    Computed as (q - z) * s in float32, which is exact, then stored in `dtype`: the reference's values.
    The native kernel (one pass, 5-9x faster than the torch ops here) computes the same values bit for bit."""
    qw, z, s = layer.qweight_nk, layer.zeros_ng, layer.scales_ng
    n, k = qw.shape[0], qw.shape[1] * PACK_FACTOR
    if out is None:
        out = _buffer(n * k, dtype, qw.device).view(n, k)
    op = _NATIVE[0]
    if native and op is not None and qw.device.type == "cpu" and dtype in _NATIVE_DTYPES:
        op(out, qw, z, s, layer.g_idx_k)
        return out
    q = (qw.unsqueeze(-1) >> _shifts(qw.device)).bitwise_and_(0xF).view(n, k)
    g_idx = layer.g_idx_k
    if g_idx is None:
        groups = z.shape[1]
        diff = q.view(n, groups, k // groups).sub_(z.unsqueeze(-1))
        torch.mul(diff, s.float().unsqueeze(-1), out=out.view(n, groups, k // groups))
    else:
        diff = q.sub_(z.index_select(1, g_idx))
        torch.mul(diff, s.float().index_select(1, g_idx), out=out)
    return out


def _kernels_for(device: torch.device) -> Optional[tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]]]:
    """The fused int4 matmuls for layers on `device`: Triton's on CUDA, none elsewhere (dequantize instead)."""
    return _triton_kernels() if device.type == "cuda" else None


def _triton_kernels() -> Optional[tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]]]:
    """(awq_gemm, gptq_gemm) from the Triton module when it imports here, else None (logged once)."""
    try:
        from vllm_lite.quantization.triton_int4 import awq_gemm, gptq_gemm
    except Exception as e:  # noqa: BLE001 -- any import failure means: dequantize instead
        if not getattr(_triton_kernels, "warned", False):
            logger.warning("int4 Triton kernels unavailable (%s); CUDA int4 layers dequantize per forward", e)
            _triton_kernels.warned = True  # type: ignore[attr-defined]
        return None
    return awq_gemm, gptq_gemm


def quantized_weight_bytes(module: nn.Module) -> tuple[int, int]:
    """(bytes held by int4 layers' tensors, number of weights they stand for) under `module`."""
    held = weights = 0
    for m in module.modules():
        if getattr(m, "quant_method", None) is None:
            continue
        weights += m.in_features * m.out_features
        for t in list(m.parameters(recurse=False)) + list(m.buffers(recurse=False)):
            if t is not getattr(m, "bias", None):
                held += t.numel() * t.element_size()
    return held, weights
