"""The Llama-family decoder layers of a CPU forward in one C++ call (csrc/fused_cpu_ops.cpp, `cpu_decoder_layers`).

Why: a batch-1 decode step of the ~128M bench Qwen2 in bf16 ran ~20 Python-level calls a layer between its
kernels (module calls, q/k/v splits and views, the attention layer's slicing, the backend's checks): ~1-1.5 ms a
step on a 2-core Zen 4, where the linears themselves take ~7-9 ms (benchmarks/PROFILE.md, "CPU decode: the
layers in one call"). The C++ op runs the same operations in the same order (the fused norm, rotary and SiLU
kernels, the linear kernel cpu_prepack.linear picks for the row count, the K/V write and paged attention of
the CPU backend; at decode row counts gate_up and SiLU-and-mul as one kernel call where cpu_prepack interleaved
gate_up's copies, with the same bits as the two), so its results are the Python layers' bit for bit; tests/test_cpu_decoder_stack.py compares
them on every path (bf16 small-m / VNNI / oneDNN rows, float32, Qwen3's q/k norm, the last layer's kept rows).

When: `LlamaModel.forward` (llama.py) and the mixture-of-experts decoders' (mixtral.py: Mixtral, Qwen3-MoE) on
CPU, outside autograd and tracing, with the fused CPU ops built and on (VLLM_LITE_CPU_FUSED_OPS), the CPU native
attention backend, and every layer the plain one (RMSNorms, `RotaryEmbedding`, `Attention`, and a SiLU MLP or a
`SparseMoeBlock` whose experts run the C++ expert op (fused_moe.KernelExperts / Bf16KernelExperts); linears at
tensor-parallel size 1, unquantised, not LoRA-wrapped, not compiled). Unpacked linears (float32; bf16 where
oneDNN cannot pack) take what cpu_linear.linear would take for that row count (F.linear, its k-blocked kernel at
the kc it checked, or its slices), handed to the op per row count; a forward with a case cpu_linear has not yet
checked runs the Python layers (which check it). Anything else runs the Python layers, unchanged.

A MoE layer in the op: one moe_cpu_route call (the router's product and fused_moe.route's softmax / top-k /
renormalisation / rounding), then one moe_cpu_experts(_bf16) call: what SparseMoeBlock.forward runs on those
experts, so the same bits (tests/test_cpu_decoder_stack_moe.py). Why: a Mixtral layer paid ~0.5 ms of Python a decode step
on top of the dense layer's (the block, route(), the experts' wrapper; benchmarks/PROFILE.md, "MoE on CPU,
fifth pass").

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
from vllm_lite.worker.models.decoder import PreNormDecoder
from vllm_lite.worker.models.fused_moe import Bf16KernelExperts, FusedMoE, KernelExperts, SparseMoeBlock
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


def plain_plan(rows: int, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> Optional[int]:
    """What cpu_linear.linear runs for an unpacked weight at `rows` (inference), as the op takes it: 0 F.linear,
    kc > 0 its k-blocked kernel at that kc, -BLOCK its slices; None where it has not checked the case yet (its
    first input of a case runs both ways: the caller leaves that forward to the Python layers). Mirrors
    cpu_linear.linear's order of rules, reading the choices it recorded."""
    if rows <= plain_linear_max_rows():
        return 0
    if cpu_linear.kernel_applies(rows, weight, weight.dtype, bias):
        kc = cpu_linear._kc.get(cpu_linear._kernel_case(rows, weight))
        if kc is None:
            return None
        if kc:
            return kc
    if not cpu_linear.applies(rows, weight, weight.dtype) or not cpu_linear._enabled():
        return 0
    ok = cpu_linear._checked.get(cpu_linear._case(rows, weight, bias))
    if ok is None:
        return None
    return -cpu_linear.BLOCK if ok else 0


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
        # The layer, attention and dense MLP classes the op mirrors, handed in by the model file (it imports this
        # module). A layer's MLP is its `mlp_name` attribute (MoE layers) or `mlp`; a SparseMoeBlock is the MoE one.
        LlamaDecoderLayer, LlamaAttention, LlamaMLP = kinds  # noqa: N806

        tensors: list[torch.Tensor] = []
        ints: list[int] = []
        floats: list[float] = []
        watch: list[tuple[dict, str, Any]] = []  # (a dict, a key, the object found there at build time)
        self.attns: list[Attention] = []
        # Unpacked linears: (index in the op's plans list, weight, bias); their per-row-count plans, cached.
        self.plain: list[tuple[int, torch.Tensor, Optional[torch.Tensor]]] = []
        self._plans: dict[tuple[int, int, int], Optional[list[int]]] = {}
        self._plan_dicts = (cpu_linear._kc, cpu_linear._checked)
        self.num_moe = 0

        def need(ok: bool) -> None:
            if not ok:
                raise _Ineligible

        def t(x: Optional[torch.Tensor]) -> torch.Tensor:
            return _EMPTY if x is None else x

        for li, layer in enumerate(layers):
            need(type(layer) is LlamaDecoderLayer)
            mlp_name = layer.__dict__.get("mlp_name", "mlp")
            attn, mlp = layer.self_attn, layer._modules.get(mlp_name)
            moe = type(mlp) is SparseMoeBlock
            need(type(attn) is LlamaAttention and (moe or type(mlp) is LlamaMLP))
            need(type(layer.input_layernorm) is RMSNorm and type(layer.post_attention_layernorm) is RMSNorm)
            need(type(attn.attn) is Attention and type(attn.rotary_emb) is RotaryEmbedding)
            need(moe or type(mlp.act) is SiluAndMul)
            watch.append((layer.__dict__, "_compiled_call_impl", layer.__dict__.get("_compiled_call_impl")))
            need(layer.__dict__.get("_compiled_call_impl") is None)
            watch.append((layer.__dict__, "mlp_name", layer.__dict__.get("mlp_name")))
            for parent, names in (
                (layer, ("self_attn", mlp_name, "input_layernorm", "post_attention_layernorm")),
                (attn, ("qkv_proj", "o_proj", "attn", "rotary_emb") + (("q_norm", "k_norm") if attn.qk_norm else ())),
                (mlp, ("gate", "experts") if moe else ("gate_up_proj", "down_proj", "act")),
            ):
                for n in names:
                    child = parent._modules[n]
                    watch.append((parent._modules, n, child))
                    # compilation_config compiles these blocks (worker/compile.py), not the layer: theirs to run
                    watch.append((child.__dict__, "_compiled_call_impl", child.__dict__.get("_compiled_call_impl")))
                    need(child.__dict__.get("_compiled_call_impl") is None)
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
            linears = [(attn.qkv_proj, QKVLinear), (attn.o_proj, RowParallelLinear)]
            if not moe:
                linears += [(mlp.gate_up_proj, MergedLinear), (mlp.down_proj, RowParallelLinear)]
            gate_up_d = 0  # cpu_prepack's interleaved gate_up copies: the op runs SiLU-and-mul in their epilogue
            for which, (lin, cls) in enumerate(linears):
                need(type(lin) is cls and lin.tp_size == 1 and getattr(lin, "quant_method", None) is None)
                small, vnni, packed = (lin.__dict__.get(n) for n in _LINEAR_ATTRS)
                for n, v in zip(_LINEAR_ATTRS, (small, vnni, packed)):
                    watch.append((lin.__dict__, n, v))
                interleaved = lin.__dict__.get(cpu_prepack._GATE_UP_ATTR)
                watch.append((lin.__dict__, cpu_prepack._GATE_UP_ATTR, interleaved))
                if interleaved is not None:
                    need(which == 2 and dtype == torch.bfloat16)
                    gate_up_d = int(interleaved)
                watch.append((lin._parameters, "weight", lin.weight))
                watch.append((lin._parameters, "bias", lin.bias))
                plain = None
                if packed is None:
                    need(lin.weight.dtype == dtype and lin.weight.is_cpu and lin.weight.dim() == 2)
                    plain = lin.weight
                    self.plain.append((4 * li + which, lin.weight, lin.bias))
                if lin.bias is not None:
                    need(lin.bias.dtype == dtype and lin.bias.is_cpu)
                tensors += [t(small), t(vnni), t(packed), t(plain), t(lin.bias)]
            moe_ints = [0, 0, 0, 0, 0]
            if moe:
                tensors += [_EMPTY] * 10  # no gate_up / down linears
                gate, experts = mlp.gate, mlp.experts
                need(type(gate) is nn.Linear and gate.bias is None and type(experts) is FusedMoE)
                need(experts.tp_size == 1)
                packed_experts = experts.cpu_packed
                kind = {KernelExperts: 1, Bf16KernelExperts: 2}.get(type(packed_experts), 0)
                need(kind == (1 if dtype == torch.float32 else 2))
                w = gate.weight
                need(w.dtype == dtype and w.is_cpu and w.is_contiguous() and w.shape[0] == experts.num_experts)
                watch.append((gate._parameters, "weight", w))
                watch.append((gate._parameters, "bias", None))
                watch.append((experts.__dict__, "cpu_packed", packed_experts))
                watch.append((packed_experts.__dict__, "w13", packed_experts.w13))
                watch.append((packed_experts.__dict__, "w2", packed_experts.w2))
                tensors += [w, packed_experts.w13, packed_experts.w2]
                moe_ints = [
                    kind,
                    int(experts.top_k),
                    int(bool(experts.renormalize)),
                    int(bool(experts.round_weights)),
                    int(packed_experts.inter),
                ]
                self.num_moe += 1
            else:
                tensors += [_EMPTY] * 3
            ints += [attn.num_heads, attn.num_kv_heads, attn.head_dim, rot.rotary_dim, int(a.sliding_window or 0)]
            ints += moe_ints
            ints.append(gate_up_d)
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

    def plans(self, rows: int, last_rows: int) -> tuple[bool, Optional[list[int]]]:
        """(ok, the op's `plans`) for a forward of `rows` rows whose last layer goes on with `last_rows` past its
        attention: None where every linear is F.linear (or packed); ok False where cpu_linear has not checked one
        of the cases yet (the forward takes the Python layers, which check it)."""
        if not self.plain:
            return True, None
        if self._plan_dicts[0] is not cpu_linear._kc or self._plan_dicts[1] is not cpu_linear._checked:
            self._plans.clear()  # cpu_linear's records were replaced (tests)
            self._plan_dicts = (cpu_linear._kc, cpu_linear._checked)
        key = (rows, last_rows, torch.get_num_threads())
        if key in self._plans:
            return True, self._plans[key]
        last = len(self.attns) - 1
        out = [0] * (4 * len(self.attns))
        for i, weight, bias in self.plain:
            p = plain_plan(last_rows if i // 4 == last and i % 4 else rows, weight, bias)
            if p is None:
                return False, None
            out[i] = p
        plans = out if any(out) else None
        self._plans[key] = plans
        return True, plans


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
    if t == 0 or t != md.num_actual_tokens:
        return None
    ok, plans = stack.plans(t, t if logits_rows is None else logits_rows.shape[0])
    if not ok:
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
        plans,
    )
    if hidden.shape[0] == 0:
        return hidden
    hidden, _ = model.norm(hidden, residual)
    return hidden


