"""The mixture-of-experts decoders (Mixtral, Qwen3-MoE) as one C++ call on CPU (cpu_decoder_stack.py, csrc's
cpu_decoder_layers with a MoE MLP) give the Python layers' results bit for bit: hidden states and the K/V written
to the cache, float32 (the k-blocked attention linears cpu_linear picks from 8 rows included) and bf16 (small-m,
VNNI and oneDNN rows), Qwen3-MoE's dense layers beside its sparse ones, and the last layer's kept rows. Where the
op does not apply (the experts on another path, a replaced router, a hook, a case cpu_linear has not checked
yet), the Python layers run, with the same results."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn

from vllm_lite.testing.decoder_stack import (
    SMALL_DECODER,
    assert_copies_run_the_same_step,
    assert_same_step,
    count_stack_runs,
    random_decoder_model,
    requires_stack_op,
    run_step,
    stack_and_python,
    step_inputs,
)
from vllm_lite.worker.attention.cpu_native import CpuNativeBackend
from vllm_lite.worker.forward_context import set_forward_context
from vllm_lite.worker.models import cpu_decoder_stack as cds
from vllm_lite.worker.models import cpu_linear, cpu_prepack, fused_moe, mixtral
from vllm_lite.worker.models.layers import RotaryEmbedding
from vllm_lite.worker.models.mixtral import MixtralForCausalLM
from vllm_lite.worker.models.qwen3_moe import Qwen3MoeForCausalLM

pytestmark = requires_stack_op


def _config(arch: str) -> transformers.PretrainedConfig:
    if arch == "qwen3_moe":  # layer 1 dense (mlp_only_layers), 0 and 2 sparse; weights rounded, not renormalised
        return transformers.Qwen3MoeConfig(
            head_dim=32,
            intermediate_size=192,
            moe_intermediate_size=96,
            num_experts=6,
            num_experts_per_tok=3,
            norm_topk_prob=False,
            mlp_only_layers=[1],
            **SMALL_DECODER,
        )
    return transformers.MixtralConfig(
        intermediate_size=160, num_local_experts=5, num_experts_per_tok=2, **SMALL_DECODER
    )


CLASSES = {"mixtral": MixtralForCausalLM, "qwen3_moe": Qwen3MoeForCausalLM}


def _model(arch: str, dtype: torch.dtype) -> nn.Module:
    return random_decoder_model(CLASSES[arch], _config(arch), dtype)


def _expertscount_stack_runs(monkeypatch) -> list[int]:
    """Counts the Python MoE blocks' forwards (SparseMoeBlock.forward)."""
    n = [0]
    real = fused_moe.SparseMoeBlock.forward

    def counting(self, x):
        n[0] += 1
        return real(self, x)

    monkeypatch.setattr(fused_moe.SparseMoeBlock, "forward", counting)
    return n


def _checked_twice(model, query_lens, seq_lens, n, seed=0, logits_rows=None):
    """The first forward of a row count may leave the stack (cpu_linear checks its new cases in the Python
    layers); the second of the same shape must take it. Returns the second's results."""
    stack_and_python(model, query_lens, seq_lens, seed, logits_rows)
    before = n[0]
    out = stack_and_python(model, query_lens, seq_lens, seed, logits_rows)
    assert n[0] == before + 1, "the forward must take the C++ stack once cpu_linear has checked its cases"
    return out


