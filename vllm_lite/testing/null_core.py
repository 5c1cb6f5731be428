"""A core that does no work, for measuring transport (benchmarks/overhead.py).

``NullCore`` has EngineCore's interface and emits one token per running request per step;
``NullInprocClient`` / ``NullSyncMPClient`` are the real clients driving it in-process, or in a
core process the launcher starts as ``python -m vllm_lite.testing.null_core_main``.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import torch

from vllm_lite.client.core_client import InprocClient, PrivateCore, SyncMPClient, spawn_private_core
from vllm_lite.config import CacheConfig, DeviceConfig, ModelConfig, ParallelConfig, SchedulerConfig, VllmConfig
from vllm_lite.core.engine_core_proc import EngineCoreProc
from vllm_lite.core.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from vllm_lite.worker.step import LogprobsTensors

NULL_CORE_MODULE = "vllm_lite.testing.null_core_main"


class NullCore:
    """EngineCore's interface doing no work: each step emits one token per running request."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        self.model_facts = {
            "model": "null",
            "max_model_len": 1 << 20,
            "block_size": 16,
            "num_gpu_blocks": 0,
            "vocab_size": 32000,
        }
        self.reqs: dict[str, EngineCoreRequest] = {}
        self.logprobs = int(vllm_config.model_config.hf_config.get("logprobs", 0))
        self.step_s = float(vllm_config.model_config.hf_config.get("step_ms", 0.0)) / 1000

    def add_request(self, request: EngineCoreRequest, tenant_salt: Optional[bytes] = None) -> None:
        self.reqs[request.request_id] = request

    def abort_requests(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.reqs.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.reqs)

    def step(self) -> dict[int, EngineCoreOutputs]:
        if self.step_s:
            time.sleep(self.step_s)  # stands in for the model's forward pass (releases the GIL like it)
        outs = []
        for rid in self.reqs:
            o = EngineCoreOutput(rid, [7])
            if self.logprobs:
                k = self.logprobs + 1
                o.new_logprobs = LogprobsTensors(
                    torch.zeros(1, k, dtype=torch.int64), torch.zeros(1, k), torch.ones(1, dtype=torch.int64)
                )
            outs.append(o)
        return {0: EngineCoreOutputs(outputs=outs, scheduler_stats=SchedulerStats(num_running_reqs=len(outs)))}

    def take_ready_outputs(self) -> list:
        """EngineCore's: outputs a drain left to send before a utility answer (none: no step is ever in flight)."""
        return []

    def call_utility(self, method: str, args: list) -> Any:
        if method == "ping":
            return True
        raise ValueError(f"unknown utility method {method!r}")

    def shutdown(self) -> None:
        pass


def null_config(logprobs: int, step_ms: float = 0.0) -> VllmConfig:
    return VllmConfig(
        ModelConfig("null", "null", torch.float32, 1 << 20, {"logprobs": logprobs, "step_ms": step_ms}, "Null", 32000),
        CacheConfig(),
        SchedulerConfig(),
        ParallelConfig(),
        DeviceConfig(num_threads=1),
    )


class NullEngineCoreProc(EngineCoreProc):
    def _make_engine_core(self, vllm_config: VllmConfig) -> Any:
        return NullCore(vllm_config)


class NullInprocClient(InprocClient):
    def _make_engine_core(self, vllm_config: VllmConfig) -> Any:
        return NullCore(vllm_config)


class NullSyncMPClient(SyncMPClient):
    def _spawn_core(self, vllm_config: VllmConfig, startup_timeout_s: float) -> PrivateCore:
        return spawn_private_core(vllm_config, startup_timeout_s, module=NULL_CORE_MODULE)
