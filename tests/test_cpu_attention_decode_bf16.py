"""The bfloat16 decode path of the C++ CPU attention kernel (csrc/attention_decode_bf16.h: VDPBF16PS scores,
chunked softmax, bf16 probabilities times values), which decode items of a bf16 cache take on AVX512-BF16
builds wherever the AVX-512 key loop would run.

Against the float64 oracle over what the general tests do not reach: contexts of several 256-key chunks (the
online rescale between chunks), odd key counts, GQA groups of 1-8 rows (register blocks of 1-4), every head
size it takes, sliding windows and one-token blocks; and the property greedy decoding relies on: a request's
output does not depend on the rest of the batch or on the thread count, bit for bit.
Skipped where the build does not target AVX512-BF16 (Zen 3 / AVX2 hosts): decodes take the key loops there.
"""

from __future__ import annotations

import math

import pytest
import torch

from vllm_lite.testing.attention_oracle import poison_blocks_before_window
from vllm_lite.testing.attention_oracle import random_attention_case as make_case
from vllm_lite.testing.cpu_bf16_attention import BF16_ATTENTION_TOL as TOL
from vllm_lite.testing.cpu_bf16_attention import avx512_native_backend, requires_avx512_bf16
from vllm_lite.testing.decode_attention_checks import DECODE_SEQ_LENS as SEQ
from vllm_lite.testing.decode_attention_checks import assert_decode_bits_alone_and_on_one_thread, assert_matches_oracle
from vllm_lite.testing.torch_threads import torch_threads
from vllm_lite.worker.attention.cpu_native import CpuNativeBackend

pytestmark = requires_avx512_bf16


@pytest.fixture(scope="module")
def backend() -> CpuNativeBackend:
    return avx512_native_backend()


@pytest.mark.parametrize("head_size", [32, 64, 128, 256])
@pytest.mark.parametrize("gqa", [1, 3, 5, 8])
def test_decode_matches_the_oracle_across_chunks_and_row_blocks(backend, head_size, gqa):
    query, cache, md = make_case([1] * len(SEQ), SEQ, 2 * gqa, 2, head_size, 16, torch.bfloat16, seed=gqa)
    assert_matches_oracle(backend, query, cache, md, 1.0 / math.sqrt(head_size), TOL)


@pytest.mark.parametrize("window", [5, 37, 300])
def test_decode_keeps_sliding_windows(backend, window):
    query, cache, md = make_case([1] * len(SEQ), SEQ, 6, 2, 64, 16, torch.bfloat16, seed=window)
    cache = poison_blocks_before_window(cache, md, window)  # blocks wholly before the window hold NaN
    assert_matches_oracle(backend, query, cache, md, 0.125, TOL, window)


def test_decode_with_one_token_blocks(backend):
    # Every key of a tile (and each key pair of the values pass) comes from a different block.
    query, cache, md = make_case([1, 1, 1], [33, 300, 5], 6, 2, 64, 1, torch.bfloat16, seed=3)
    assert_matches_oracle(backend, query, cache, md, 0.125, TOL)


def test_a_request_decodes_the_same_bits_alone_in_a_batch_and_on_any_thread_count(backend):
    assert_decode_bits_alone_and_on_one_thread(backend, 12, 4, 64, torch.bfloat16)


def test_a_one_token_tail_of_a_prompt_takes_the_decode_path_at_its_own_position(backend):
    # 3 query heads per KV head -> 21 tokens per item: a 22-token prompt's last token is an item of its own, at
    # query offset 21 (the decode path must place it there, not at the request's first token), beside decodes.
    query, cache, md = make_case([1, 22, 1, 43], [90, 300, 17, 43], 12, 4, 64, 16, torch.bfloat16, seed=5)
    assert_matches_oracle(backend, query, cache, md, 0.125, TOL)


def test_decodes_with_more_query_heads_than_an_item_has_rows(backend):
    # A decode request is one work unit with every head: 80 query heads (group 1, head 32) outnumber the 64 rows
    # an item's scratch holds, so the scratch must be sized for the heads.
    query, cache, md = make_case([1, 1, 1], [70, 300, 5], 80, 80, 32, 16, torch.bfloat16, seed=8)
    assert_matches_oracle(backend, query, cache, md, 1.0 / math.sqrt(32), TOL)


@pytest.mark.parametrize("threads", [1, 2, 3, 5])
def test_decodes_split_across_threads_cover_every_request_once(backend, threads):
    # The decodes are split into contiguous per-thread runs by keys (uneven lengths, more threads than some runs
    # need): every request's output must still come out, the same bits at any thread count.
    seqs = [700, 3, 40, 41, 1, 300, 16, 17, 257]
    query, cache, md = make_case([1] * len(seqs), seqs, 6, 2, 64, 16, torch.bfloat16, seed=13)
    with torch_threads(threads):
        got = assert_matches_oracle(backend, query, cache, md, 0.125, TOL)
    assert torch.equal(got, backend.forward(query, cache, md, 0.125))