ROWS = [
    ([1], [40]),  # batch-1 decode
    ([1] * 3, [17, 33, 5]),
    ([1] * 8, list(range(20, 28))),  # float32: the k-blocked attention linears from here
    ([1] * 13, list(range(20, 33))),  # bf16: VNNI
    ([1] * 64, [30 + i % 7 for i in range(64)]),
    ([1] * 65, [30 + i % 7 for i in range(65)]),  # bf16: oneDNN
    ([37, 1, 1, 5], [37, 50, 9, 25]),  # prefill chunks beside decodes
]
ROW_IDS = ["b1", "b3", "b8", "b13", "b64", "b65", "mixed"]


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("query_lens,seq_lens", ROWS, ids=ROW_IDS)
def test_moe_stack_matches_python_layers(arch, dtype, query_lens, seq_lens, monkeypatch):
    if dtype == torch.bfloat16 and not fused_moe._cpu_moe_bf16_kernel():
        pytest.skip("the bf16 expert op needs an AVX512-BF16 build")  # elsewhere bf16 experts stay on oneDNN
    model = _model(arch, dtype)
    n = count_stack_runs(monkeypatch)
    x, y = _checked_twice(model, query_lens, seq_lens, n)
    assert_same_step(x, y)
    assert model.model._cpu_stack[0].num_moe == (2 if arch == "qwen3_moe" else 3)


def test_the_stack_runs_no_python_moe_block(monkeypatch):
    model = _model("mixtral", torch.float32)
    n = count_stack_runs(monkeypatch)
    blocks = _expertscount_stack_runs(monkeypatch)
    backend = CpuNativeBackend("auto")
    ids, positions, md, caches = step_inputs(model, [1, 1], [10, 20])
    run_step(model, backend, (ids, positions, md, caches), python=False)
    assert n[0] == 1 and blocks[0] == 0
    run_step(model, backend, (ids, positions, md, caches), python=True)
    assert blocks[0] == 3


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("keep", [[2, 5], [0], []])
def test_last_layer_kept_rows(arch, keep, monkeypatch):
    """logits_rows: past the last attention only those rows go on, through the router and experts too."""
    model = _model(arch, torch.bfloat16 if fused_moe._cpu_moe_bf16_kernel() else torch.float32)
    n = count_stack_runs(monkeypatch)
    x, y = _checked_twice(model, [4, 2], [30, 12], n, logits_rows=torch.tensor(keep, dtype=torch.int64))
    assert x[0].shape == (len(keep), 128)
    assert_same_step(x, y)


def test_float32_kept_rows_take_the_plans_of_their_row_count(monkeypatch):
    """Float32 with 10 rows, 9 kept: the last layer's o_proj sees 9 rows (its own k-blocked case)."""
    model = _model("mixtral", torch.float32)
    _need_kblocked(model)
    n = count_stack_runs(monkeypatch)
    keep = torch.arange(9, dtype=torch.int64)
    x, y = _checked_twice(model, [1] * 10, list(range(20, 30)), n, logits_rows=keep)
    assert_same_step(x, y)
    stack = model.model._cpu_stack[0]
    plans = stack._plans[(10, 9, torch.get_num_threads())]
    assert plans is not None and plans[4 * 2 + 1] == cpu_linear._kc[cpu_linear._kernel_case(9, _o_weight(model, 2))]


def _need_kblocked(model) -> None:
    """These tests are about the k-blocked kernel's plans: where it is not built (no AVX-512/AVX2 build of
    f32_linear_kblocked), they say so."""
    if not cpu_linear.kernel_applies(9, _o_weight(model, 0), torch.float32, None):
        pytest.skip("csrc's f32_linear_kblocked is not built here (cpu_linear keeps F.linear: plans are all 0)")


def _o_weight(model, layer: int) -> torch.Tensor:
    return model.model.layers[layer].self_attn.o_proj.weight


def test_float32_a_new_row_count_is_checked_in_python_first(monkeypatch):
    """cpu_linear's first input of a case runs both ways (its check): that forward takes the Python layers, and
    the case's kc, once recorded, is what the op runs (the k-blocked kernel, not F.linear)."""
    monkeypatch.setattr(cpu_linear, "_kc", {})
    model = _model("mixtral", torch.float32)
    _need_kblocked(model)
    n = count_stack_runs(monkeypatch)
    stack_and_python(model, [1] * 9, list(range(20, 29)))
    assert n[0] == 0, "an unchecked k-blocked case must leave the forward to the Python layers"
    case = cpu_linear._kernel_case(9, _o_weight(model, 0))
    assert cpu_linear._kc.get(case), "the Python layers must have checked the case (the kernel applies here)"
    x = stack_and_python(model, [1] * 9, list(range(20, 29)))
    assert n[0] == 1
    assert_same_step(*x)
    # The plans the op got: every attention linear on the kernel at the recorded kc.
    plans = model.model._cpu_stack[0]._plans[(9, 9, torch.get_num_threads())]
    assert plans is not None and all(plans[4 * i + j] > 0 for i in range(3) for j in (0, 1))
    assert all(plans[4 * i + j] == 0 for i in range(3) for j in (2, 3))


