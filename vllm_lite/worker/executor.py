"""Executors: how the engine core reaches its worker(s)."""

from __future__ import annotations

from vllm_lite.config import VllmConfig
from vllm_lite.worker.gpu_worker import GPUWorker
from vllm_lite.worker.step import ModelRunnerOutput, SchedulerOutput


class UniProcExecutor:
    """Runs the single worker in the engine core's own process."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        self.worker = GPUWorker(vllm_config)

    def determine_num_blocks(self) -> tuple[int, int]:
        return self.worker.determine_num_blocks()

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self.worker.initialize_cache(num_gpu_blocks, num_cpu_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def shutdown(self) -> None:
        pass
