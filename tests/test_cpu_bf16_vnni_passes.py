"""The VNNI kernels' pass schedule (csrc/bf16_small_m.cpp, `vnni_passes`): a weight block's rows go in balanced
register blocks of 1-12 rows, each pass a loop compiled for its prefetch of the thread's next block (both lines
of a pair in the only pass, one line in each of the first two passes, none in later passes or at a thread's
last block). Every row count 1-64 reaches a different mix of those loops, so each is checked: the plain op within
one bf16 rounding of float64 and, row by row, the bits of that row computed alone (at 1 and 2 threads, with four
weight blocks so each thread has a block with a next one and a last one); the gate_up op without SiLU gives the
plain op's bits over the same interleaved weight."""

from __future__ import annotations

import pytest
import torch

from vllm_lite.testing.bf16_bounds import linear_reference_and_bound
from vllm_lite.testing.torch_threads import torch_threads
from vllm_lite.worker.models import cpu_prepack

pytestmark = pytest.mark.skipif(
    not (cpu_prepack.vnni_kernel_available() and hasattr(torch.ops.vllm_lite, "bf16_gate_up_vnni")),
    reason="bf16 VNNI kernel not built here (needs AVX512-BF16)",
)

N, K = 128, 70  # four 32-output blocks; K even, short, not a multiple of 32
ROWS = list(range(1, 65))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def _data():
    g = torch.Generator().manual_seed(15)
    x = torch.randn(64, K, generator=g).bfloat16()
    w = (torch.randn(N, K, generator=g) * 0.05).bfloat16()
    bias = torch.randn(N, generator=g).bfloat16()
    return x, w, bias


@pytest.fixture(scope="module")
def alone():
    """Each of the 64 rows through the kernel by itself (one pass of one row), at 2 threads."""
    x, w, bias = _data()
    wv = cpu_prepack.vnni_weight(w)
    return torch.cat([torch.ops.vllm_lite.bf16_linear_vnni(x[i : i + 1], wv, N, bias) for i in range(64)])


@pytest.mark.parametrize("threads", [1, 2])
def test_every_row_count_gets_each_rows_own_bits_within_the_bound(alone, threads) -> None:
    x, w, bias = _data()
    wv = cpu_prepack.vnni_weight(w)
    ref, ulp = linear_reference_and_bound(x, w, bias)
    with torch_threads(threads):
        for rows in ROWS:
            got = torch.ops.vllm_lite.bf16_linear_vnni(x[:rows], wv, N, bias)
            assert ((got.double() - ref[:rows]).abs() <= ulp[:rows]).all(), rows
            assert torch.equal(_bits(got), _bits(alone[:rows])), rows


@pytest.mark.parametrize("threads", [1, 2])
def test_gate_up_without_silu_gets_the_plain_ops_bits_at_every_row_count(threads) -> None:
    x, w, _ = _data()
    d = N // 2
    wi = cpu_prepack.interleave_gate_up(w, d)
    wv = cpu_prepack.vnni_weight(wi)
    with torch_threads(threads):
        for rows in ROWS:
            plain = torch.ops.vllm_lite.bf16_linear_vnni(x[:rows], wv, N, None)
            plain = plain.view(rows, -1, 2, cpu_prepack.GATE_UP_BLOCK)  # blocks of 16 gate, then 16 up outputs
            want = torch.cat([plain[:, :, 0].flatten(1), plain[:, :, 1].flatten(1)], 1)
            got = torch.ops.vllm_lite.bf16_gate_up_vnni(x[:rows], wv, d, None, False)
            assert torch.equal(_bits(got), _bits(want)), rows
