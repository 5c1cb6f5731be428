"""The float32 decode path of the C++ CPU attention kernel (csrc/attention_avx512.h's decode_f32: scores of a
transposed 16-key tile, one softmax per 256-key chunk, value rows loaded once for a register block of rows),
which decode items of a float32 cache take wherever the AVX-512 key loop runs.

Against the float64 oracle over what the general tests do not reach: contexts of several 256-key chunks (the
online rescale between chunks), odd key counts, GQA groups of 1-8 rows (score blocks of 1-4 rows, value blocks
of 1-4), every head size it takes, sliding windows (blocks before the window hold NaN) and one-token blocks;
and the property greedy decoding relies on: a request's output does not depend on the rest of the batch or on
the thread count, bit for bit. Skipped where the build has no AVX-512 (decodes take the AVX2 loop there, which
test_cpu_attention_impls.py covers).
"""

from __future__ import annotations

import math

import pytest
import torch

from vllm_lite.testing.attention_oracle import poison_blocks_before_window
from vllm_lite.testing.attention_oracle import random_attention_case as make_case
from vllm_lite.testing.decode_attention_checks import DECODE_SEQ_LENS as SEQ
from vllm_lite.testing.decode_attention_checks import assert_decode_bits_alone_and_on_one_thread, assert_matches_oracle
from vllm_lite.worker.attention import cpu_kernels
from vllm_lite.worker.attention.cpu_native import CpuNativeBackend

TOL = 1e-5  # float32, as test_cpu_attention_impls.py


@pytest.fixture(scope="module")
def backend() -> CpuNativeBackend:
    assert cpu_kernels.load_cpu_ops(), "the CPU kernels must build on a machine with a C++ compiler"
    b = CpuNativeBackend("auto")
    if b.key_loop(32) != "avx512":
        pytest.skip("no AVX-512 in this build: float32 decodes take the AVX2 key loop")
    return b


@pytest.mark.parametrize("head_size", [32, 64, 128, 256])
@pytest.mark.parametrize("gqa", [1, 3, 4, 5, 8])
def test_decode_matches_the_oracle_across_chunks_and_row_blocks(backend, head_size, gqa):
    query, cache, md = make_case([1] * len(SEQ), SEQ, 2 * gqa, 2, head_size, 16, torch.float32, seed=gqa)
    assert_matches_oracle(backend, query, cache, md, 1.0 / math.sqrt(head_size), TOL)


@pytest.mark.parametrize("window", [5, 37, 300])
def test_decode_keeps_sliding_windows(backend, window):
    query, cache, md = make_case([1] * len(SEQ), SEQ, 8, 2, 32, 16, torch.float32, seed=window)
    cache = poison_blocks_before_window(cache, md, window)  # blocks wholly before the window hold NaN
    assert_matches_oracle(backend, query, cache, md, 0.125, TOL, window)


def test_decode_with_one_token_blocks(backend):
    # Every key of a tile comes from a different block.
    query, cache, md = make_case([1, 1, 1], [33, 300, 5], 8, 2, 32, 1, torch.float32, seed=3)
    assert_matches_oracle(backend, query, cache, md, 0.125, TOL)


def test_decodes_beside_prefill_chunks_match_the_oracle(backend):
    # A mixed step: decode items take this path, the prefill chunks' items the general key loop.
    query, cache, md = make_case([1, 40, 1, 7, 1], [300, 40, 513, 90, 17], 8, 2, 32, 16, torch.float32, seed=5)
    assert_matches_oracle(backend, query, cache, md, 0.125, TOL)


def test_a_request_decodes_the_same_bits_alone_in_a_batch_and_on_any_thread_count(backend):
    assert_decode_bits_alone_and_on_one_thread(backend, 8, 2, 32, torch.float32)
