"""A small engine config for scheduler tests: a fake model (no weights) over a tiny paged KV cache."""

from __future__ import annotations

import torch

from vllm_lite.config import CacheConfig, DeviceConfig, ModelConfig, ParallelConfig, SchedulerConfig, VllmConfig


def make_config(
    num_gpu_blocks: int = 65,
    block_size: int = 4,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 16,
    max_model_len: int = 256,
    policy: str = "fcfs",
    preemption_mode: str = "recompute",
    enable_prefix_caching: bool = True,
    num_cpu_blocks: int = 0,
    long_prefill_token_threshold: int = 0,
) -> VllmConfig:
    """A VllmConfig whose scheduler and KV cache are real and whose model is only a vocabulary size."""
    model = ModelConfig(
        model="fake",
        tokenizer="fake",
        dtype=torch.float32,
        max_model_len=max_model_len,
        hf_config={},
        architecture="FakeForCausalLM",
        vocab_size=1000,
    )
    cache = CacheConfig(
        block_size=block_size,
        enable_prefix_caching=enable_prefix_caching,
        preemption_mode=preemption_mode,
        num_gpu_blocks=num_gpu_blocks,
        num_cpu_blocks=num_cpu_blocks,
    )
    sched = SchedulerConfig(
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        long_prefill_token_threshold=long_prefill_token_threshold,
        policy=policy,
    )
    return VllmConfig(model, cache, sched, ParallelConfig(), DeviceConfig())
