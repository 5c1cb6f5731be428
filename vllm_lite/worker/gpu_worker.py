"""GPUWorker: owns one device, its model runner and its share of the KV cache."""

from __future__ import annotations

import logging

import torch

from vllm_lite.config import VllmConfig
from vllm_lite.worker.model_runner import GPUModelRunner
from vllm_lite.worker.step import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

# Default KV-cache budget where the user gives none.
_CPU_DEFAULT_KV_BYTES = 2 << 30
_CUDA_DEFAULT_FRACTION = 0.8


class GPUWorker:
    def __init__(self, vllm_config: VllmConfig) -> None:
        self.config = vllm_config
        self.device = vllm_config.device_config.device
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        torch.manual_seed(vllm_config.model_config.seed)
        self.model_runner = GPUModelRunner(vllm_config, self.device)

    def determine_num_blocks(self) -> tuple[int, int]:
        """(device blocks, host swap blocks) from the memory budget, capped at what can ever be used."""
        cc, sc = self.config.cache_config, self.config.scheduler_config
        per_block = self.model_runner.kv_cache_bytes_per_block()
        budget = cc.kv_cache_memory_bytes
        if budget is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                budget = int(free * _CUDA_DEFAULT_FRACTION)
            else:
                budget = _CPU_DEFAULT_KV_BYTES
        blocks_per_seq = -(-sc.max_model_len // cc.block_size)
        useful = blocks_per_seq * sc.max_num_seqs + 1  # +1: the null block
        num_gpu = min(budget // per_block, useful)
        if num_gpu < blocks_per_seq + 1:
            need = (blocks_per_seq + 1) * per_block
            raise ValueError(
                f"KV cache too small: {budget} bytes hold {budget // per_block} blocks of {cc.block_size} tokens, "
                f"but one max_model_len={sc.max_model_len} sequence needs {blocks_per_seq + 1} blocks "
                f"({need} bytes). Raise kv_cache_memory_bytes or lower max_model_len."
            )
        num_cpu = 0
        if cc.preemption_mode == "swap":
            num_cpu = min(cc.swap_space_bytes // per_block, useful)
        return int(num_gpu), int(num_cpu)

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(num_gpu_blocks, num_cpu_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output)
