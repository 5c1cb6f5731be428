"""Building blocks shared by the decoder models: norms, rotary embedding, fused linears, activations.

The fused, tensor-parallel linears (QKVLinear, MergedLinear) live in
parallel_linear.py and are re-exported here.

On CPU, RMSNorm (with its residual add), the rotary embedding and SiLU-and-mul run as one C++ call each
(csrc/fused_cpu_ops.cpp, `fused_cpu_ops()`): at batch 1 the dozen torch calls they replace cost more in
dispatch than in arithmetic. The kernels repeat the torch code's operations and roundings, so results are the
same bit for bit where torch vectorises as they do (AVX2 and AVX-512 hosts; tests/test_cpu_fused_ops.py).
The torch code stays as the fallback: other devices, autograd, other dtypes, no extension, or
VLLM_LITE_CPU_FUSED_OPS=0.

On CUDA the same layers run Triton kernels instead (triton_fused.py): RMSNorm with its residual add (and
Gemma's 1 + w gain), SiLU/GELU-tanh-and-mul and the rotary embedding of q and k are one launch each, where torch
ran 4-16 small kernels per call. `fused_kernel_path(device, dtype)` says which path a layer takes.
"""

from __future__ import annotations

import contextlib
import math
from types import SimpleNamespace
from typing import Any, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from vllm_lite import envs
from vllm_lite.worker.models.parallel_linear import (  # noqa: F401 -- re-exported
    ColumnParallelLinear,
    MergedLinear,
    QKVLinear,
    RowParallelLinear,
    copy_checked,
    read_shard,
)

_FUSED_DTYPES = (torch.float32, torch.bfloat16)
_fused_state: list[Optional[SimpleNamespace]] = []  # [] until decided, then [ops or None]


def fused_cpu_ops() -> Optional[SimpleNamespace]:
    """The fused CPU ops (rms_norm, rotary, silu_and_mul: csrc/fused_cpu_ops.cpp's overloads) when the C++
    kernels are built and loaded here and VLLM_LITE_CPU_FUSED_OPS is not 0; else None. Decided once per process
    (the check sits on every layer's path); reset_fused_cpu_ops() forgets the decision."""
    if _fused_state:
        return _fused_state[0]
    ops = None
    if envs.VLLM_LITE_CPU_FUSED_OPS:
        from vllm_lite.worker.attention.cpu_kernels import load_cpu_ops

        if load_cpu_ops() and hasattr(torch.ops.vllm_lite, "fused_rms_norm"):
            ns = torch.ops.vllm_lite
            ops = SimpleNamespace(
                rms_norm=ns.fused_rms_norm.default,
                rotary=ns.fused_rotary_embedding.default,
                silu_and_mul=ns.fused_silu_and_mul.default,
            )
    _fused_state.append(ops)
    return ops


def reset_fused_cpu_ops() -> None:
    """Forget fused_cpu_ops()'s decision (tests that change VLLM_LITE_CPU_FUSED_OPS)."""
    _fused_state.clear()


def cpu_fused_ops_for(x: torch.Tensor) -> Optional[SimpleNamespace]:
    """fused_cpu_ops() for a CPU float32/bfloat16 tensor whose last dim is contiguous, outside autograd; else None."""
    if x.is_cpu and x.dtype in _FUSED_DTYPES and not torch.is_grad_enabled() and x.stride(-1) == 1:
        if _TRITON_ON_CPU[0]:  # the tests' interpreted run of the Triton path on CPU
            return None
        return fused_cpu_ops()
    return None


_triton_state: list[Any] = []  # [] until first needed, then [the triton_fused module]
_TRITON_ON_CPU = [False]  # inside triton_on_cpu_under_interpreter()


def triton_fused_module():
    """vllm_lite/worker/models/triton_fused.py, imported on first use (importing triton costs ~0.2 s, which CPU
    runs never pay)."""
    if not _triton_state:
        from vllm_lite.worker.models import triton_fused

        _triton_state.append(triton_fused)
    return _triton_state[0]


@contextlib.contextmanager
def triton_on_cpu_under_interpreter() -> Iterator[None]:
    """Within: the layers send CPU tensors to the Triton kernels (interpreted) instead of the C++ ones; only with
    TRITON_INTERPRET=1 (the tests' subprocess checks the layers' CUDA wiring this way)."""
    if not envs.TRITON_INTERPRET:
        raise RuntimeError("triton_on_cpu_under_interpreter() needs TRITON_INTERPRET=1 in this process's environment.")
    _TRITON_ON_CPU[0] = True
    try:
        yield
    finally:
        _TRITON_ON_CPU[0] = False


def _takes_triton(device_type: str, dtype: torch.dtype, grad: bool) -> bool:
    if grad or not (device_type == "cuda" or (device_type == "cpu" and _TRITON_ON_CPU[0])):
        return False
    tf = triton_fused_module()
    return tf.HAS_TRITON and dtype in tf.DTYPES