def forward_with_stack(
    model: nn.Module,
    kinds: tuple[type, type, type],
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    logits_rows: Optional[torch.Tensor],
) -> Optional[torch.Tensor]:
    """A PreNormDecoder's forward through the C++ stack where it applies, else None (the caller runs its Python
    layers). The decision is kept in `model._cpu_stack` ([] undecided, else [stack or None]) and redone when the
    modules or tensors it holds were replaced. As LlamaModel.forward (llama.py) does for the dense models."""
    if not input_ids.is_cpu or torch.compiler.is_compiling():
        return None
    cache = model._cpu_stack
    if not cache or (cache[0] is not None and not cache[0].unchanged()):
        cache[:] = [build_stack(list(model.layers), model.embed_tokens.weight.dtype, kinds)]
    stack = cache[0]
    if stack is None or not stack.runnable():
        return None
    return run_stack(stack, model, input_ids, positions, logits_rows)


class StackDecoder(PreNormDecoder):
    """A PreNormDecoder whose layers run as one C++ call on CPU where it applies (forward_with_stack), with the
    same results; `stack_kinds` names the layer, attention and MLP classes the op stands in for."""

    stack_kinds: tuple[type, type, type]

    def __init__(self, config: Any, layers: list[nn.Module]) -> None:
        super().__init__(config, layers)
        self._cpu_stack: list[Optional[CpuDecoderStack]] = []  # [] until decided at a CPU forward, then [stack/None]

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, logits_rows: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        hidden = forward_with_stack(self, self.stack_kinds, input_ids, positions, logits_rows)
        if hidden is not None:
            return hidden
        return super().forward(input_ids, positions, logits_rows)

    def __getstate__(self) -> dict:
        """A copy or pickle decides its own stack (the C++ weights object is neither copyable nor picklable)."""
        state = super().__getstate__()
        state = dict(state) if state is not None else dict(self.__dict__)
        state["_cpu_stack"] = []
        return state
