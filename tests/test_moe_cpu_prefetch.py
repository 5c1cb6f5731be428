"""csrc/moe_cpu.cpp's weight prefetch at decode (Prefetch / NextBlock): while an item's tiles compute, they prefetch
the thread's next weight block into L2. It must not change a single bit of either expert op's output, over row
counts that give an item one tile (1, 2, 4, 8 rows: the whole next block from the first tile), several tiles
(the block split over the first two), more than 64 rows (no prefetch), a thread's last item (the next phase's
first block), skewed routings (one expert takes every token) and 1 or 2 threads; and moe_cpu_prefetch(enable)
returns the previous setting (benchmarks/moe_cpu_ab.py --ab prefetch switches it between passes).
"""

from __future__ import annotations

import pytest
import torch

from vllm_lite.worker.attention.cpu_kernels import cpu_op
from vllm_lite.worker.models import fused_moe as fm

pytestmark = pytest.mark.skipif(cpu_op("moe_cpu_prefetch") is None, reason="csrc's CPU kernels are not built here")


@pytest.fixture
def prefetch():
    """The switch, restored to what it was after the test."""
    op = cpu_op("moe_cpu_prefetch")
    before = op(True)
    op(before)
    yield op
    op(before)


def test_the_switch_returns_the_previous_setting(prefetch) -> None:
    prefetch(True)
    assert prefetch(False) is True
    assert prefetch(False) is False
    assert prefetch(True) is False
    assert prefetch(True) is True


def _routings(t: int, e: int, k: int, g: torch.Generator):
    weights, ids = fm.route(torch.randn(t, e, generator=g), k, renormalize=True)
    yield weights, ids
    # Every token's first choice is expert 0 (an item of t rows), its others spread.
    skew = ids.clone()
    skew[:, 0] = 0
    for j in range(1, k):
        skew[:, j] = torch.where(ids[:, j] == 0, ids[:, 0].clamp(min=1), ids[:, j])
    yield weights, skew


def _compare(experts, x: torch.Tensor, e: int, k: int, prefetch) -> None:
    g = torch.Generator().manual_seed(3)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for weights, ids in _routings(x.shape[0], e, k, g):
                prefetch(False)
                off = experts(x, weights, ids)
                prefetch(True)
                on = experts(x, weights, ids)
                assert torch.equal(on, off), (threads, x.shape[0])
    finally:
        torch.set_num_threads(before)


# tokens: with 8 experts and top-2, 1-8 rows an expert (one-tile items), ~16 (decode: two tiles and a remainder),
# and over 64 rows an expert at 300 tokens (prefill: no prefetch); (4, 40, 24) leaves partial blocks.
@pytest.mark.parametrize("e,h,inter,k", [(8, 256, 896, 2), (4, 40, 24, 2), (6, 64, 100, 3)])
@pytest.mark.parametrize("t", [1, 4, 29, 64, 300])
def test_float32_output_is_the_same_with_and_without_prefetch(prefetch, e, h, inter, k, t) -> None:
    g = torch.Generator().manual_seed(t)
    w13 = torch.randn(e, 2 * inter, h, generator=g) * 0.1
    w2 = torch.randn(e, h, inter, generator=g) * 0.1
    _compare(fm.KernelExperts(w13, w2), torch.randn(t, h, generator=g), e, k, prefetch)


@pytest.mark.skipif(not fm._cpu_moe_bf16_kernel(), reason="the build does not target AVX512-BF16")
@pytest.mark.parametrize("e,h,inter,k", [(8, 256, 896, 2), (4, 40, 24, 2)])
@pytest.mark.parametrize("t", [1, 4, 29, 64, 300])
def test_bfloat16_output_is_the_same_with_and_without_prefetch(prefetch, e, h, inter, k, t) -> None:
    g = torch.Generator().manual_seed(t)
    w13 = (torch.randn(e, 2 * inter, h, generator=g) / h**0.5).bfloat16()
    w2 = (torch.randn(e, h, inter, generator=g) / inter**0.5).bfloat16()
    _compare(fm.Bf16KernelExperts(w13, w2), torch.randn(t, h, generator=g).bfloat16(), e, k, prefetch)
