"""The bfloat16 prefill path of the C++ CPU attention kernel (csrc/attention_prefill_bf16.h: keys transposed and
values paired once per 256-key chunk, VDPBF16PS scores and P@V over register blocks of rows, probabilities rounded
to bf16 before P@V), which prompt items of a bf16 cache without a sliding window take on AVX512-BF16 builds.

Its promise: every prompt token's output is the bits the decode path gives a single query token at the same
position with the same keys, so the oracle here is attention_decode_bf16.h itself (tested against float64 in
test_cpu_attention_decode_bf16.py), plus the float64 oracle over chunk edges, GQA groups, head sizes, prompts with
cached context (chunked prefill) and one-token blocks; and the bits do not depend on the batch or the thread count.
Skipped where the build does not target AVX512-BF16.
"""

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


# Prompts from scratch and with cached context; lengths around the 16-key tiles, the 21-token items (3 heads per KV
# head) and the 256-key chunks.
CASES = [
    ([22, 5, 300], [22, 5, 300]),
    ([2, 40, 257], [258, 300, 600]),
    ([64, 17, 33], [700, 17, 290]),
]


@pytest.mark.parametrize("head_size", [32, 64, 128, 256])
@pytest.mark.parametrize("gqa", [1, 3, 8])
def test_prefill_matches_the_oracle(backend, head_size, gqa):
    for n, (qlens, slens) in enumerate(CASES):
        query, cache, md = make_case(qlens, slens, 2 * gqa, 2, head_size, 16, torch.bfloat16, seed=gqa + n)
        scale = 1.0 / math.sqrt(head_size)
        out = backend.forward(query, cache, md, scale)
        torch.testing.assert_close(out.double(), oracle_attention(query, cache, md, scale), atol=TOL, rtol=TOL)


@pytest.mark.parametrize("head_size", [32, 64, 128, 256])
@pytest.mark.parametrize("gqa", [1, 3, 5])
@pytest.mark.parametrize("block_size", [1, 16])
def test_each_prompt_token_gets_the_bits_of_a_decode_at_its_position(backend, head_size, gqa, block_size):
    for n, (qlens, slens) in enumerate(CASES):
        query, cache, md = make_case(qlens, slens, 2 * gqa, 2, head_size, block_size, torch.bfloat16, seed=7 + n)
        scale = 1.0 / math.sqrt(head_size)
        prefill = backend.forward(query, cache, md, scale)
        decode = backend.forward(query, cache, as_decodes(md, block_size), scale)
        assert torch.equal(prefill, decode), (qlens, slens, (prefill != decode).nonzero()[:5].tolist())


def test_a_prompt_gets_the_same_bits_alone_in_a_batch_and_on_any_thread_count(backend):
    query, cache, md = make_case([1, 300, 7, 60], [90, 600, 40, 60], 12, 4, 64, 16, torch.bfloat16, seed=11)
    together = backend.forward(query, cache, md, 0.125)
    solo_md = make_attention_metadata([300], [600], [md.block_table[1, :38].tolist()], 16)
    solo = backend.forward(query[1:301].contiguous(), cache, solo_md, 0.125)
    assert torch.equal(solo, together[1:301])
    before = torch.get_num_threads()
    try:
        for threads in (1, 3):
            torch.set_num_threads(threads)
            assert torch.equal(backend.forward(query, cache, md, 0.125), together)
    finally:
        torch.set_num_threads(before)


def test_sliding_windows_still_match_the_oracle(backend):
    # A window moves each row's chunk boundaries: those prompts keep the key loop, which must still be right.
    query, cache, md = make_case([40, 300], [100, 300], 6, 2, 64, 16, torch.bfloat16, seed=4)
    out = backend.forward(query, cache, md, 0.125, 37)
    torch.testing.assert_close(out.double(), oracle_attention(query, cache, md, 0.125, 37), atol=TOL, rtol=TOL)
