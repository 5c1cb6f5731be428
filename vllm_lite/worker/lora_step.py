"""The model runner's LoRA hooks, kept here so the runner's step reads as before with three calls added."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import msgspec
import torch
from torch import nn

from vllm_lite.config import VllmConfig
from vllm_lite.lora.request import LoRARequest
from vllm_lite.worker.step import NewRequestData

if TYPE_CHECKING:
    from vllm_lite.lora.model_manager import LoRAModelManager

_METHODS = ("add_lora", "remove_lora", "list_loras", "pin_lora")


def make_lora_manager(config: VllmConfig, model: nn.Module, device: torch.device) -> Optional["LoRAModelManager"]:
    """Wrap the loaded model's projections with adapter slots when enable_lora is on; None otherwise."""
    if config.lora_config is None:
        return None
    from vllm_lite.lora.model_manager import LoRAModelManager

    return LoRAModelManager(model, config.lora_config, device)


def register_new_loras(manager: Optional["LoRAModelManager"], new_reqs: list[NewRequestData]) -> None:
    """Remember the adapter of every request joining the batch (read from disk when a step first needs it)."""
    for new in new_reqs:
        if new.lora_request is None:
            continue
        if manager is None:
            raise ValueError(f"request {new.req_id!r} has a lora_request but LoRA is not enabled (enable_lora).")
        manager.register(new.lora_request)


def lora_call(manager: Optional["LoRAModelManager"], method: str, *args: Any) -> Any:
    if method not in _METHODS:
        raise ValueError(f"unknown LoRA method {method!r}; known: {list(_METHODS)}")
    if manager is None:
        if method == "list_loras":
            return set()
        raise ValueError(f"{method}: LoRA is not enabled; start the engine with enable_lora=True (--enable-lora).")
    if method == "add_lora":
        (req,) = args
        if isinstance(req, dict):  # as it travels to a tensor-parallel rank
            try:
                req = msgspec.convert(req, LoRARequest)
            except msgspec.ValidationError as e:
                raise TypeError(f"add_lora: not a LoRARequest ({e}).") from None
        if not isinstance(req, LoRARequest):
            raise TypeError(f"add_lora takes a LoRARequest, got {type(req).__name__}.")
        args = (req,)
    return getattr(manager, method)(*args)
