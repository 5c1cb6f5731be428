"""TorchRefBackend against a naive per-sequence attention written with explicit loops."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_lite.testing.attention_oracle import random_attention_case, reference_paged_attention
from vllm_lite.testing.paged import make_attention_metadata, random_block_tables, slot_mapping_for
from vllm_lite.worker.attention.torch_ref import TorchRefBackend

HEAD = 16


def _naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: int, scale: float) -> torch.Tensor:
    """One request in float64: q [ql, H, D], k/v [sl, KVH, D]; query j sees keys 0..ctx+j."""
    ql, h, _ = q.shape
    rep = h // k.shape[1]
    out = torch.empty(ql, h, q.shape[2], dtype=torch.float64)
    for j in range(ql):
        for head in range(h):
            keys = k[: ctx + j + 1, head // rep].double()
            vals = v[: ctx + j + 1, head // rep].double()
            w = torch.softmax(keys @ q[j, head].double() * scale, dim=0)
            out[j, head] = w @ vals
    return out


def _run_case(query_lens, seq_lens, num_heads, num_kv_heads, block_size, dtype, seed=0, backend=None):
    g = torch.Generator().manual_seed(seed)
    tables, num_blocks = random_block_tables(seq_lens, block_size, seed=seed)
    md = make_attention_metadata(query_lens, seq_lens, tables, block_size)
    # Fill the cache with noise so reading a wrong slot cannot go unnoticed.
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, HEAD, generator=g).to(dtype) * 3
    backend = backend or TorchRefBackend()
    keys = [torch.randn(s, num_kv_heads, HEAD, generator=g).to(dtype) for s in seq_lens]
    vals = [torch.randn(s, num_kv_heads, HEAD, generator=g).to(dtype) for s in seq_lens]
    # Earlier steps' context goes in first, then this step's K/V through write_kv.
    ctx_lens = [s - q for q, s in zip(query_lens, seq_lens)]
    ctx_slots = slot_mapping_for(ctx_lens, ctx_lens, tables, block_size) if sum(ctx_lens) else None
    if ctx_slots is not None:
        backend.write_kv(
            torch.cat([k[:c] for k, c in zip(keys, ctx_lens)]),
            torch.cat([v[:c] for v, c in zip(vals, ctx_lens)]),
            cache,
            torch.from_numpy(ctx_slots),
        )
    backend.write_kv(
        torch.cat([k[c:] for k, c in zip(keys, ctx_lens)]),
        torch.cat([v[c:] for v, c in zip(vals, ctx_lens)]),
        cache,
        md.slot_mapping,
    )
    query = torch.randn(md.num_actual_tokens, num_heads, HEAD, generator=g).to(dtype)
    scale = 1.0 / math.sqrt(HEAD)
    out = backend.forward(query, cache, md, scale)
    assert out.shape == query.shape and out.dtype == dtype
    expected, at = [], 0
    for ql, c, k, v in zip(query_lens, ctx_lens, keys, vals):
        expected.append(_naive(query[at : at + ql], k, v, c, scale))
        at += ql
    return out, torch.cat(expected)


MIXED = ([5, 1, 7, 1, 3], [5, 9, 20, 1, 40])  # fresh prefill, decodes, chunks with context


@pytest.mark.parametrize("ratio", [1, 2, 4])
@pytest.mark.parametrize("block_size", [1, 2, 16, 32])
def test_mixed_batch_matches_naive_attention_float32(ratio, block_size):
    out, ref = _run_case(*MIXED, num_heads=4, num_kv_heads=4 // ratio, block_size=block_size, dtype=torch.float32)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("ratio", [1, 4])
def test_mixed_batch_matches_naive_attention_bfloat16(ratio):
    # bf16 inputs, float32 softmax: error is dominated by rounding the output to bf16 (~2^-8 relative).
    out, ref = _run_case(*MIXED, num_heads=4, num_kv_heads=4 // ratio, block_size=16, dtype=torch.bfloat16)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expanded_kv_heads_path_matches_naive_attention(dtype):
    """The GPU code path (KV heads repeated before SDPA), run on CPU."""
    out, ref = _run_case(*MIXED, 8, 2, block_size=4, dtype=dtype, seed=5, backend=TorchRefBackend(expand_kv_heads=True))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


def test_pure_decode_batch_matches_naive_attention():
    out, ref = _run_case([1] * 6, [1, 2, 17, 33, 64, 100], 8, 2, block_size=16, dtype=torch.float32, seed=1)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_pure_prefill_batch_matches_naive_attention():
    out, ref = _run_case([9, 33, 2], [9, 33, 2], 4, 2, block_size=8, dtype=torch.float32, seed=2)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_write_kv_places_rows_at_their_slots():
    backend = TorchRefBackend()
    cache = torch.zeros(2, 4, 4, 2, HEAD)
    key, value = torch.randn(3, 2, HEAD), torch.randn(3, 2, HEAD)
    slots = torch.tensor([13, 0, 6])
    backend.write_kv(key, value, cache, slots)
    for row, s in enumerate(slots.tolist()):
        torch.testing.assert_close(cache[0, s // 4, s % 4], key[row])
        torch.testing.assert_close(cache[1, s // 4, s % 4], value[row])
    assert cache.abs().sum(dim=(-1, -2)).count_nonzero() == 6  # 3 keys + 3 values, nothing else


# Steps one backend object sees in a row, as the runner drives it: each layer of a step calls
# forward with the same metadata, and the next step brings new metadata. Steps 1-3 keep the token
# count and the decode/prefill split, so a stale plan raises nothing and silently attends over the
# old lengths; step 4 changes the shapes outright.
_PLAN_STEPS = [
    ([3, 1], [3, 5]),
    ([1, 1, 2], [4, 6, 2]),
    ([1, 1, 2], [5, 7, 4]),
    ([1, 1, 2], [6, 8, 6]),
    ([4, 1, 1, 1], [9, 2, 10, 30]),
]


def test_plan_is_rebuilt_for_each_new_step_and_matches_the_oracle():
    """One backend across steps whose plans differ: every layer of every step equals the float64 oracle."""
    backend = TorchRefBackend()
    for step, (qls, sls) in enumerate(_PLAN_STEPS):
        query, cache, md = random_attention_case(qls, sls, 4, 2, HEAD, block_size=2, dtype=torch.float32, seed=step)
        for layer in range(2):  # two layers: the second reuses the step's plan with another cache and query
            q = query if layer == 0 else query.flip(0).contiguous()
            c = cache if layer == 0 else cache * -0.5
            out = backend.forward(q, c, md, 0.25)
            ref = reference_paged_attention(q, c, md, 0.25)
            torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5, msg=f"step {step} layer {layer}")
