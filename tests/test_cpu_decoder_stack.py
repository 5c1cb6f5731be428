"""The Llama decoder layers as one C++ call on CPU (cpu_decoder_stack.py, csrc's cpu_decoder_layers) give the
Python layers' results bit for bit: hidden states and the K/V written to the cache, on every linear path the row
count picks (bf16 small-m 1-12 rows, VNNI 13-64, oneDNN above; float32 F.linear below 8 rows), for Llama, Qwen2
(q/k/v bias), Qwen3 (q/k norm) and Mistral (sliding window), mixed prefill + decode batches and the last layer's
kept rows. Where the op does not apply (a float32 case cpu_linear has not checked yet, a replaced module), the
Python layers run."""

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
    stack_and_python,
)
from vllm_lite.worker.models import cpu_decoder_stack as cds
from vllm_lite.worker.models import cpu_prepack, llama
from vllm_lite.worker.models.llama import LlamaForCausalLM, MistralForCausalLM
from vllm_lite.worker.models.qwen2 import Qwen2ForCausalLM
from vllm_lite.worker.models.qwen3 import Qwen3ForCausalLM

pytestmark = requires_stack_op


def _config(arch: str) -> transformers.PretrainedConfig:
    common = dict(intermediate_size=256, **SMALL_DECODER)
    if arch == "qwen3":
        return transformers.Qwen3Config(head_dim=32, **common)
    if arch == "qwen2":
        return transformers.Qwen2Config(**common)
    if arch == "mistral":
        return transformers.MistralConfig(sliding_window=20, **common)
    return transformers.LlamaConfig(**common)


CLASSES = {
    "llama": LlamaForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "mistral": MistralForCausalLM,
}


def _model(arch: str, dtype: torch.dtype, prepack: bool = True) -> nn.Module:
    return random_decoder_model(CLASSES[arch], _config(arch), dtype, prepack)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize(
    "query_lens,seq_lens",
    [
        ([1], [40]),  # batch-1 decode: small-m kernel
        ([1] * 3, [17, 33, 5]),
        ([1] * 12, list(range(20, 32))),  # the small-m kernel's last row count
        ([1] * 13, list(range(20, 33))),  # the VNNI kernel's first
        ([1] * 64, [30 + i % 7 for i in range(64)]),  # the VNNI kernel's last
        ([1] * 65, [30 + i % 7 for i in range(65)]),  # oneDNN
        ([37, 1, 1, 5], [37, 50, 9, 25]),  # prefill chunks beside decodes
    ],
    ids=["b1", "b3", "b12", "b13", "b64", "b65", "mixed"],
)
def test_bf16_stack_matches_python_layers(arch, query_lens, seq_lens, monkeypatch):
    model = _model(arch, torch.bfloat16)
    n = count_stack_runs(monkeypatch)
    x, y = stack_and_python(model, query_lens, seq_lens)
    assert n[0] == 1, "the bf16 forward must take the C++ stack"
    assert_same_step(x, y)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("rows", [1, 3, 7])
def test_float32_stack_matches_python_layers(arch, rows, monkeypatch):
    model = _model(arch, torch.float32)
    n = count_stack_runs(monkeypatch)
    x, y = stack_and_python(model, [1] * rows, [9 + 5 * i for i in range(rows)], seed=rows)
    assert n[0] == 1, "a float32 forward of < 8 rows must take the C++ stack"
    assert_same_step(x, y)


def test_float32_from_8_rows_takes_the_stack_once_cpu_linear_checked_the_case(monkeypatch):
    """cpu_linear's own kernels take float32 linears of 8+ rows, each case checked on its first input: a forward
    with an unchecked case runs the Python layers (which check it); the next takes the stack, running the choice
    cpu_linear recorded (k-blocked kc, slices or F.linear), with the same bits."""
    from vllm_lite.worker.models import cpu_linear

    assert cds.plain_linear_max_rows() == 7
    monkeypatch.setattr(cpu_linear, "_kc", {})
    model = _model("llama", torch.float32)
    n = count_stack_runs(monkeypatch)
    o = model.model.layers[0].self_attn.o_proj.weight
    checked_first = cpu_linear.kernel_applies(8, o, torch.float32, None)  # else cpu_linear keeps F.linear (plan 0)
    x, y = stack_and_python(model, [8], [8])
    assert n[0] == (0 if checked_first else 1)
    assert_same_step(x, y)
    x, y = stack_and_python(model, [8], [8])
    assert n[0] == (1 if checked_first else 2)
    assert_same_step(x, y)


def test_unpacked_bf16_takes_f_linear_below_8_rows(monkeypatch):
    model = _model("qwen2", torch.bfloat16, prepack=False)
    n = count_stack_runs(monkeypatch)
    assert_same_step(*stack_and_python(model, [1, 1], [20, 30]))
    assert n[0] == 1


