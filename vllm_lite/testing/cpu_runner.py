"""A GPUModelRunner on CPU over a KV cache it allocates itself, for tests that drive the runner step by step
(CUDA-graph padding and replay, verify and LoRA steps) without a scheduler."""

from __future__ import annotations

import torch

from vllm_lite.engine_args import EngineArgs
from vllm_lite.testing.checkpoints import get_checkpoint


def cpu_runner(
    block_size: int,
    blocks_per_req: int,
    dtype: str = "float32",
    max_num_seqs: int = 8,
    arch: str = "llama",
    **engine_kwargs,
):
    """A runner for ``arch``'s tiny checkpoint with max_model_len = blocks_per_req * block_size and room for
    ``max_num_seqs`` requests of that length; block 0 is the pool's null block, as the block pool keeps it."""
    from vllm_lite.worker.model_runner import GPUModelRunner

    config = EngineArgs(
        model=get_checkpoint(arch),
        device="cpu",
        dtype=dtype,
        max_model_len=blocks_per_req * block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=256,
        block_size=block_size,
        **engine_kwargs,
    ).create_engine_config()
    runner = GPUModelRunner(config, torch.device("cpu"))
    runner.initialize_kv_cache(1 + max_num_seqs * blocks_per_req, 0)
    return runner