def test_plain_plan_mirrors_cpu_linear(monkeypatch):
    """plain_plan reads cpu_linear's records in its order: kernel kc, slices, F.linear, unchecked."""
    w = torch.randn(4096, 64)
    monkeypatch.setattr(cpu_linear, "_kc", {})
    monkeypatch.setattr(cpu_linear, "_checked", {})
    assert cds.plain_plan(7, w, None) == 0
    if cpu_linear.kernel_applies(16, w, torch.float32, None):
        assert cds.plain_plan(16, w, None) is None
        cpu_linear._kc[cpu_linear._kernel_case(16, w)] = 64
        assert cds.plain_plan(16, w, None) == 64
        cpu_linear._kc[cpu_linear._kernel_case(16, w)] = 0  # no kc equals F.linear: the slices' rule next
    b = torch.randn(4096)
    if cpu_linear.applies(16, w, torch.float32) and cpu_linear._enabled():
        assert cds.plain_plan(16, w, b) is None  # a bias: never the kernel; slices unchecked
        cpu_linear._checked[cpu_linear._case(16, w, b)] = True
        assert cds.plain_plan(16, w, b) == -cpu_linear.BLOCK
        cpu_linear._checked[cpu_linear._case(16, w, b)] = False
        assert cds.plain_plan(16, w, b) == 0
    assert cds.plain_plan(16, w.bfloat16(), None) == 0


def test_the_op_runs_sliced_and_kblocked_plans_as_cpu_linear_does():
    """The op's plain linears under each plan equal cpu_linear's paths for them (dense Llama weights, float32)."""
    from vllm_lite.worker.models.llama import STACK_KINDS, LlamaForCausalLM

    cfg = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=1600,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    for m in model.modules():
        if isinstance(m, RotaryEmbedding):
            m.init_buffers()
    stack = cds.build_stack(list(model.model.layers), torch.float32, STACK_KINDS)
    assert stack is not None and len(stack.plain) == 4
    backend = CpuNativeBackend("auto")
    ids, positions, md, caches = step_inputs(model, [1] * 20, list(range(20, 40)))
    gate_up = model.model.layers[0].mlp.gate_up_proj.weight
    want_blocks = cpu_linear.blocked_linear(torch.randn(3, 128), gate_up, None)
    assert want_blocks.shape == (3, 3200)

    def run_op(c, plans):
        block_table, seq_lens, qsl, slots = backend.step_args(md, ids.shape[0])
        return torch.ops.vllm_lite.cpu_decoder_layers(
            stack.weights,
            model.model.embed_tokens(ids),
            None,
            positions,
            c,
            block_table,
            seq_lens,
            qsl,
            slots,
            backend.impl,
            None,
            cpu_prepack.SMALL_M_MAX,
            cpu_prepack.VNNI_MAX,
            plans,
        )

    outs = []
    kblocked = torch.ops.vllm_lite.f32_linear_kblocked_available()
    for plans in (None, [0, 0, -768, 0], [64, 64, -768, 0] if kblocked else [0, 0, 0, 0]):
        c = [x.clone() for x in caches]
        model.model.layers[0].self_attn.attn.kv_cache = c[0]
        with torch.inference_mode(), set_forward_context(md, backend):
            h, _ = run_op(c, plans)
        outs.append(h)
    # Slices of a product are the product's columns (the same dot products): bit-equal to F.linear's.
    assert torch.equal(outs[0], outs[1])
    # The k-blocked kernel sums in its own order (kc=64 of K=128): close.
    torch.testing.assert_close(outs[2], outs[0], rtol=1e-4, atol=1e-5)
    assert kblocked or torch.equal(outs[2], outs[0])
    with pytest.raises(ValueError, match="plans"):
        run_op(caches, [0, 0])


