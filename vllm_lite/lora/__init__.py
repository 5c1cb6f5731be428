"""LoRA adapters served beside one base model, as vLLM does (``enable_lora``, ``LoRARequest``)."""

from vllm_lite.lora.request import LoRARequest

__all__ = ["LoRARequest"]