def fused_kernel_path(device: torch.device | str, dtype: torch.dtype, grad: bool = False) -> str:
    """Which implementation the fused layers (RMSNorm, GemmaRMSNorm, SiluAndMul, the gated GELU, RotaryEmbedding)
    take for tensors of this device and dtype: "triton" (CUDA: triton_fused.py), "cpu" (the C++ ops) or "torch".
    `grad`: under autograd (always "torch"). Pure logic: asking about CUDA needs no GPU."""
    device = torch.device(device)
    if _takes_triton(device.type, dtype, grad):
        return "triton"
    if device.type == "cpu" and not grad and dtype in _FUSED_DTYPES and fused_cpu_ops() is not None:
        return "cpu"
    return "torch"


def triton_fused_for(x: torch.Tensor) -> bool:
    """x goes to the Triton kernels: fused_kernel_path says "triton" for it and its last dim is packed. Not while
    torch.compile traces (compilation_config: the compiled blocks take the torch path, which inductor fuses itself;
    our launches carry options such as enable_fp_fusion that dynamo's user-kernel wrapper does not know)."""
    if x.is_cpu and not _TRITON_ON_CPU[0]:
        return False  # the CPU's hot path pays one check
    if torch.compiler.is_compiling():
        return False
    return x.stride(-1) == 1 and _takes_triton(x.device.type, x.dtype, torch.is_grad_enabled())


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 (as HF does), with an optional fused residual add."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: Optional[torch.Tensor] = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        ops = cpu_fused_ops_for(x)
        if (
            ops is not None
            and self.weight.dtype == x.dtype
            and (residual is None or (residual.dtype == x.dtype and residual.shape == x.shape))
        ):
            y, new_residual = ops.rms_norm(x, residual, self.weight, self.eps, False)
            return y if residual is None else (y, new_residual)
        if (
            triton_fused_for(x)
            and self.weight.dtype == x.dtype
            and triton_fused_module().rms_norm_supported(x, self.weight, residual)
        ):
            y, new_residual = triton_fused_module().rms_norm(x, self.weight, self.eps, residual)
            return y if residual is None else (y, new_residual)
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        y = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(dtype) * self.weight
        return y if residual is None else (y, residual)


class SiluAndMul(nn.Module):
    """silu(gate) * up for a fused [.., 2*d] gate_up output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = cpu_fused_ops_for(x)
        if ops is not None and x.shape[-1] % 2 == 0:
            return ops.silu_and_mul(x)
        if triton_fused_for(x) and triton_fused_module().act_and_mul_supported(x):
            return triton_fused_module().act_and_mul(x, "silu")
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]


def get_activation(name: str) -> nn.Module:
    acts: dict[str, nn.Module] = {
        "relu": nn.ReLU(),
        "gelu": nn.GELU(),
        "gelu_new": nn.GELU(approximate="tanh"),
        "gelu_pytorch_tanh": nn.GELU(approximate="tanh"),
        "silu": nn.SiLU(),
        "swish": nn.SiLU(),
    }
    if name not in acts:
        raise ValueError(f"activation_function {name!r} is not supported; choose one of {sorted(acts)}.")
    return acts[name]


def fused_activation_name(act: nn.Module) -> Optional[str]:
    """The triton_fused.act_and_mul name of an activation module ("silu", "gelu_tanh"), or None (not fused)."""
    if isinstance(act, nn.SiLU):
        return "silu"
    if isinstance(act, nn.GELU) and act.approximate == "tanh":
        return "gelu_tanh"
    return None


def default_weight_loader(param: torch.Tensor, loaded: Any) -> None:
    """Copy a whole checkpoint tensor (or lazy slice) into a replicated parameter (dtype/device converted)."""
    with torch.no_grad():
        copy_checked(param.data, read_shard(loaded), "weight")


# ---------------------------------------------------------------------------- rotary embedding


def get_rope_parameters(config: Any) -> dict[str, Any]:
    """RoPE settings from a transformers config: v5 `rope_parameters` or older `rope_scaling` + `rope_theta`."""
    rp = getattr(config, "rope_parameters", None)
    if isinstance(rp, dict) and ("rope_theta" in rp or "rope_type" in rp or "type" in rp):
        params = dict(rp)
    else:
        params = dict(getattr(config, "rope_scaling", None) or {})
    if "rope_theta" not in params or params["rope_theta"] is None:
        params["rope_theta"] = getattr(config, "rope_theta", None) or 10000.0
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    if "partial_rotary_factor" not in params and getattr(config, "partial_rotary_factor", None) is not None:
        params["partial_rotary_factor"] = config.partial_rotary_factor
    return params


def _yarn_inv_freq(base: float, dim: int, p: dict[str, Any], max_pos: int) -> tuple[torch.Tensor, float]:
    factor = p.get("factor") or max_pos / p["original_max_position_embeddings"]
    orig = p.get("original_max_position_embeddings") or max_pos

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = p.get("attention_factor")
    if attn is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attn = mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"])
        else:
            attn = mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def corr_dim(rot: float) -> float:
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    extrap = 1 - ramp  # 1 where the frequency is high enough to keep unscaled
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrap) + (1.0 / pos_freqs) * extrap
    return inv, float(attn)


def _llama3_inv_freq(inv: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    factor, low_f, high_f = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low_f, old_len / high_f
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low_f) / (high_f - low_f)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_inv_freq(rotary_dim: int, params: dict[str, Any], max_position: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies float32 [rotary_dim/2] on CPU, cos/sin scale) for a rope type.

    Always computed on CPU (explicit device) so building under torch.device("meta") stays cheap."""
    base = float(params["rope_theta"])
    kind = params["rope_type"]
    inv = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float() / rotary_dim))
    if kind in ("default", "dynamic"):
        # dynamic NTK only changes frequencies past max_position_embeddings, which the engine never reaches.
        return inv, 1.0
    if kind == "linear":
        return inv / params["factor"], 1.0
    if kind == "llama3":
        return _llama3_inv_freq(inv, params), 1.0
    if kind == "yarn":
        return _yarn_inv_freq(base, rotary_dim, params, max_position)
    raise ValueError(
        f"rope_type {kind!r} is not supported; supported: 'default', 'linear', 'dynamic', 'llama3', 'yarn'."
    )


