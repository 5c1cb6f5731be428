"""Engine configuration: plain dataclasses, built from `EngineArgs`.

Everything here is cheap to construct; reading the checkpoint's config.json
happens in `ModelConfig.from_pretrained_dir`, never in the hot path.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

_STR_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype, config_dtype: Optional[str], device: torch.device) -> torch.dtype:
    """'auto' takes the checkpoint's dtype; float16 becomes bfloat16 on CPU (fp16 matmuls crawl there)."""
    if isinstance(dtype, torch.dtype):
        out = dtype
    elif dtype == "auto":
        out = _STR_DTYPES.get(str(config_dtype).replace("torch.", ""), torch.float32) if config_dtype else torch.float32
    elif dtype in _STR_DTYPES:
        out = _STR_DTYPES[dtype]
    else:
        raise ValueError(f"dtype must be one of 'auto', {sorted(_STR_DTYPES)}, got {dtype!r}.")
    if device.type == "cpu" and out == torch.float16:
        out = torch.bfloat16
    return out


@dataclass
class ModelConfig:
    model: str
    tokenizer: str
    dtype: torch.dtype
    max_model_len: int
    hf_config: dict[str, Any]
    architecture: str
    vocab_size: int
    seed: int = 0
    served_model_name: Optional[str] = None

    @property
    def name(self) -> str:
        return self.served_model_name or self.model

    @staticmethod
    def read_hf_config(model: str) -> dict[str, Any]:
        if not os.path.isdir(model):
            raise FileNotFoundError(f"Model directory {model!r} does not exist (no model hub here: pass a local path).")
        path = os.path.join(model, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"Model directory {model!r} has no config.json.")
        with open(path) as f:
            return json.load(f)


@dataclass
class CacheConfig:
    block_size: int = 16
    kv_cache_memory_bytes: Optional[int] = None  # None: a default for the device
    enable_prefix_caching: bool = True
    swap_space_bytes: int = 1 << 30
    preemption_mode: str = "recompute"  # or "swap"
    # Set once the worker has sized the cache.
    num_gpu_blocks: Optional[int] = None
    num_cpu_blocks: Optional[int] = None


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int = 2048
    long_prefill_token_threshold: int = 0  # 0: a prompt may take the whole budget in one step
    policy: str = "fcfs"  # or "priority"
    log_stats_interval_s: float = 10.0


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1


@dataclass
class DeviceConfig:
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    num_threads: Optional[int] = None  # torch intra-op threads in the engine core; None: a policy


@dataclass
class VllmConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    device_config: DeviceConfig


@dataclass
class EngineArgs:
    """Every engine knob a user can set, with vLLM's names."""

    model: str
    tokenizer: Optional[str] = None
    dtype: str = "auto"
    seed: int = 0
    max_model_len: Optional[int] = None
    block_size: int = 16
    kv_cache_memory_bytes: Optional[int] = None
    enable_prefix_caching: bool = True
    swap_space: float = 1.0  # GiB of host memory for swapped-out blocks
    preemption_mode: str = "recompute"
    max_num_batched_tokens: Optional[int] = None
    max_num_seqs: int = 128
    long_prefill_token_threshold: int = 0
    scheduling_policy: str = "fcfs"
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    device: str = "auto"
    num_threads: Optional[int] = None
    served_model_name: Optional[str] = None

    def create_engine_config(self) -> VllmConfig:
        hf = ModelConfig.read_hf_config(self.model)
        archs = hf.get("architectures") or []
        if not archs:
            raise ValueError(f"config.json in {self.model!r} names no architectures.")
        device = resolve_device(self.device)
        dtype = resolve_dtype(self.dtype, hf.get("torch_dtype") or hf.get("dtype"), device)
        max_pos = hf.get("max_position_embeddings") or 2048
        max_model_len = self.max_model_len or max_pos
        if max_model_len > max_pos:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={max_pos}."
            )
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size!r}.")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}.")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}.")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs!r}.")
        max_batched = self.max_num_batched_tokens or max(2048, min(max_model_len, 8192))
        if max_batched < 1:
            raise ValueError(f"max_num_batched_tokens must be at least 1, got {max_batched!r}.")
        model_config = ModelConfig(
            model=self.model,
            tokenizer=self.tokenizer or self.model,
            dtype=dtype,
            max_model_len=max_model_len,
            hf_config=hf,
            architecture=archs[0],
            vocab_size=int(hf.get("vocab_size", 0)),
            seed=self.seed,
            served_model_name=self.served_model_name,
        )
        return VllmConfig(
            model_config=model_config,
            cache_config=CacheConfig(
                block_size=self.block_size,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                enable_prefix_caching=self.enable_prefix_caching,
                swap_space_bytes=int(self.swap_space * (1 << 30)),
                preemption_mode=self.preemption_mode,
            ),
            scheduler_config=SchedulerConfig(
                max_num_batched_tokens=max_batched,
                max_num_seqs=self.max_num_seqs,
                max_model_len=max_model_len,
                long_prefill_token_threshold=self.long_prefill_token_threshold,
                policy=self.scheduling_policy,
            ),
            parallel_config=ParallelConfig(
                tensor_parallel_size=self.tensor_parallel_size,
                data_parallel_size=self.data_parallel_size,
            ),
            device_config=DeviceConfig(device=device, num_threads=self.num_threads),
        )
