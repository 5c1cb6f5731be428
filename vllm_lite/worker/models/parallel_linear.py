"""Tensor-parallel linear layers (Megatron split) and the shard-aware weight loading they need.

* Column-parallel: each rank holds a slice of the output rows; no collective.
* Row-parallel: each rank holds a slice of the input columns; partial outputs
  are summed with one all-reduce, then the (replicated) bias is added once.
* Merged / QKV: several HF projections fused in one column-parallel weight;
  each rank's weight is [its slice of q | its slice of k | its slice of v]
  (or [gate slice | up slice]), so per-rank outputs split exactly like TP=1's.

At TP=1 each layer is a plain nn.Linear (same forward, no collective).
Built inside `quantized_linears(config)` (the model loader does this for AWQ/GPTQ checkpoints), a layer
holds an int4 weight instead (vLLM's `quant_method`: vllm_lite/quantization/int4_linear.py): its
qweight/qzeros/scales(/g_idx) load shard by shard as the float weight would, and forward(x) -> y keeps
its signature, so wrappers (LoRA) call it the same way.
`loaded` in the loaders is a whole tensor or a lazy safetensors slice: only
this rank's rows/columns are read from disk.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch import nn

from vllm_lite.quantization.int4_linear import Int4LinearMethod, current_quant_method
from vllm_lite.worker.models.cpu_prepack import linear
from vllm_lite.worker.parallel_state import get_tp_rank, get_tp_size, tensor_model_parallel_all_reduce

# ---------------------------------------------------------------------------- reading checkpoint shards


def loaded_shape(loaded: Any) -> tuple[int, ...]:
    """Shape of a tensor or of a lazy safetensors slice."""
    if isinstance(loaded, torch.Tensor):
        return tuple(loaded.shape)
    return tuple(loaded.get_shape())


def read_shard(loaded: Any, dim: Optional[int] = None, start: int = 0, size: Optional[int] = None) -> torch.Tensor:
    """`loaded` (whole, or rows/cols [start, start+size) along dim) as a tensor, reading only that part."""
    if dim is None:
        return loaded if isinstance(loaded, torch.Tensor) else loaded[:]
    shape = loaded_shape(loaded)
    if size is None:
        size = shape[dim] - start
    if start < 0 or start + size > shape[dim]:
        raise ValueError(f"shard [{start}, {start + size}) is out of range for dim {dim} of shape {shape}.")
    if isinstance(loaded, torch.Tensor):
        return loaded.narrow(dim, start, size)
    index: list[slice] = [slice(None)] * len(shape)
    index[dim] = slice(start, start + size)
    return loaded[tuple(index)]


def copy_checked(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"{what}: checkpoint shape {tuple(src.shape)} does not match model shape {tuple(dst.shape)}.")
    dst.copy_(src)


def _divide(total: int, tp: int, what: str) -> int:
    if total % tp:
        raise ValueError(f"{what}={total} is not divisible by tensor_parallel_size={tp}.")
    return total // tp


# ---------------------------------------------------------------------------- column / row parallel


def _init_linear(layer: nn.Linear, in_features: int, out_features: int, bias: bool, input_size_full: int) -> None:
    """nn.Linear's init, or (inside quantized_linears) an int4 weight in place of `weight`."""
    method: Optional[Int4LinearMethod] = current_quant_method()
    if method is None:
        nn.Linear.__init__(layer, in_features, out_features, bias=bias)
        layer.quant_method = None
        return
    nn.Module.__init__(layer)
    layer.in_features, layer.out_features = in_features, out_features
    # No float weight; a 0-row one still tells wrappers (LoRA) the compute dtype and device, as a prepacked
    # layer's does. Not a parameter, so the checkpoint is not expected to carry it.
    layer.register_buffer("weight", torch.empty((0, in_features)), persistent=False)
    layer.bias = nn.Parameter(torch.empty(out_features)) if bias else None
    layer.quant_method = method
    method.create_weights(layer, in_features, out_features, input_size_full)


class ColumnParallelLinear(nn.Linear):
    """Output rows split across ranks: rank r computes out[:, r*n/tp : (r+1)*n/tp]."""

    supports_prepack = True  # forward goes through cpu_prepack.linear

    def __init__(self, in_features: int, out_features: int, bias: bool, what: str = "out_features") -> None:
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        _init_linear(self, in_features, _divide(out_features, self.tp_size, what), bias, in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self, self.bias)

    def load_weight(self, param: torch.Tensor, loaded: Any) -> None:
        n = self.out_features if self.quant_method is not None else param.shape[0]
        if self.quant_method is not None and param is not self.bias:
            self.quant_method.load(self, param, loaded, read_shard, n_range=(0, self.tp_rank * n, n))
            return
        with torch.no_grad():
            copy_checked(param.data, read_shard(loaded, 0, self.tp_rank * n, n), "column-parallel weight")


