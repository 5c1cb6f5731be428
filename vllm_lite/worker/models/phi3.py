"""Phi-3 / Phi-4-mini: the Llama decoder, with q/k/v and gate/up already fused in the checkpoint.

The fused checkpoint tensors are split into their q/k/v (gate/up) parts on load and routed
through the same tensor-parallel shard loaders as Llama's separate projections, so every rank
reads its own heads. Partial rotary (Phi-4-mini) comes from the shared RotaryEmbedding; the
"longrope"/"su" scaling of the 128k-context variants is not implemented and fails at build time.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from vllm_lite.worker.models.layers import get_rope_parameters, read_shard
from vllm_lite.worker.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    qkv_bias = False
    o_bias = False

    def __init__(self, config) -> None:
        rope = get_rope_parameters(config)
        if rope["rope_type"] in ("longrope", "su"):
            raise ValueError(
                f"Phi-3 rope scaling {rope['rope_type']!r} (the long-context variants) is not supported; "
                "use a 4k/8k-context Phi-3 checkpoint (rope_scaling null)."
            )
        super().__init__(config)

    def _split_fused(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        cfg = self.config
        heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        q_size, kv_size = heads * head_dim, kv_heads * head_dim
        inter = cfg.intermediate_size
        for name, tensor in weights:
            if ".qkv_proj." in name:
                t: torch.Tensor = read_shard(tensor)
                for part, start, size in (("q", 0, q_size), ("k", q_size, kv_size), ("v", q_size + kv_size, kv_size)):
                    yield name.replace(".qkv_proj.", f".{part}_proj."), t.narrow(0, start, size)
            elif ".gate_up_proj." in name:
                t = read_shard(tensor)
                yield name.replace(".gate_up_proj.", ".gate_proj."), t.narrow(0, 0, inter)
                yield name.replace(".gate_up_proj.", ".up_proj."), t.narrow(0, inter, inter)
            else:
                yield name, tensor

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        return super().load_weights(self._split_fused(weights))
