"""GPUWorker: owns one device, its model runner and its share of the KV cache."""

from __future__ import annotations

import logging
from typing import Any, Union

import torch

from vllm_lite.config import VllmConfig
from vllm_lite.worker.cpu_malloc import apply_cpu_malloc_policy
from vllm_lite.worker.kv_cache_sizing import (
    blocks_per_seq,
    describe_kv_cache,
    kv_budget_from_utilization,
    num_kv_blocks,
    override_num_blocks,
)
from vllm_lite.worker.model_runner import GPUModelRunner
from vllm_lite.worker.models.sliding_window import uniform_sliding_window
from vllm_lite.worker.step import AsyncModelRunnerOutput, ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

# KV-cache budget on CPU where the user gives none (CUDA profiles the card instead).
_CPU_DEFAULT_KV_BYTES = 2 << 30


def indexed_device(device: torch.device, local_rank: int = 0) -> torch.device:
    """The device with an explicit index where CUDA needs one (`cuda` -> `cuda:local_rank`).

    `torch.cuda.set_device`, NCCL and memory queries reject or misplace an index-less CUDA device.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", local_rank)
    return device


class GPUWorker:
    def __init__(self, vllm_config: VllmConfig) -> None:
        self.config = vllm_config
        self.device = indexed_device(vllm_config.device_config.device)
        vllm_config.device_config.device = self.device
        self._free_at_start = 0
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            # Before the weights load: what this instance takes is measured from here (vLLM's per-instance
            # gpu_memory_utilization; other processes on the card are not charged to it).
            self._free_at_start = torch.cuda.mem_get_info(self.device)[0]
        torch.manual_seed(vllm_config.model_config.seed)
        self.model_runner = GPUModelRunner(vllm_config, self.device)

    def determine_num_blocks(self) -> tuple[int, int]:
        """(device blocks, host swap blocks) from the memory budget, capped at what can ever be used; or exactly
        num_gpu_blocks_override device blocks (vLLM's: no budget, no profiling pass)."""
        cc, sc = self.config.cache_config, self.config.scheduler_config
        per_block = self.model_runner.kv_cache_bytes_per_block()
        per_seq = self._blocks_per_seq()
        if cc.num_gpu_blocks_override is not None:
            num_gpu = override_num_blocks(cc.num_gpu_blocks_override, cc.block_size, sc.max_model_len, per_seq)
            logger.info("num_gpu_blocks_override=%d: the KV cache gets exactly that many blocks", num_gpu)
            if self.device.type == "cuda" and per_block:
                self._check_override_fits(num_gpu, per_block)
        elif per_block == 0:  # no layer keeps a KV cache (an encoder such as BERT): blocks are bookkeeping only
            return -(-sc.max_model_len // cc.block_size) * sc.max_num_seqs + 1, 0
        else:
            if cc.kv_cache_memory_bytes is not None:
                budget = cc.kv_cache_memory_bytes
            elif self.device.type == "cuda":
                budget = self._profiled_cuda_budget()
            else:
                budget = _CPU_DEFAULT_KV_BYTES
            num_gpu = num_kv_blocks(budget, per_block, cc.block_size, sc.max_model_len, sc.max_num_seqs, per_seq)
        if per_block:
            logger.info(describe_kv_cache(num_gpu, per_block, cc.block_size, sc.max_model_len, per_seq))
        num_cpu = 0
        if cc.preemption_mode == "swap" and per_block:
            num_cpu = min(cc.swap_space_bytes // per_block, per_seq * sc.max_num_seqs + 1)
        return int(num_gpu), int(num_cpu)

    def _check_override_fits(self, num_gpu: int, per_block: int) -> None:
        """Under num_gpu_blocks_override, still the profiling pass (as vLLM): the largest step's kernels compile at
        start-up, not in the first big step a user sends, and a block count the card cannot hold is said now (a
        warning: the user asked for it) instead of as an out-of-memory error mid-serving."""
        try:
            budget = self._profiled_cuda_budget()
        except ValueError as e:  # nothing left for any KV cache under gpu_memory_utilization
            budget, why = 0, f" ({e})"
        else:
            why = ""
        if num_gpu * per_block > budget:
            logger.warning(
                "num_gpu_blocks_override=%d needs %.2f GiB of KV cache, more than the %.2f GiB the memory budget "
                "leaves (gpu_memory_utilization=%.2f)%s: steps may run out of memory",
                num_gpu,
                num_gpu * per_block / (1 << 30),
                budget / (1 << 30),
                self.config.cache_config.gpu_memory_utilization,
                why,
            )

    def _blocks_per_seq(self) -> int:
        """Blocks one sequence holds at most: a uniform sliding window bounds it by the window plus one
        step's tokens (the largest token budget, plus speculative lookahead slots)."""
        cc, sc = self.config.cache_config, self.config.scheduler_config
        window = uniform_sliding_window(self.config.model_config.hf_config)
        spec = getattr(self.config, "speculative_config", None)
        lookahead = int(getattr(spec, "num_speculative_tokens", 0) or 0) if spec is not None else 0
        return blocks_per_seq(cc.block_size, sc.max_model_len, window, sc.max_num_batched_tokens + lookahead)

    def _profiled_cuda_budget(self) -> int:
        """gpu_memory_utilization of the card, less what is in use after loading the weights, less the
        peak activations of a profiling pass at the largest step (vLLM's determine_num_available_blocks)."""
        torch.cuda.empty_cache()
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        peak = self.model_runner.profile_run()
        torch.cuda.empty_cache()
        utilization = self.config.cache_config.gpu_memory_utilization
        graphs = self.model_runner.cuda_graph_reserve_bytes(peak)  # captured after the KV cache: held back now
        own = max(0, self._free_at_start - free)  # this process's weights and buffers
        budget = kv_budget_from_utilization(total, utilization, own, peak + graphs, free_bytes=free)
        logger.debug(
            "memory on %s: %.2f GiB total x %.2f, %.2f GiB taken by this instance after loading, %.2f GiB peak "
            "activations, %.2f GiB for CUDA graphs",
            self.device,
            total / (1 << 30),
            utilization,
            own / (1 << 30),
            peak / (1 << 30),
            graphs / (1 << 30),
        )
        return budget

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(num_gpu_blocks, num_cpu_blocks)
        self.model_runner.capture_cuda_graphs()  # decode graphs bind the cache's tensors (none off CUDA)
        if self.device.type == "cpu":
            apply_cpu_malloc_policy()  # steps' activations keep their heap pages from here on (worker/cpu_malloc.py)

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> Union[ModelRunnerOutput, AsyncModelRunnerOutput]:
        """One step; `non_block` (async scheduling): an AsyncModelRunnerOutput, the tokens still on their way."""
        if non_block:
            return self.model_runner.execute_model(scheduler_output, non_block=True)
        return self.model_runner.execute_model(scheduler_output)

    def lora_call(self, method: str, *args: Any) -> Any:
        """add_lora / remove_lora / list_loras / pin_lora (vLLM's worker methods) on this worker's adapters."""
        return self.model_runner.lora_call(method, *args)
