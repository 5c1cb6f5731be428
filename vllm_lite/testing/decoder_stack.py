"""One decoder step run twice from the same KV caches: through the one-call C++ stack on CPU and through the
Python layers (`cpu_decoder_stack.python_layers()`), for the tests that need the two bit for bit; the small
random-weight models those tests build, and the skip rule for hosts without the op."""

from __future__ import annotations

import copy
import io
from typing import Any, Callable, Optional

import pytest
import torch
from torch import nn

from vllm_lite import platform
from vllm_lite.testing.paged import make_attention_metadata, random_block_tables
from vllm_lite.worker.attention.cpu_kernels import cpu_op
from vllm_lite.worker.attention.cpu_native import CpuNativeBackend
from vllm_lite.worker.forward_context import set_forward_context
from vllm_lite.worker.models import cpu_decoder_stack as cds
from vllm_lite.worker.models import cpu_prepack, fused_moe
from vllm_lite.worker.models.layers import RotaryEmbedding

BLOCK = 16

requires_stack_op = pytest.mark.skipif(cpu_op("cpu_decoder_layers") is None, reason="CPU kernels not built here")

# The sizes every test model of the stack shares (a Hugging Face config's keywords; each adds its MLP's).
SMALL_DECODER = dict(
    vocab_size=256,
    hidden_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
)


def random_decoder_model(
    model_class: Callable[[Any], nn.Module], config: Any, dtype: torch.dtype, prepack: bool = True
) -> nn.Module:
    """model_class(config) in eval mode and dtype, its weights from seed 0 and left as the loader leaves them:
    norms near one (not all ones: a wrong weight shows), biases, experts and routers random (torch.empty at
    construction), rotary tables in float32, experts on the C++ expert op and, in bf16 when prepack, the linear
    weights prepacked for oneDNN where it packs bf16 (AVX-512 BF16 hosts). Where it cannot (an AVX2-only Zen 3),
    the weights stay plain, as the worker leaves them there, and the stack runs them through its unpacked plans."""
    torch.manual_seed(0)
    model = model_class(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif p.dim() == 1 or "experts" in name or "gate.weight" in name:
                p.copy_(0.1 * torch.randn_like(p))
    model.to(dtype)
    for m in model.modules():
        if isinstance(m, RotaryEmbedding):
            m.init_buffers()
        if isinstance(m, fused_moe.FusedMoE):
            assert m.process_weights_after_loading() == ""
    if prepack and dtype == torch.bfloat16:
        packed = cpu_prepack.prepack_linear_weights(model)
        if platform.onednn_bf16_prepack().ok:  # packing works here: a model that packed nothing is a bug
            assert packed > 0, "oneDNN bf16 prepacking works on this host but packed no weight"
    return model


Step = tuple[torch.Tensor, torch.Tensor, Any, list[torch.Tensor]]


def step_inputs(model: nn.Module, query_lens: list[int], seq_lens: list[int], seed: int = 0) -> Step:
    """(input_ids, positions, metadata, caches) of one step: query_lens new tokens a request, seq_lens in all,
    random ids under 256 and random caches in the model's dtype."""
    g = torch.Generator().manual_seed(seed)
    tables, num_blocks = random_block_tables(seq_lens, BLOCK, seed=seed)
    md = make_attention_metadata(query_lens, seq_lens, tables, BLOCK)
    ids = torch.randint(0, 256, (md.num_actual_tokens,), generator=g)
    positions = torch.cat([torch.arange(s - q, s) for q, s in zip(query_lens, seq_lens)])
    attn = model.model.layers[0].self_attn
    dtype = model.model.embed_tokens.weight.dtype
    caches = [
        torch.randn(2, num_blocks, BLOCK, attn.num_kv_heads, attn.head_dim, generator=g).to(dtype)
        for _ in model.model.layers
    ]
    return ids, positions, md, caches


def run_step(model: nn.Module, backend: Any, step: Step, python: bool, logits_rows: Optional[Any] = None) -> Any:
    """The model's forward over `step` (its caches written in place), on the Python layers when `python`."""
    ids, positions, md, caches = step
    for layer, c in zip(model.model.layers, caches):
        layer.self_attn.attn.kv_cache = c
    with torch.inference_mode(), set_forward_context(md, backend):
        if python:
            with cds.python_layers():
                return model(ids, positions, logits_rows=logits_rows)
        return model(ids, positions, logits_rows=logits_rows)


def stack_and_python(
    model: nn.Module, query_lens: list[int], seq_lens: list[int], seed: int = 0, logits_rows: Optional[Any] = None
) -> tuple[tuple[Any, list[torch.Tensor]], tuple[Any, list[torch.Tensor]]]:
    """(stack result, caches after), (Python result, caches after) for the same step from the same caches."""
    backend = CpuNativeBackend("auto")
    ids, positions, md, caches = step_inputs(model, query_lens, seq_lens, seed)
    c1 = [c.clone() for c in caches]
    c2 = [c.clone() for c in caches]
    a = run_step(model, backend, (ids, positions, md, c1), python=False, logits_rows=logits_rows)
    b = run_step(model, backend, (ids, positions, md, c2), python=True, logits_rows=logits_rows)
    return (a, c1), (b, c2)


def assert_same_step(x: tuple[Any, list[torch.Tensor]], y: tuple[Any, list[torch.Tensor]]) -> None:
    """Same hidden states and the same K/V written, bit for bit."""
    (a, c1), (b, c2) = x, y
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a, b), f"hidden states differ: max |diff| {(a.float() - b.float()).abs().max().item()}"
    for i, (p, q) in enumerate(zip(c1, c2)):
        assert torch.equal(p, q), f"layer {i}'s KV cache differs"


def count_stack_runs(monkeypatch: Any) -> list[int]:
    """A one-item list counting the forwards that went through the C++ stack from now on (run_stack patched)."""
    n = [0]
    real = cds.run_stack

    def counting(*a: Any, **k: Any) -> Any:
        out = real(*a, **k)
        n[0] += out is not None
        return out

    monkeypatch.setattr(cds, "run_stack", counting)
    return n


def assert_copies_run_the_same_step(model: nn.Module) -> None:
    """A model that ran the stack, deep-copied (the copy builds its own stack) and through torch.save/load, runs
    a step to the same bits as the original."""
    x = stack_and_python(model, [1], [10])
    twin = copy.deepcopy(model)
    assert model.model._cpu_stack and twin.model._cpu_stack == []
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    for m in (twin, loaded):
        assert_same_step(stack_and_python(m, [1], [10])[0], x[0])
