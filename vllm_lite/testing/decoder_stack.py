"""One decoder step run twice from the same KV caches: through the one-call C++ stack on CPU and through the
Python layers (`cpu_decoder_stack.python_layers()`), for the tests that need the two bit for bit."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from vllm_lite.testing.paged import make_attention_metadata, random_block_tables
from vllm_lite.worker.attention.cpu_native import CpuNativeBackend
from vllm_lite.worker.forward_context import set_forward_context
from vllm_lite.worker.models import cpu_decoder_stack as cds

BLOCK = 16

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
