"""The engine core's LoRA utility calls (vLLM's ``add_lora`` / ``remove_lora`` / ``list_loras`` / ``pin_lora``).

They arrive over the utility path as msgpack values (a LoRARequest as its fields), are typed here, and go to
the executor, which reaches every worker. With LoRA off each call is a ValueError naming enable_lora.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import msgspec

from vllm_lite.config import LoRAConfig
from vllm_lite.lora.request import LoRARequest


def as_lora_request(value: Any) -> LoRARequest:
    """A LoRARequest from itself or from its fields as they travel (a map, or a list in field order)."""
    if isinstance(value, LoRARequest):
        return value
    try:
        if isinstance(value, (list, tuple)):
            return LoRARequest(*value)
        return msgspec.convert(value, LoRARequest)
    except (msgspec.ValidationError, TypeError) as e:
        raise ValueError(f"lora_request: not a LoRARequest ({e}).") from None


def _lora_id(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"lora_id must be an integer >= 1, got {value!r}.")
    return value


def lora_utilities(executor: Any, lora_config: Optional[LoRAConfig]) -> dict[str, Callable[..., Any]]:
    """name -> callable for EngineCore's utility table."""

    def call(method: str, *args: Any) -> Any:
        if lora_config is None:
            raise ValueError(f"{method}: LoRA is not enabled; start the engine with enable_lora=True (--enable-lora).")
        return executor.lora_call(method, *args)

    return {
        "add_lora": lambda req: bool(call("add_lora", as_lora_request(req))),
        "remove_lora": lambda lora_id: bool(call("remove_lora", _lora_id(lora_id))),
        "list_loras": lambda: sorted(call("list_loras")) if lora_config is not None else [],
        "pin_lora": lambda lora_id: bool(call("pin_lora", _lora_id(lora_id))),
    }
