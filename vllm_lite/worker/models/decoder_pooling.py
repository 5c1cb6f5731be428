"""Decoder models as pooling models: the bare decoder (`Qwen3Model`, `LlamaModel`: what transformers' AutoModel
saves, e.g. a Qwen3-Embedding checkpoint) and the `*ForSequenceClassification` heads.

Both reuse the causal-LM classes' decoder and weight loading; what changes is the checkpoint's names (a bare
decoder's tensors lack the `model.` prefix) and the head: none, or a `score` linear layer that the pooler runs
on the pooled last token (`classifier_head`). Neither has an LM head to generate with.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from vllm_lite.worker.models.llama import LlamaForCausalLM, MistralForCausalLM
from vllm_lite.worker.models.qwen2 import Qwen2ForCausalLM
from vllm_lite.worker.models.qwen3 import Qwen3ForCausalLM

# Checkpoint names that belong to a head, not to the decoder (kept as they are).
_HEAD_PREFIXES = ("score.", "lm_head.")


class _DecoderPoolingModel:
    """Mixin over a *ForCausalLM class: no LM head, and checkpoints saved with or without the `model.` prefix."""

    def _drop_lm_head(self) -> None:
        del self.lm_head  # type: ignore[attr-defined]

    def tied_names(self) -> tuple[str, ...]:
        return ("lm_head.weight",)  # an embedding checkpoint saved from a ForCausalLM may still carry it

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        raise ValueError(f"{type(self).__name__} is a pooling model: it has no LM head to generate with.")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        renamed = (
            (name if name.startswith(("model.", *_HEAD_PREFIXES)) else "model." + name, tensor)
            for name, tensor in weights
        )
        return super().load_weights(renamed)  # type: ignore[misc]


def _bare(base: type) -> type:
    """`base` (a *ForCausalLM) as its bare decoder: hidden states out, no LM head."""

    class Bare(_DecoderPoolingModel, base):  # type: ignore[misc, valid-type]
        def __init__(self, config) -> None:
            base.__init__(self, config)
            self._drop_lm_head()

    Bare.__name__ = Bare.__qualname__ = base.__name__.replace("ForCausalLM", "Model")
    return Bare


def _classifier(base: type) -> type:
    """`base` (a *ForCausalLM) with HF's sequence-classification head: `score`, no bias, over the last token."""

    class Classifier(_DecoderPoolingModel, base):  # type: ignore[misc, valid-type]
        def __init__(self, config) -> None:
            base.__init__(self, config)
            self._drop_lm_head()
            self.score = nn.Linear(config.hidden_size, config.num_labels, bias=False)

        @property
        def classifier_head(self) -> nn.Module:
            return self.score

    Classifier.__name__ = Classifier.__qualname__ = base.__name__.replace("ForCausalLM", "ForSequenceClassification")
    return Classifier


def converted(base: type, name: str, how: str) -> type:
    """vLLM's --convert for a *ForCausalLM class: `base` as its bare decoder ("bare") or with a `score` head
    ("classifier"), named `name`. Built once per name."""
    if name not in _CONVERTED:
        cls = _bare(base) if how == "bare" else _classifier(base)
        cls.__name__ = cls.__qualname__ = name
        _CONVERTED[name] = cls
    return _CONVERTED[name]


_CONVERTED: dict[str, type] = {}
LlamaModel = _bare(LlamaForCausalLM)
MistralModel = _bare(MistralForCausalLM)
Qwen2Model = _bare(Qwen2ForCausalLM)
Qwen3Model = _bare(Qwen3ForCausalLM)
LlamaForSequenceClassification = _classifier(LlamaForCausalLM)
Qwen2ForSequenceClassification = _classifier(Qwen2ForCausalLM)
Qwen3ForSequenceClassification = _classifier(Qwen3ForCausalLM)