@pytest.mark.parametrize("keep", [[2, 5], [0], []])
def test_last_layer_kept_rows(keep, monkeypatch):
    """logits_rows: past the last attention only those rows go on (decoder.py), in the op as in Python."""
    model = _model("qwen2", torch.bfloat16)
    n = count_stack_runs(monkeypatch)
    x, y = stack_and_python(model, [4, 2], [30, 12], logits_rows=torch.tensor(keep, dtype=torch.int64))
    assert n[0] == 1
    assert x[0].shape == (len(keep), 128)
    assert_same_step(x, y)


def test_a_replaced_module_sends_the_forward_back_to_python(monkeypatch):
    """A module swapped in after the stack was built (as a LoRA wrap does) is seen: the stack is rebuilt, finds a
    layer it cannot run and leaves the forward to the Python layers, which run the new module."""

    class Doubling(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x) * 2

    model = _model("llama", torch.bfloat16)
    n = count_stack_runs(monkeypatch)
    stack_and_python(model, [1], [10])
    assert n[0] == 1
    mlp = model.model.layers[1].mlp
    mlp.down_proj = Doubling(mlp.down_proj)
    x, y = stack_and_python(model, [1], [10])
    assert n[0] == 1, "the replaced module must send the forward to the Python layers"
    assert_same_step(x, y)


def test_blocks_compiled_after_a_forward_keep_the_python_layers(monkeypatch):
    """compilation_config compiles a layer's children (its MLP and norms, worker/compile.py), not the layer: once
    they are compiled the stack must not run around them (test_compile counts their graphs)."""
    model = _model("llama", torch.bfloat16)
    n = count_stack_runs(monkeypatch)
    stack_and_python(model, [1], [10])
    assert n[0] == 1
    model.model.layers[1].mlp.compile(backend="eager")  # what maybe_compile does, without inductor's cost
    x, y = stack_and_python(model, [1], [10])
    assert n[0] == 1, "a compiled block must send the forward to the Python layers"
    assert_same_step(x, y)


def test_prepacking_after_a_forward_rebuilds_the_stack(monkeypatch):
    """The stack built over plain weights is not reused once the weights are packed (the plain ones are gone)."""
    model = _model("llama", torch.bfloat16, prepack=False)
    n = count_stack_runs(monkeypatch)
    before = stack_and_python(model, [1], [10])
    assert_same_step(*before)
    cpu_prepack.prepack_linear_weights(model)
    after = stack_and_python(model, [1], [10])
    assert n[0] == 2
    assert_same_step(*after)


def test_weights_object_rejects_inconsistent_layers():
    model = _model("llama", torch.bfloat16)
    stack = cds.build_stack(list(model.model.layers), torch.bfloat16, llama.STACK_KINDS)
    assert stack is not None and stack.weights.num_layers() == 3
    with pytest.raises(ValueError, match="tensors"):
        torch.classes.vllm_lite.CpuDecoderWeights([torch.ones(3)], [1], [1.0])


def test_a_forward_hook_inside_the_layers_keeps_the_python_layers(monkeypatch):
    """Hooks run: with one on a module the op would run past, the forward takes the Python layers."""
    model = _model("qwen2", torch.bfloat16)
    n = count_stack_runs(monkeypatch)
    seen = []
    h = model.model.layers[2].mlp.register_forward_pre_hook(lambda m, a: seen.append(a[0].shape[0]))
    try:
        stack_and_python(model, [1, 1], [10, 20])
    finally:
        h.remove()
    assert n[0] == 0 and seen == [2, 2]
    stack_and_python(model, [1, 1], [10, 20])
    assert n[0] == 1 and seen == [2, 2]
    g = torch.nn.modules.module.register_module_forward_hook(lambda m, a, o: seen.append(0))
    try:
        stack_and_python(model, [1], [10])
    finally:
        g.remove()
    assert n[0] == 1


def test_a_model_that_ran_the_stack_can_be_copied_and_pickled():
    assert_copies_run_the_same_step(_model("llama", torch.float32))


@pytest.mark.parametrize("missing", ["_weights_class", "_op"])
def test_a_library_without_the_op_keeps_the_python_layers(missing, monkeypatch):
    """Kernels built from older sources (no cpu_decoder_layers / CpuDecoderWeights): the Python layers run."""
    model = _model("llama", torch.bfloat16)
    n = count_stack_runs(monkeypatch)
    monkeypatch.setattr(cds, missing, lambda: None)
    assert_same_step(*stack_and_python(model, [1], [10]))
    assert n[0] == 0 and model.model._cpu_stack == [None]