@pytest.mark.parametrize("how", ["oneDNN experts", "router", "hook", "python_layers"])
def test_fallbacks_keep_the_python_layers(how, monkeypatch):
    """Experts not on the C++ op (oneDNN-packed or plain), a router swapped after the stack was built (as a LoRA
    wrap would), a hook on a MoE block, python_layers(): the forward runs the Python layers, unchanged."""
    model = _model("mixtral", torch.float32)
    n = count_stack_runs(monkeypatch)
    stack_and_python(model, [1, 1], [10, 20])
    assert n[0] == 1
    moe = model.model.layers[1].block_sparse_moe
    seen = []
    if how == "oneDNN experts":
        w13 = torch.randn(5, 320, 128) * 0.1
        w2 = torch.randn(5, 128, 160) * 0.1
        moe.experts.cpu_packed = fused_moe.PackedExperts(w13, w2)
    elif how == "router":
        old = moe.gate
        moe.gate = nn.Linear(128, 5, bias=True)
        with torch.no_grad():
            moe.gate.weight.copy_(old.weight)
            moe.gate.bias.zero_()
    elif how == "hook":
        moe.experts.register_forward_pre_hook(lambda m, a: seen.append(a[0].shape[0]))
    if how == "python_layers":
        with cds.python_layers():
            x = stack_and_python(model, [1, 1], [10, 20])
    else:
        x = stack_and_python(model, [1, 1], [10, 20])
    assert n[0] == 1, "the forward must take the Python layers"
    assert_same_step(*x)
    if how == "hook":
        assert seen == [2, 2]
    if how in ("oneDNN experts", "router"):
        assert model.model._cpu_stack == [None]


def test_tensor_parallel_experts_keep_the_python_layers(monkeypatch):
    model = _model("qwen3_moe", torch.float32)
    n = count_stack_runs(monkeypatch)
    model.model.layers[2].mlp.experts.tp_size = 2
    assert cds.build_stack(list(model.model.layers), torch.float32, mixtral.STACK_KINDS) is None
    model.model.layers[2].mlp.experts.tp_size = 1
    stack_and_python(model, [1], [10])
    assert n[0] == 1


def test_weights_object_checks_the_moe_tensors():
    model = _model("mixtral", torch.float32)
    stack = cds.build_stack(list(model.model.layers), torch.float32, mixtral.STACK_KINDS)
    assert stack is not None and stack.num_moe == 3
    tensors, ints, floats = _stack_args(model)
    torch.classes.vllm_lite.CpuDecoderWeights(tensors, ints, floats)  # as built
    bad = list(ints)
    bad[6] = 9  # top_k above the experts
    with pytest.raises(ValueError, match="top_k"):
        torch.classes.vllm_lite.CpuDecoderWeights(tensors, bad, floats)
    bad = list(ints)
    bad[5] = 2  # bf16 experts for float32 weights
    with pytest.raises(ValueError, match="MoE kind"):
        torch.classes.vllm_lite.CpuDecoderWeights(tensors, bad, floats)
    bad_t = list(tensors)
    bad_t[25] = torch.randn(5, 64)  # router of the wrong width
    with pytest.raises(ValueError, match="router"):
        torch.classes.vllm_lite.CpuDecoderWeights(bad_t, ints, floats)


def _stack_args(model):
    """The (tensors, ints, floats) CpuDecoderStack hands CpuDecoderWeights, captured from a build."""
    got = {}

    class Capture:
        def __init__(self, tensors, ints, floats):
            got["args"] = (tensors, ints, floats)

    cds.CpuDecoderStack(list(model.model.layers), torch.float32, Capture, mixtral.STACK_KINDS)
    return got["args"]


def test_a_model_that_ran_the_stack_can_be_copied_and_pickled():
    assert_copies_run_the_same_step(_model("mixtral", torch.float32))
