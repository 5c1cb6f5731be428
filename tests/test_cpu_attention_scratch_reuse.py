"""The CPU attention kernel keeps its small per-thread scratch between calls of one shape (csrc/attention.cpp's
call_scratch: a decode step's layers and steps reuse it) and rebuilds it when the shape changes: every call still
gives what a fresh call gives, bit for bit, whatever ran before it (another shape, larger or smaller, or the same
shape with inf and NaN in its query), on every key loop the build has."""

from __future__ import annotations

import pytest
import torch

from vllm_lite.testing.attention_oracle import random_attention_case, reference_paged_attention
from vllm_lite.testing.torch_threads import torch_threads
from vllm_lite.worker.attention.cpu_kernels import cpu_op
from vllm_lite.worker.attention.cpu_native import CpuNativeBackend

pytestmark = pytest.mark.skipif(cpu_op("paged_attention") is None, reason="CPU kernels not built here")

HEADS, KV_HEADS, HEAD = 6, 2, 64  # a decode item holds 6 rows: the scratch pads them to 8
DECODES = ([1] * 5, [33, 257, 90, 600, 17])
SAME_SHAPE = ([1] * 3, [300, 12, 81])  # decodes again: the kept scratch
WIDER = ([40, 1, 1], [300, 520, 64])  # a prefill chunk of 40 tokens (120 rows): rebuilt, still kept (<= 256)
LONG = ([300, 1], [300, 77])  # 900 rows: a call's own scratch, the kept one left as it was


def _case(shape, dtype, seed):
    return random_attention_case(shape[0], shape[1], HEADS, KV_HEADS, HEAD, 16, dtype, seed=seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("impl", ["auto", "portable"])
def test_a_call_gives_the_same_bits_whatever_the_calls_before_it_left(dtype, impl):
    backend = CpuNativeBackend(impl=impl)
    q, cache, md = _case(DECODES, dtype, seed=1)
    with torch_threads(2):
        first = backend.forward(q, cache, md, 0.125)
        torch.testing.assert_close(first.double(), reference_paged_attention(q, cache, md, 0.125), atol=3e-2, rtol=3e-2)
        for shape, seed in ((SAME_SHAPE, 2), (WIDER, 3), (LONG, 4), (DECODES, 5), (WIDER, 6)):
            q2, cache2, md2 = _case(shape, dtype, seed)
            if shape is SAME_SHAPE:
                q2[0, 0, :] = float("inf")  # left in the kept q rows for the next call to find
                q2[1, 3, :] = float("nan")
            out = backend.forward(q2, cache2, md2, 0.125)
            if shape is not SAME_SHAPE:
                torch.testing.assert_close(
                    out.double(), reference_paged_attention(q2, cache2, md2, 0.125), atol=3e-2, rtol=3e-2
                )
            again = backend.forward(q, cache, md, 0.125)
            assert torch.equal(again, first), f"decodes after {shape} differ from the first call"
