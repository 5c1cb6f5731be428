"""The bfloat16 decode path (csrc/attention_decode_bf16.h) over every GQA group and number of KV heads.

A decode request is one work unit holding all its KV heads (each head's 16-key tiles transposed, its G query rows
scored in register blocks of up to 4), so a mix-up between heads, or between the rows of a head, shows only where
there are several heads or groups of more than 4 rows: the other decode tests use 2 KV heads. Every row's bits must
be the ones the prefill path (attention_prefill_bf16.h, one KV head per item) gives the same token at the same
position, for groups of 1-12 rows and 1-7 KV heads at head size 64, and a few such shapes at the other head sizes;
and decodes over those shapes match the float64 oracle. Skipped where the build does not target AVX512-BF16.
"""

from __future__ import annotations

import math

import pytest
import torch

from vllm_lite.testing.attention_oracle import random_attention_case as make_case
from vllm_lite.testing.attention_oracle import reference_paged_attention as oracle_attention
from vllm_lite.testing.cpu_bf16_attention import BF16_ATTENTION_TOL as TOL
from vllm_lite.testing.cpu_bf16_attention import avx512_native_backend, requires_avx512_bf16
from vllm_lite.testing.paged import as_decodes
from vllm_lite.worker.attention.cpu_native import CpuNativeBackend

pytestmark = requires_avx512_bf16


@pytest.fixture(scope="module")
def backend() -> CpuNativeBackend:
    return avx512_native_backend()


# One prompt over a tile edge, a partial last tile and two chunks (its tokens' decodes see 1-290 keys).
QLENS, SLENS = [21, 290], [21, 290]


@pytest.mark.parametrize("gqa", [1, 2, 3, 4, 5, 6, 8, 12])
@pytest.mark.parametrize("kv_heads", [1, 2, 3, 4, 5, 7])
def test_decode_bits_equal_prefill_bits_for_every_head_block(backend, gqa, kv_heads):
    query, cache, md = make_case(
        QLENS, SLENS, gqa * kv_heads, kv_heads, 64, 16, torch.bfloat16, seed=gqa * 10 + kv_heads
    )
    prefill = backend.forward(query, cache, md, 0.125)
    decode = backend.forward(query, cache, as_decodes(md, 16), 0.125)
    assert torch.equal(prefill, decode), (gqa, kv_heads, (prefill != decode).nonzero()[:5].tolist())


@pytest.mark.parametrize("head_size", [32, 128, 256])
@pytest.mark.parametrize("gqa,kv_heads", [(1, 5), (3, 4), (3, 6), (4, 4), (7, 2)])
def test_decode_bits_equal_prefill_bits_at_every_head_size(backend, head_size, gqa, kv_heads):
    query, cache, md = make_case(QLENS, SLENS, gqa * kv_heads, kv_heads, head_size, 16, torch.bfloat16, seed=head_size)
    scale = 1.0 / math.sqrt(head_size)
    prefill = backend.forward(query, cache, md, scale)
    decode = backend.forward(query, cache, as_decodes(md, 16), scale)
    assert torch.equal(prefill, decode), (head_size, gqa, kv_heads, (prefill != decode).nonzero()[:5].tolist())


@pytest.mark.parametrize("gqa,kv_heads", [(1, 7), (2, 5), (3, 4), (3, 5), (4, 5), (6, 3)])
def test_decodes_over_head_blocks_match_the_oracle(backend, gqa, kv_heads):
    seq = [1, 16, 37, 257, 600]
    query, cache, md = make_case([1] * len(seq), seq, gqa * kv_heads, kv_heads, 64, 16, torch.bfloat16, seed=gqa)
    out = backend.forward(query, cache, md, 0.125)
    torch.testing.assert_close(out.double(), oracle_attention(query, cache, md, 0.125), atol=TOL, rtol=TOL)
