"""Architecture name (config.json "architectures") -> our model class."""

from __future__ import annotations

import importlib
from typing import Sequence

from torch import nn

# name -> (module under vllm_lite.worker.models, class name); imported on first use.
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "OPTForCausalLM": ("opt", "OPTForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "GPT2LMHeadModel": ("gpt2", "GPT2LMHeadModel"),
    "Gemma2ForCausalLM": ("gemma2", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    # Pooling models (runner "pooling"): bare decoders as AutoModel saves them, and classification heads.
    "LlamaModel": ("decoder_pooling", "LlamaModel"),
    "MistralModel": ("decoder_pooling", "MistralModel"),
    "Qwen2Model": ("decoder_pooling", "Qwen2Model"),
    "Qwen3Model": ("decoder_pooling", "Qwen3Model"),
    "LlamaForSequenceClassification": ("decoder_pooling", "LlamaForSequenceClassification"),
    "Qwen2ForSequenceClassification": ("decoder_pooling", "Qwen2ForSequenceClassification"),
    "Qwen3ForSequenceClassification": ("decoder_pooling", "Qwen3ForSequenceClassification"),
    "BertModel": ("bert", "BertModel"),
    "BertForSequenceClassification": ("bert", "BertForSequenceClassification"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architecture: str | Sequence[str]) -> type[nn.Module]:
    """The class for an architecture name, or the first supported one of a config's list."""
    names = [architecture] if isinstance(architecture, str) else list(architecture)
    for name in names:
        if name in _MODELS:
            module, cls = _MODELS[name]
            return getattr(importlib.import_module(f"vllm_lite.worker.models.{module}"), cls)
        converted = _converted_class(name)
        if converted is not None:
            return converted
    raise ValueError(
        f"Unsupported model architecture {names if len(names) != 1 else names[0]!r}; "
        f"supported architectures: {', '.join(supported_architectures())}."
    )


# --convert: a pooling architecture name built from a supported *ForCausalLM (suffix -> how).
_CONVERSIONS = {"ForSequenceClassification": "classifier", "ForRewardModel": "bare", "Model": "bare"}


def _converted_class(name: str) -> type[nn.Module] | None:
    """`XModel` / `XForRewardModel` / `XForSequenceClassification` from our `XForCausalLM` (None if no such base)."""
    for suffix, how in _CONVERSIONS.items():
        base = name[: -len(suffix)] + "ForCausalLM"
        if name.endswith(suffix) and base in _MODELS:
            from vllm_lite.worker.models import decoder_pooling

            return decoder_pooling.converted(get_model_class(base), name, how)
    return None
