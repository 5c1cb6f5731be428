"""The Llama-family decoder layers of a CPU forward in one C++ call (csrc/fused_cpu_ops.cpp, `cpu_decoder_layers`).

Why: a batch-1 decode step of the ~128M bench Qwen2 in bf16 ran ~20 Python-level calls a layer between its
kernels (module calls, q/k/v splits and views, the attention layer's slicing, the backend's checks): ~1-1.5 ms a
step on a 2-core Zen 4, where the linears themselves take ~7-9 ms (benchmarks/PROFILE.md, "CPU decode: the
layers in one call"). The C++ op runs the same operations in the same order (the fused norm, rotary and SiLU
kernels, the linear kernel cpu_prepack.linear picks for the row count, the K/V write and paged attention of
the CPU backend), so its results are the Python layers' bit for bit; tests/test_cpu_decoder_stack.py compares
them on every path (bf16 small-m / VNNI / oneDNN rows, float32, Qwen3's q/k norm, the last layer's kept rows).

When: `LlamaModel.forward` (llama.py) on CPU, outside autograd and tracing, with the fused CPU ops built and on
(VLLM_LITE_CPU_FUSED_OPS), the CPU native attention backend, and every layer the plain Llama one (RMSNorms,
`RotaryEmbedding`, `Attention`, SiLU MLP; linears at tensor-parallel size 1, unquantised, not LoRA-wrapped, not
compiled). Unpacked linears (float32; bf16 where oneDNN cannot pack) take F.linear in C++, as cpu_linear does
only below its kernels' row counts: such forwards of more rows stay on the Python layers. Anything else runs the
Python layers, unchanged.

The stack holds the layers' tensors as they were when it was built (the first eligible forward); each forward
first checks, by identity, that the modules, weights, packed copies and cos/sin tables it holds are still the
model's (~25 us), and rebuilds the decision when not (a LoRA wrap, prepacking, compilation after a forward). A
forward hook on any module inside the layers (or a global one) keeps the forward on the Python layers, so the
hook runs.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch
from torch import nn

from vllm_lite.worker.attention.layer import Attention
from vllm_lite.worker.models import cpu_linear, cpu_prepack
from vllm_lite.worker.models.layers import (
    MergedLinear,
    QKVLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    SiluAndMul,
    fused_cpu_ops,
)

_ON = [True]  # python_layers() turns it off (tests, A/B timing)
_LINEAR_ATTRS = (cpu_prepack._SMALL_ATTR, cpu_prepack._VNNI_ATTR, cpu_prepack._ATTR)
_EMPTY = torch.empty(0)
# nn.Module's global forward (pre-)hooks, which would fire on every module the op runs past.
_global_hooks = (torch.nn.modules.module._global_forward_hooks, torch.nn.modules.module._global_forward_pre_hooks)


@contextlib.contextmanager
def python_layers() -> Iterator[None]:
    """Within: LlamaModel runs its Python layers even where the C++ stack applies (tests compare the two)."""
    prev = _ON[0]
    _ON[0] = False
    try:
        yield
    finally:
        _ON[0] = prev


def plain_linear_max_rows() -> int:
    """Rows up to which cpu_linear.linear is F.linear whatever the weight (below its kernels' and slices' rules)."""
    return min(cpu_linear.KERNEL_MIN_ROWS, cpu_linear.MIN_ROWS) - 1


def _weights_class() -> Any:
    """torch.classes.vllm_lite.CpuDecoderWeights, or None where the loaded library lacks it (torch.classes raises
    RuntimeError, not AttributeError, for an unknown class)."""
    try:
        return torch.classes.vllm_lite.CpuDecoderWeights
    except (AttributeError, RuntimeError):
        return None


def _op() -> Any:
    ops = fused_cpu_ops()
    if ops is None:
        return None
    return getattr(torch.ops.vllm_lite, "cpu_decoder_layers", None)


class CpuDecoderStack:
    """A model's layers as the C++ op takes them, and the identities that say they are still the model's."""

    def __init__(
        self, layers: list[nn.Module], dtype: torch.dtype, weights_class: Any, kinds: tuple[type, type, type]
    ) -> None:
        # The layer, attention and MLP classes the op mirrors, handed in by the model file (it imports this module).
        LlamaDecoderLayer, LlamaAttention, LlamaMLP = kinds  # noqa: N806

        tensors: list[torch.Tensor] = []
        ints: list[int] = []
        floats: list[float] = []
        watch: list[tuple[dict, str, Any]] = []  # (a dict, a key, the object found there at build time)
        self.attns: list[Attention] = []
        self.has_plain = False

        def need(ok: bool) -> None:
            if not ok:
                raise _Ineligible

        def t(x: Optional[torch.Tensor]) -> torch.Tensor:
            return _EMPTY if x is None else x

        for layer in layers:
            need(type(layer) is LlamaDecoderLayer)
            attn, mlp = layer.self_attn, layer.mlp
            need(type(attn) is LlamaAttention and type(mlp) is LlamaMLP)
            need(type(layer.input_layernorm) is RMSNorm and type(layer.post_attention_layernorm) is RMSNorm)
            need(type(attn.attn) is Attention and type(attn.rotary_emb) is RotaryEmbedding)
            need(type(mlp.act) is SiluAndMul)
            watch.append((layer.__dict__, "_compiled_call_impl", layer.__dict__.get("_compiled_call_impl")))
            need(layer.__dict__.get("_compiled_call_impl") is None)
            for parent, names in (
                (layer, ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")),
                (attn, ("qkv_proj", "o_proj", "attn", "rotary_emb") + (("q_norm", "k_norm") if attn.qk_norm else ())),
                (mlp, ("gate_up_proj", "down_proj", "act")),
            ):
                for n in names:
                    watch.append((parent._modules, n, parent._modules[n]))
            norms = [layer.input_layernorm, layer.post_attention_layernorm]
            if attn.qk_norm:
                need(type(attn.q_norm) is RMSNorm and type(attn.k_norm) is RMSNorm)
                need(attn.q_norm.eps == attn.k_norm.eps)
                norms += [attn.q_norm, attn.k_norm]
            for norm in norms:
                need(norm.weight.dtype == dtype and norm.weight.is_cpu and norm.weight.is_contiguous())
                watch.append((norm._parameters, "weight", norm.weight))
            rot = attn.rotary_emb
            cs = rot.cos_sin_cache
            need(cs.dtype == torch.float32 and cs.is_cpu and cs.is_contiguous() and rot.rotary_dim % 2 == 0)
            watch.append((rot._buffers, "cos_sin_cache", cs))
            a = attn.attn
            need(a.num_heads == attn.num_heads and a.num_kv_heads == attn.num_kv_heads and a.head_size == attn.head_dim)
            tensors += [
                layer.input_layernorm.weight,
                layer.post_attention_layernorm.weight,
                attn.q_norm.weight if attn.qk_norm else _EMPTY,
                attn.k_norm.weight if attn.qk_norm else _EMPTY,
                cs,
            ]
            for lin, cls in (
                (attn.qkv_proj, QKVLinear),
                (attn.o_proj, RowParallelLinear),
                (mlp.gate_up_proj, MergedLinear),
                (mlp.down_proj, RowParallelLinear),
            ):
                need(type(lin) is cls and lin.tp_size == 1 and getattr(lin, "quant_method", None) is None)
                small, vnni, packed = (lin.__dict__.get(n) for n in _LINEAR_ATTRS)
                for n, v in zip(_LINEAR_ATTRS, (small, vnni, packed)):
                    watch.append((lin.__dict__, n, v))
                watch.append((lin._parameters, "weight", lin.weight))
                watch.append((lin._parameters, "bias", lin.bias))
                plain = None
                if packed is None:
                    need(lin.weight.dtype == dtype and lin.weight.is_cpu and lin.weight.dim() == 2)
                    plain = lin.weight
                    self.has_plain = True
                if lin.bias is not None:
                    need(lin.bias.dtype == dtype and lin.bias.is_cpu)
                tensors += [t(small), t(vnni), t(packed), t(plain), t(lin.bias)]
            ints += [attn.num_heads, attn.num_kv_heads, attn.head_dim, rot.rotary_dim, int(a.sliding_window or 0)]
            floats += [
                float(layer.input_layernorm.eps),
                float(layer.post_attention_layernorm.eps),
                float(attn.q_norm.eps) if attn.qk_norm else 0.0,
                float(a.scale),
                float(a.logits_soft_cap or 0.0),
            ]
            self.attns.append(a)
        self.weights = weights_class(tensors, ints, floats)
        self.head_size = self.attns[0].head_size
        self.soft_cap = self.attns[0].logits_soft_cap
        self._dicts = tuple(d for d, _, _ in watch)
        self._keys = tuple(k for _, k, _ in watch)
        self._ids = tuple(id(v) for _, _, v in watch)
        self._held = [v for _, _, v in watch]  # alive while held, so no new object takes one of their ids
        modules = [m for layer in layers for m in layer.modules()]
        self._hooks = tuple(d for m in modules for d in (m._forward_hooks, m._forward_pre_hooks))

    def unchanged(self) -> bool:
        """The modules and tensors held are still the model's (by identity)."""
        return tuple(map(id, map(dict.get, self._dicts, self._keys))) == self._ids

    def runnable(self) -> bool:
        """No forward hook (a module's or a global one) waits on a module the op would run past."""
        return not (any(map(len, self._hooks)) or _global_hooks[0] or _global_hooks[1])