class RowParallelLinear(nn.Linear):
    """Input columns split across ranks; partial products all-reduced, bias added once after the sum."""

    supports_prepack = True  # forward goes through cpu_prepack.linear

    def __init__(self, in_features: int, out_features: int, bias: bool, what: str = "in_features") -> None:
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        _init_linear(self, _divide(in_features, self.tp_size, what), out_features, bias, in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return linear(x, self, self.bias)
        y = tensor_model_parallel_all_reduce(linear(x, self, None))
        return y if self.bias is None else y + self.bias

    def load_weight(self, param: torch.Tensor, loaded: Any) -> None:
        if self.quant_method is not None and param is not self.bias:
            self.quant_method.load(self, param, loaded, read_shard, k_start=self.tp_rank * self.in_features)
            return
        with torch.no_grad():
            if param.dim() == 1:  # bias: replicated
                copy_checked(param.data, read_shard(loaded), "row-parallel bias")
                return
            n = param.shape[1]
            copy_checked(param.data, read_shard(loaded, 1, self.tp_rank * n, n), "row-parallel weight")


class MergedLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input stacked along the output dim.

    `shards[shard_id] = (offset, size)` is where this rank's slice of that
    projection sits in the fused weight; `src_start[shard_id]` is where that
    slice starts in the checkpoint tensor.
    """

    def __init__(
        self,
        in_features: int,
        out_sizes: Sequence[int],
        bias: bool,
        shard_ids: Sequence[Any],
        what: str = "out_features",
    ) -> None:
        if len(out_sizes) != len(shard_ids):
            raise ValueError("out_sizes and shard_ids must have the same length.")
        tp, rank = get_tp_size(), get_tp_rank()
        local = [_divide(s, tp, what) for s in out_sizes]
        super().__init__(in_features, sum(local) * tp, bias, what)
        self._set_shards(shard_ids, local, [rank * n for n in local])

    def _set_shards(self, shard_ids: Sequence[Any], local: Sequence[int], src_start: Sequence[int]) -> None:
        offsets = [0]
        for s in local:
            offsets.append(offsets[-1] + s)
        self.shards = {sid: (offsets[i], local[i]) for i, sid in enumerate(shard_ids)}
        self.src_start = {sid: src_start[i] for i, sid in enumerate(shard_ids)}

    def weight_loader(self, param: torch.Tensor, loaded: Any, shard_id: Any) -> None:
        """Copy this rank's rows of one HF projection (weight or bias) into its slice of `param`."""
        if shard_id not in self.shards:
            raise ValueError(f"unknown shard id {shard_id!r}; expected one of {list(self.shards)}.")
        off, size = self.shards[shard_id]
        if self.quant_method is not None and param is not self.bias:
            n_range = (off, self.src_start[shard_id], size)
            self.quant_method.load(self, param, loaded, read_shard, n_range=n_range, shard_id=shard_id)
            return
        src = read_shard(loaded, 0, self.src_start[shard_id], size)
        with torch.no_grad():
            copy_checked(param.data.narrow(0, off, size), src, f"shard {shard_id!r}")


class QKVLinear(MergedLinear):
    """q, k and v in one matmul; per rank: [q (H/tp heads) | k | v (KVH/tp heads, or 1 replicated head)].

    With fewer KV heads than ranks each KV head is replicated on tp/KVH
    consecutive ranks, whose query heads are exactly the ones that use it.
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool) -> None:
        tp, rank = get_tp_size(), get_tp_rank()
        self.total_num_heads, self.total_num_kv_heads = num_heads, num_kv_heads
        self.num_heads = _divide(num_heads, tp, "num_attention_heads")
        if num_kv_heads >= tp:
            self.num_kv_heads = _divide(num_kv_heads, tp, "num_key_value_heads")
            kv_head_start = rank * self.num_kv_heads
        else:
            if tp % num_kv_heads:
                raise ValueError(
                    f"num_key_value_heads={num_kv_heads} must divide tensor_parallel_size={tp} "
                    "when there are fewer KV heads than ranks (each KV head is replicated)."
                )
            self.num_kv_heads = 1
            kv_head_start = rank // (tp // num_kv_heads)
        self.head_dim = head_dim
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        ColumnParallelLinear.__init__(self, hidden_size, (self.q_size + 2 * self.kv_size) * tp, bias)
        kv_start = kv_head_start * head_dim
        self._set_shards(
            ["q", "k", "v"], [self.q_size, self.kv_size, self.kv_size], [rank * self.q_size, kv_start, kv_start]
        )

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
