"""CpuNativeBackend builds a step's kernel arguments (the batch's block-table rows, lengths, starts, slots) once and
reuses them for every layer of the step (cpu_native._step_args). Reuse must never hand a layer another step's
arguments: a new metadata object, a field that now holds another tensor, another token count, or arguments that
had to be copied (int32 slots) are all rebuilt."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from vllm_lite.testing.attention_oracle import random_attention_case as make_case
from vllm_lite.worker.attention import cpu_kernels
from vllm_lite.worker.attention.cpu_native import CpuNativeBackend


@pytest.fixture(scope="module")
def backend() -> CpuNativeBackend:
    assert cpu_kernels.load_cpu_ops(), "the CPU kernels must build on a machine with a C++ compiler"
    return CpuNativeBackend("auto")


def _fresh(case, scale=0.125):
    query, cache, md = case
    return CpuNativeBackend("auto").forward(query, cache, md, scale)


def test_layers_of_a_step_reuse_one_set_of_arguments(backend):
    query, cache, md = make_case([5, 1, 3], [9, 30, 12], 4, 2, 32, 8, torch.float32, seed=1)
    a = backend._step_args(md, md.num_actual_tokens)
    assert backend._step_args(md, md.num_actual_tokens) is a  # the second layer: no rebuild
    first = backend.forward(query, cache, md, 0.125)
    assert torch.equal(backend.forward(query, cache, md, 0.125), first)


def test_a_new_step_never_sees_the_previous_steps_arguments(backend):
    one = make_case([5, 1, 3], [9, 30, 12], 4, 2, 32, 8, torch.float32, seed=1)
    two = make_case([4, 2, 3], [40, 7, 20], 4, 2, 32, 8, torch.float32, seed=2)  # same counts, other batch
    backend.forward(*one[:2], one[2], 0.125)
    assert torch.equal(backend.forward(*two[:2], two[2], 0.125), _fresh(two))
    # The same metadata object with other tensors in its fields.
    md = one[2]
    for f in ("block_table", "seq_lens", "query_start_loc", "slot_mapping", "num_reqs", "num_actual_tokens"):
        setattr(md, f, getattr(two[2], f))
    assert torch.equal(backend.forward(two[0], two[1], md, 0.125), _fresh(two))


def test_kv_writes_follow_the_step_and_copies_are_not_kept(backend):
    query, cache, md = make_case([3, 2], [3, 6], 4, 2, 32, 8, torch.float32, seed=3)
    n = md.num_actual_tokens
    key, value = torch.randn(n, 2, 32), torch.randn(n, 2, 32)
    backend.write_kv_step(key, value, cache, md)
    slots = md.slot_mapping[:n]
    flat = cache.view(2, -1, 2, 32)
    assert torch.equal(flat[0, slots], key) and torch.equal(flat[1, slots], value)
    # int32 slots are converted (a copy): such arguments are not reused, so a later in-place change is seen.
    md32 = dataclasses.replace(md, slot_mapping=md.slot_mapping.to(torch.int32))
    backend.write_kv_step(key, value, cache, md32)
    assert backend._step is None
    md32.slot_mapping[:n] = md32.slot_mapping[:n].flip(0)
    backend.write_kv_step(key, value, cache, md32)
    assert torch.equal(flat[0, md32.slot_mapping[:n].long()], key)