class _Ineligible(Exception):
    pass


def build_stack(
    layers: list[nn.Module], dtype: torch.dtype, kinds: tuple[type, type, type]
) -> Optional[CpuDecoderStack]:
    """The stack for these layers, or None where the C++ op does not apply (see the module doc). `kinds`: the
    (decoder layer, attention, MLP) classes whose exact instances the op stands in for."""
    if dtype not in (torch.float32, torch.bfloat16) or not layers or _op() is None:
        return None
    cls = _weights_class()
    if cls is None:
        return None
    try:
        return CpuDecoderStack(layers, dtype, cls, kinds)
    except _Ineligible:
        return None


def run_stack(
    stack: CpuDecoderStack,
    model: nn.Module,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    logits_rows: Optional[torch.Tensor],
) -> Optional[torch.Tensor]:
    """The decoder's hidden states through the C++ stack, or None where this forward must take the Python
    layers (the caller then runs them). `model`: the PreNormDecoder (its embed_tokens and final norm)."""
    from vllm_lite.worker.attention.cpu_native import CpuNativeBackend
    from vllm_lite.worker.forward_context import current_forward_context

    if not _ON[0] or torch.is_grad_enabled() or not input_ids.is_cpu or torch.compiler.is_compiling():
        return None
    ctx = current_forward_context()
    if ctx is None or type(ctx.backend) is not CpuNativeBackend:
        return None
    md = ctx.metadata
    t = input_ids.shape[0]
    if t == 0 or t != md.num_actual_tokens or (stack.has_plain and t > plain_linear_max_rows()):
        return None
    caches = [a.kv_cache for a in stack.attns]
    if any(c is None for c in caches):
        return None
    backend = ctx.backend
    backend.announce(stack.head_size, stack.soft_cap)
    block_table, seq_lens, query_start_loc, slots = backend.step_args(md, t)
    hidden = model.embed_tokens(input_ids)
    hidden, residual = torch.ops.vllm_lite.cpu_decoder_layers.default(
        stack.weights,
        hidden,
        None,
        positions,
        caches,
        block_table,
        seq_lens,
        query_start_loc,
        slots,
        backend.impl,
        logits_rows,
        cpu_prepack.SMALL_M_MAX,
        cpu_prepack.VNNI_MAX,
    )
    if hidden.shape[0] == 0:
        return hidden
    hidden, _ = model.norm(hidden, residual)
    return hidden
