"""How the bfloat16 decode path (csrc/attention.cpp, attention_decode_bf16.h) shares a batch's decodes between threads.

Each thread runs a contiguous run of (request, KV head) units; a small batch's runs start inside a request (one
decode at 2 threads: each thread takes some of its KV heads), a large batch's at request edges. A request's KV heads
are independent, so every output keeps its bits whatever the thread count: here the same batches at 1-7 threads
(1 thread: no split) give the same bits, every head of every row is written (the output starts as NaN), and the
rows match the float64 oracle. A run that skips or repeats a head, or reads another head's query rows, fails.
Skipped where the build does not target AVX512-BF16.
"""

from __future__ import annotations

import pytest
import torch

from vllm_lite.testing.attention_oracle import random_attention_case as make_case
from vllm_lite.testing.attention_oracle import reference_paged_attention as oracle_attention
from vllm_lite.testing.cpu_bf16_attention import BF16_ATTENTION_TOL as TOL
from vllm_lite.testing.cpu_bf16_attention import avx512_native_backend, requires_avx512_bf16
from vllm_lite.testing.torch_threads import torch_threads
from vllm_lite.worker.attention.cpu_native import CpuNativeBackend

pytestmark = requires_avx512_bf16


@pytest.fixture(scope="module")
def backend() -> CpuNativeBackend:
    return avx512_native_backend()


def _run(backend: CpuNativeBackend, query, cache, md, threads: int) -> torch.Tensor:
    """paged_attention at `threads` torch threads (restored after), into an output filled with NaN."""
    block_table, seq_lens, query_start_loc, _ = backend._step_args(md, md.num_actual_tokens)
    out = torch.full_like(query, float("nan"))
    with torch_threads(threads):
        torch.ops.vllm_lite.paged_attention(
            out, query, cache, block_table, seq_lens, query_start_loc, 0.125, 0, 0.0, "auto"
        )
    return out


# Decode batches (contexts): one decode (split between any 2+ threads), three and four decodes whose whole-request
# split leaves one thread 17-23% over its share (split inside a request), and mixed lengths over chunk edges.
BATCHES = [[287], [300], [287, 239, 211], [287, 239, 211, 156], [1, 16, 37, 257, 600], [95, 313] * 4]


@pytest.mark.parametrize("seqs", BATCHES, ids=lambda s: f"{len(s)}dec")
@pytest.mark.parametrize("gqa,kv_heads", [(3, 4), (1, 4), (2, 3), (4, 2), (1, 7)])
def test_every_thread_count_gives_the_bits_of_one_thread(backend, seqs, gqa, kv_heads):
    query, cache, md = make_case(
        [1] * len(seqs), seqs, gqa * kv_heads, kv_heads, 64, 16, torch.bfloat16, seed=len(seqs)
    )
    one = _run(backend, query, cache, md, 1)
    assert not one.isnan().any()
    torch.testing.assert_close(one.double(), oracle_attention(query, cache, md, 0.125), atol=TOL, rtol=TOL)
    for threads in (2, 3, 4, 7):
        out = _run(backend, query, cache, md, threads)
        missing = out.isnan().any(dim=-1).nonzero()[:5].tolist()
        assert not missing, (threads, "rows x heads never written", missing)
        assert torch.equal(out.view(torch.int16), one.view(torch.int16)), (
            threads,
            (out != one).any(dim=-1).nonzero()[:5].tolist(),
        )


@pytest.mark.parametrize("head_size", [32, 128, 256])
def test_one_decode_split_over_threads_at_every_head_size(backend, head_size):
    query, cache, md = make_case([1], [290], 12, 4, head_size, 16, torch.bfloat16, seed=head_size)
    one = _run(backend, query, cache, md, 1)
    for threads in (2, 3, 5):
        out = _run(backend, query, cache, md, threads)
        assert torch.equal(out.view(torch.int16), one.view(torch.int16)), (head_size, threads)


def test_decodes_beside_prompt_items_keep_their_bits(backend):
    """A mixed batch: the decodes' split runs first, the prompt items' key loops after it, at any thread count."""
    qlens, seqs = [1, 40, 1, 1, 7], [287, 40, 33, 211, 300]
    query, cache, md = make_case(qlens, seqs, 12, 4, 64, 16, torch.bfloat16, seed=5)
    one = _run(backend, query, cache, md, 1)
    torch.testing.assert_close(one.double(), oracle_attention(query, cache, md, 0.125), atol=TOL, rtol=TOL)
    for threads in (2, 3, 4):
        out = _run(backend, query, cache, md, threads)
        assert torch.equal(out.view(torch.int16), one.view(torch.int16)), threads