class RotaryEmbedding(nn.Module):
    """NeoX-style RoPE (rotate halves) over the first rotary_dim of each head, from a cos/sin table."""

    def __init__(self, head_dim: int, max_position: int, params: dict[str, Any]) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        self.max_position = max_position
        self.params = params
        rope_inv_freq(self.rotary_dim, params, max_position)  # validate the rope type at build time
        self.register_buffer("cos_sin_cache", torch.empty(max_position, self.rotary_dim), persistent=False)
        self.init_buffers()

    def init_buffers(self) -> None:
        """(Re)compute the float32 cos/sin table on the buffer's device; the loader calls this after to_empty."""
        device = self.cos_sin_cache.device
        inv, scale = rope_inv_freq(self.rotary_dim, self.params, self.max_position)
        if device.type == "meta":
            self.cos_sin_cache = torch.empty(self.max_position, self.rotary_dim, device=device)
            return
        freqs = torch.outer(torch.arange(self.max_position, dtype=torch.float32, device="cpu"), inv)
        self.cos_sin_cache = (torch.cat([freqs.cos(), freqs.sin()], dim=-1) * scale).to(device)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        x = x.view(t, -1, self.head_dim)
        half = self.rotary_dim // 2
        x1, x2 = x[..., :half], x[..., half : self.rotary_dim]
        parts = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
        if self.rotary_dim < self.head_dim:
            parts.append(x[..., self.rotary_dim :])
        return torch.cat(parts, dim=-1).view(t, -1)

    def table_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """The rows of cos_sin_cache the tokens at `positions` rotate with (LongRoPE picks its short or long half)."""
        return positions

    def triton_supported(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> bool:
        tf = triton_fused_module()
        return tf.rotary_supported(positions, query, key, self.cos_sin_cache, self.head_dim, self.rotary_dim)

    def rotate_and_write_kv(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> bool:
        """Where the Triton kernels run (CUDA): rotate query in place and write the rotated key and value to the
        paged kv_cache at slot_mapping, in one kernel, and return True. Else do nothing and return False (the
        caller rotates with forward() and writes the cache itself). key itself stays unrotated."""
        if not triton_fused_for(query):
            return False
        rows = self.table_positions(positions)
        if not (
            self.triton_supported(rows, query, key)
            and triton_fused_module().rotary_write_kv_supported(key, value, kv_cache, slot_mapping)
            and kv_cache.shape[4] == self.head_dim
        ):
            return False
        triton_fused_module().rotary_write_kv(
            rows, query, key, value, self.cos_sin_cache, self.head_dim, self.rotary_dim, kv_cache, slot_mapping
        )
        return True

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T]; query [T, H*D], key [T, KVH*D] -> rotated, same shapes.

        On CPU (fused_cpu_ops) and CUDA (Triton) query and key are rotated in place and returned; elsewhere the
        results are new tensors. Callers use only the returned tensors."""
        positions = self.table_positions(positions)
        ops = cpu_fused_ops_for(query)
        if (
            ops is not None
            and query.dim() == 2
            and key.dim() == 2
            and key.dtype == query.dtype
            and key.stride(-1) == 1
            and self.cos_sin_cache.dtype == torch.float32
            and positions.dtype in (torch.int64, torch.int32)
            and self.rotary_dim % 2 == 0
        ):
            ops.rotary(positions, query, key, self.cos_sin_cache, self.head_dim, self.rotary_dim)
            return query, key
        if triton_fused_for(query) and self.triton_supported(positions, query, key):
            tf = triton_fused_module()
            return tf.rotary(positions, query, key, self.cos_sin_cache, self.head_dim, self.rotary_dim)
        cs = self.cos_sin_cache.index_select(0, positions).to(query.dtype)
        cos, sin = cs.unsqueeze(1).chunk(2, dim=-1)  # [T, 1, rot/2] each
        return self._rotate(query, cos, sin), self._rotate(key, cos, sin)


def norm_per_head(norm: nn.Module, x: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
    """Apply a head_dim-wide norm to each head of x [T, H*D] (Qwen3's and Gemma 3's q/k norm)."""
    t = x.shape[0]
    return norm(x.reshape(t, num_heads, head_dim)).view(t, -1)
