"""Picks the attention backend for a device: Triton on CUDA, native C++ on CPU, PyTorch as the fallback.

`name` (or env VLLM_LITE_ATTENTION_BACKEND) forces one: "torch", "cpu" or "triton".
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from vllm_lite import envs
from vllm_lite.worker.attention.backend import AttentionBackend

logger = logging.getLogger(__name__)

ENV_VAR = "VLLM_LITE_ATTENTION_BACKEND"
BACKEND_NAMES = ("torch", "cpu", "triton")


def _make(name: str) -> AttentionBackend:
    if name == "torch":
        from vllm_lite.worker.attention.torch_ref import TorchRefBackend

        return TorchRefBackend()
    if name == "cpu":
        from vllm_lite.worker.attention.cpu_native import CpuNativeBackend

        return CpuNativeBackend()
    from vllm_lite.worker.attention.triton_attn import TritonBackend

    return TritonBackend()


def _check_name(name: str, source: str) -> str:
    key = name.strip().lower()
    if key not in BACKEND_NAMES:
        raise ValueError(f"{source} must be one of {list(BACKEND_NAMES)}, got {name!r}.")
    return key


def get_attn_backend(device: torch.device | str, name: Optional[str] = None) -> AttentionBackend:
    """The backend to use on `device`; a forced name that cannot run there raises instead of falling back."""
    device = torch.device(device)
    if name is not None:
        forced = _check_name(name, "attention backend name")
    elif envs.VLLM_LITE_ATTENTION_BACKEND:
        forced = _check_name(envs.VLLM_LITE_ATTENTION_BACKEND, ENV_VAR)
    else:
        forced = None
    if forced is not None:
        if forced == "cpu" and device.type != "cpu":
            raise ValueError(f"attention backend 'cpu' runs only on CPU tensors, not on {device}.")
        backend = _make(forced)
        logger.info("attention backend: %s (forced)", backend.name)
        return backend
    if device.type == "cuda":
        backend = _make("triton")
    elif device.type == "cpu":
        from vllm_lite.worker.attention.cpu_kernels import load_cpu_ops

        backend = _make("cpu") if load_cpu_ops() else _make("torch")
    else:
        backend = _make("torch")
    logger.info("attention backend for %s: %s", device, backend.name)
    return backend
