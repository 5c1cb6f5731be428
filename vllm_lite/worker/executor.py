"""Executors: how the engine core reaches its worker(s)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Union

from vllm_lite.config import VllmConfig
from vllm_lite.worker.gpu_worker import GPUWorker
from vllm_lite.worker.step import SchedulerOutput

if TYPE_CHECKING:
    from vllm_lite.worker.multiproc_executor import MultiprocExecutor


class UniProcExecutor:
    """Runs the single worker in the engine core's own process."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        self.worker = GPUWorker(vllm_config)

    def determine_num_blocks(self) -> tuple[int, int]:
        return self.worker.determine_num_blocks()

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self.worker.initialize_cache(num_gpu_blocks, num_cpu_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput, non_block: bool = False) -> Any:
        """The step's ModelRunnerOutput; with non_block (async scheduling) a handle whose get_output() returns it,
        so the engine core can schedule the next step while this one runs."""
        if non_block:
            return self.worker.execute_model(scheduler_output, non_block=True)
        return self.worker.execute_model(scheduler_output)

    def lora_call(self, method: str, *args: Any) -> Any:
        """The worker's add_lora / remove_lora / list_loras / pin_lora."""
        return self.worker.lora_call(method, *args)

    def shutdown(self) -> None:
        pass


def get_executor_class(vllm_config: VllmConfig) -> type[Union["UniProcExecutor", "MultiprocExecutor"]]:
    """UniProcExecutor for one device; MultiprocExecutor (one process per rank) for tensor parallelism."""
    if vllm_config.parallel_config.tensor_parallel_size > 1:
        from vllm_lite.worker.multiproc_executor import MultiprocExecutor

        return MultiprocExecutor
    return UniProcExecutor
