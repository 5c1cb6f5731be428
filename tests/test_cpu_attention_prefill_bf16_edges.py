"""Edge cases of the bf16 prefill attention path (csrc/attention_prefill_bf16.h) and how csrc/attention.cpp routes
prompt items to it: inputs the existing tests do not build. Query and output as strided views (a slice of the qkv
projection, a slice of a wider buffer) and the output written over the query; GQA groups that fill an item
(kRowsPerItem rows) or leave one token per item; block sizes that are not a divisor of the 16-key tiles or of the
256-key chunks, with prompts starting just before a chunk edge; garbage (NaN) in the cache slots past each
request's last key; a cache whose element offsets pass 2^31.
Skipped where the build does not target AVX512-BF16."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_lite.testing.attention_oracle import random_attention_case as make_case
from vllm_lite.testing.attention_oracle import reference_paged_attention as oracle_attention
from vllm_lite.testing.cpu_bf16_attention import BF16_ATTENTION_TOL as TOL
from vllm_lite.testing.cpu_bf16_attention import avx512_native_backend, requires_avx512_bf16
from vllm_lite.testing.paged import as_decodes, make_attention_metadata
from vllm_lite.worker.attention.cpu_native import CpuNativeBackend

pytestmark = requires_avx512_bf16


@pytest.fixture(scope="module")
def backend() -> CpuNativeBackend:
    return avx512_native_backend()


def run_op(out, query, cache, md, scale, window=0):
    torch.ops.vllm_lite.paged_attention(
        out, query, cache, md.block_table, md.seq_lens, md.query_start_loc, scale, window, 0.0, "auto"
    )
    return out


def test_strided_query_and_out_views_and_out_over_query(backend):
    heads, kv_heads, d = 6, 2, 64
    query, cache, md = make_case([37, 1, 300], [300, 90, 300], heads, kv_heads, d, 16, torch.bfloat16, seed=3)
    want = run_op(torch.empty_like(query), query, cache, md, 0.125)
    # query as the q slice of a fused qkv output [T, heads + 2 * kv_heads, d]; out a slice of a wider buffer.
    qkv = torch.randn(query.shape[0], heads + 2 * kv_heads, d).bfloat16()
    qkv[:, :heads] = query
    q_view = qkv[:, :heads]
    assert not q_view.is_contiguous()
    wide = torch.full((query.shape[0], heads + 3, d), 7.0, dtype=torch.bfloat16)
    out_view = wide[:, 1 : heads + 1]
    run_op(out_view, q_view, cache, md, 0.125)
    assert torch.equal(out_view, want)
    assert (wide[:, 0] == 7).all() and (wide[:, heads + 1 :] == 7).all(), "wrote outside the out view"
    # The output written over the query itself: each item reads its own rows before it writes them.
    same = query.clone()
    run_op(same, same, cache, md, 0.125)
    assert torch.equal(same, want)


# (query_lens, seq_lens): prompts from scratch, prompts whose first token sits just before a 256-key chunk edge
# (ctx 250), and one crossing two edges.
EDGE_CASES = [([20, 9, 513], [270, 9, 513]), ([300, 7], [555, 256])]


@pytest.mark.parametrize("gqa", [13, 21, 32, 64, 65])
def test_groups_that_fill_an_item_or_leave_one_token_per_item(backend, gqa):
    # kRowsPerItem = 64: 13 -> 4 tokens (52 rows), 21 -> 3 (63), 32 -> 2 (64), 64 and 65 -> one token per item
    # (those prompt tokens take the decode path).
    for n, (qlens, slens) in enumerate(EDGE_CASES):
        query, cache, md = make_case(qlens, slens, gqa, 1, 32, 16, torch.bfloat16, seed=gqa + n)
        scale = 1.0 / math.sqrt(32)
        out = backend.forward(query, cache, md, scale)
        torch.testing.assert_close(out.double(), oracle_attention(query, cache, md, scale), atol=TOL, rtol=TOL)
        assert torch.equal(out, backend.forward(query, cache, as_decodes(md, 16), scale))


@pytest.mark.parametrize("block_size", [3, 7, 17, 48])
@pytest.mark.parametrize("head_size", [64, 256])
def test_block_sizes_that_straddle_tiles_and_chunks(backend, block_size, head_size):
    for n, (qlens, slens) in enumerate(EDGE_CASES):
        query, cache, md = make_case(qlens, slens, 6, 2, head_size, block_size, torch.bfloat16, seed=n)
        scale = 1.0 / math.sqrt(head_size)
        out = backend.forward(query, cache, md, scale)
        torch.testing.assert_close(out.double(), oracle_attention(query, cache, md, scale), atol=TOL, rtol=TOL)
        assert torch.equal(out, backend.forward(query, cache, as_decodes(md, block_size), scale))


def test_garbage_past_the_last_key_is_never_read(backend):
    # Slots past seq_len in a request's last block and blocks no request owns may hold anything (freed, reused).
    bs = 16
    query, cache, md = make_case([20, 300, 7], [270, 300, 39], 6, 2, 64, bs, torch.bfloat16, seed=5)
    want = backend.forward(query, cache, md, 0.125)
    poisoned = torch.full_like(cache, float("nan"))
    for b, s in enumerate(md.seq_lens.tolist()):
        for p in range(s):
            blk, off = int(md.block_table[b, p // bs]), p % bs
            poisoned[:, blk, off] = cache[:, blk, off]
    got = backend.forward(query, poisoned, md, 0.125)
    assert torch.equal(got, want)


def test_cache_offsets_past_two_to_the_31(backend):
    """A cache of more than 2^31 elements a half, the requests' blocks at its end: every offset (keys and values)
    passes int32. Only the blocks used are touched; the rest stays unbacked virtual memory."""
    bs, kv_heads, d = 16, 2, 128
    blk_elems = bs * kv_heads * d
    num_blocks = (1 << 31) // blk_elems + 64
    try:
        big = torch.empty(2, num_blocks, bs, kv_heads, d, dtype=torch.bfloat16)
    except RuntimeError as e:  # no address space for ~8.6 GB here
        pytest.skip(f"cannot reserve the large cache: {e}")
    qlens, slens = [40, 1, 300], [300, 90, 300]
    query, small, md = make_case(qlens, slens, 6, kv_heads, d, bs, torch.bfloat16, seed=9)
    base = num_blocks - small.shape[1]  # small's block i lives at big's block base + i
    big[:, base:] = small
    big_md = make_attention_metadata(
        qlens,
        slens,
        [[base + int(x) for x in md.block_table[b, : (s + bs - 1) // bs]] for b, s in enumerate(slens)],
        bs,
    )
    scale = 1.0 / math.sqrt(d)
    want = backend.forward(query, small, md, scale)
    assert torch.equal(backend.forward(query, big, big_md, scale), want)
