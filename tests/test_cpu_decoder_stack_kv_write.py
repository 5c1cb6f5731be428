"""The C++ decoder stack writes each layer's K/V itself, in the rotary's pass over the rows (csrc/fused_cpu_ops.cpp,
rotary_write_rows), where write_kv would have written them: the same cache bytes as the Python layers (rotary,
then write_kv) for padding slots (-1, skipped) and at row counts where the pass is split over threads, and an
out-of-range slot still refused with write_kv's error."""

from __future__ import annotations

import pytest
import torch

from vllm_lite.testing.decoder_stack import (
    SMALL_DECODER,
    assert_same_step,
    count_stack_runs,
    random_decoder_model,
    run_step,
    step_inputs,
)
from vllm_lite.worker.attention.cpu_kernels import load_cpu_ops
from vllm_lite.worker.attention.cpu_native import CpuNativeBackend
from vllm_lite.worker.models.qwen2 import Qwen2ForCausalLM

pytestmark = pytest.mark.skipif(
    not (load_cpu_ops() and hasattr(torch.ops.vllm_lite, "cpu_decoder_layers")), reason="CPU kernels not built here"
)


def _model(dtype: torch.dtype) -> torch.nn.Module:
    """The stack tests' small random Qwen2 (2 layers, MLP 256) in dtype."""
    import transformers

    cfg = transformers.Qwen2Config(**{**SMALL_DECODER, "num_hidden_layers": 2}, intermediate_size=256)
    return random_decoder_model(Qwen2ForCausalLM, cfg, dtype)


def _both(model, query_lens, seq_lens, pad=(), slot=None):
    """(stack result, caches), (Python result, caches) of one step whose rows in `pad` have slot -1 (and, with
    `slot`, row 0 the slot given)."""
    ids, positions, md, caches = step_inputs(model, query_lens, seq_lens, seed=3)
    for r in pad:
        md.slot_mapping[r] = -1
    if slot is not None:
        md.slot_mapping[0] = slot
    backend = CpuNativeBackend("auto")
    c1 = [c.clone() for c in caches]
    c2 = [c.clone() for c in caches]
    a = run_step(model, backend, (ids, positions, md, c1), python=False)
    b = run_step(model, backend, (ids, positions, md, c2), python=True)
    return (a, c1), (b, c2), caches


# float32 below 8 rows only: from 8 rows its stack depends on cpu_linear's checked cases (test_cpu_decoder_stack).
@pytest.mark.parametrize(
    "dtype,rows", [(torch.bfloat16, 3), (torch.bfloat16, 32), (torch.bfloat16, 65), (torch.float32, 3)]
)
def test_stack_writes_the_python_layers_cache_bytes(dtype, rows, monkeypatch):
    model = _model(dtype)
    n = count_stack_runs(monkeypatch)
    x, y, before = _both(model, [1] * rows, [20 + i % 9 for i in range(rows)])
    assert n[0] == 1
    assert_same_step(x, y)
    assert not torch.equal(x[1][0], before[0]), "the step must have written the cache"


@pytest.mark.parametrize("rows", [5, 40])
def test_padding_slots_are_skipped(rows, monkeypatch):
    model = _model(torch.bfloat16)
    n = count_stack_runs(monkeypatch)
    pad = (0, rows // 2, rows - 1)
    x, y, _ = _both(model, [1] * rows, [30 + i % 5 for i in range(rows)], pad=pad)
    assert n[0] == 1
    assert_same_step(x, y)


def test_a_slot_outside_the_cache_is_refused(monkeypatch):
    model = _model(torch.bfloat16)
    n = count_stack_runs(monkeypatch)
    ids, positions, md, caches = step_inputs(model, [1] * 4, [10, 11, 12, 13], seed=1)
    md.slot_mapping[0] = caches[0].shape[1] * caches[0].shape[2]
    with pytest.raises((ValueError, RuntimeError), match="outside the cache"):
        run_step(model, CpuNativeBackend("auto"), (ids, positions, md, caches), python=False)
    assert n[0] == 0
