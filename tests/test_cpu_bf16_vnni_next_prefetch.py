"""The decoder stack's next-linear prefetch (csrc/fused_cpu_ops.cpp's set_vnni_next_weight before each linear,
csrc/bf16_small_m.cpp's NextCall): a VNNI call's threads, at their last block, prefetch the first block each will
take of the next linear's weight, by the rule thread_first_block states for a grain-1 at::parallel_for. A prefetch
changes no bits (the stack's outputs against the Python layers at VNNI row counts: test_cpu_decoder_stack.py), so
what can go wrong is the rule: here it is checked against at::parallel_for's own split (bf16_vnni_first_blocks)
at 1-3 threads over block counts below, at and above the thread count and the model's shapes' counts."""

from __future__ import annotations

import pytest
import torch

from vllm_lite.testing.torch_threads import torch_threads
from vllm_lite.worker.models import cpu_prepack

pytestmark = pytest.mark.skipif(
    not (cpu_prepack.vnni_kernel_available() and hasattr(torch.ops.vllm_lite, "bf16_vnni_first_blocks")),
    reason="bf16 VNNI kernel not built here (needs AVX512-BF16)",
)

BLOCKS = [1, 2, 3, 4, 5, 7, 24, 40, 96, 192, 1000]  # 24 / 40 / 96 / 192 / 1000: o, qkv, gate_up, down, LM head


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_each_threads_first_block_is_the_one_parallel_for_gives_it(threads) -> None:
    with torch_threads(threads):
        for blocks in BLOCKS:
            pairs = torch.ops.vllm_lite.bf16_vnni_first_blocks(blocks)
            assert len(pairs) == 2 * threads
            taken, named = pairs[0::2], pairs[1::2]
            assert taken == named, f"{blocks} blocks on {threads} threads: parallel_for {taken}, rule {named}"
            assert taken[0] == 0
