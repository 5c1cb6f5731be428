"""`LoRARequest`: which adapter a request runs with, by vLLM's field names.

A msgspec struct so it travels inside `EngineCoreRequest` and the worker's step input as typed data
(never pickled). ``lora_int_id`` is the key everywhere below the frontend: slot assignment, the
scheduler's per-step adapter limit and the prefix-cache hash; ``lora_name`` is what users and the
HTTP API see; ``lora_path`` is a PEFT adapter directory (``adapter_config.json`` + safetensors).
"""

from __future__ import annotations

from typing import Optional

import msgspec


class LoRARequest(msgspec.Struct, frozen=True, omit_defaults=True):
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: Optional[str] = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_request.lora_name must be a non-empty string, got {self.lora_name!r}.")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_request.lora_int_id must be an integer >= 1, got {self.lora_int_id!r}.")
        if not isinstance(self.lora_path, str):
            raise TypeError(f"lora_request.lora_path must be a string, got {type(self.lora_path).__name__}.")

    # vLLM's accessors.
    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
