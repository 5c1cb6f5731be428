"""Phi-3 / Phi-4-mini: the Llama decoder, with q/k/v and gate/up already fused in the checkpoint.

The fused checkpoint tensors are split into their q/k/v (gate/up) parts on load and routed
through the same tensor-parallel shard loaders as Llama's separate projections, so every rank
reads its own heads. Partial rotary (Phi-4-mini) comes from the shared RotaryEmbedding.

LongRoPE ("longrope", older "su"; the 128k-context variants): per-dimension `short_factor` and
`long_factor` divide the frequencies, and cos/sin are scaled by the attention factor
(sqrt(1 + ln(factor) / ln(original_max_position_embeddings)) unless the config gives one), as
transformers computes them. Which set a request uses follows transformers' generate(): the short set
while the request holds at most original_max_position_embeddings tokens (prompt + outputs so far), the
long set past it, for every token of the request, so all its KV is always in one regime:
- a token reads the long set iff its request's known length (`num_tokens` in the attention metadata,
  the prompt plus the outputs so far) exceeds it, so every chunk of a long prompt uses the long set, as
  HF's single forward over the prompt does;
- at the step a request first grows past it, HF drops its cache and recomputes the whole sequence with
  the long set; the scheduler does the same (`rope_regime.rope_recompute_at`: the request goes back to
  recompute from token 0, not counted as a preemption), and never lets speculative drafts run past it;
- the prefix cache keys a long-regime request's blocks apart (an extra key in its first block's hash),
  so keys rotated with one set are never reused by a request that needs the other.
(vLLM instead uses the long set everywhere once max_model_len exceeds the original context: consistent,
but unlike HF on short prompts.)
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from vllm_lite.worker.forward_context import get_forward_context
from vllm_lite.worker.models.layers import RotaryEmbedding, get_rope_parameters, read_shard
from vllm_lite.worker.models.llama import LlamaForCausalLM
from vllm_lite.worker.models.rope_regime import LONGROPE_TYPES, longrope_original_max_position


def longrope_tables(
    rotary_dim: int, params: dict[str, Any], max_position: int, original_max_position: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos/sin tables [max_position, rotary_dim] (cos | sin halves) for the short and the long factors."""
    base = float(params["rope_theta"])
    factor = params.get("factor") or max_position / original_max_position
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original_max_position))
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float() / rotary_dim
    positions = torch.arange(max_position, dtype=torch.float32, device="cpu")
    tables = []
    for key in ("short_factor", "long_factor"):
        ext = torch.tensor(params[key], dtype=torch.float32, device="cpu")
        if ext.shape != (rotary_dim // 2,):
            raise ValueError(f"rope {key} must have {rotary_dim // 2} entries (rotary_dim / 2), got {ext.numel()}.")
        freqs = torch.outer(positions, 1.0 / (ext * base**exponents))
        tables.append(torch.cat([freqs.cos(), freqs.sin()], dim=-1) * attention_factor)
    return tables[0], tables[1]


class LongRopeRotaryEmbedding(RotaryEmbedding):
    """RotaryEmbedding over two stacked tables: rows [0, P) short factors, [P, 2P) long factors.

    A token reads the long half iff its request's known length (prompt + outputs so far; the step's
    sequence length where the metadata has none) is longer than original_max_position_embeddings:
    transformers' choice for the whole sequence, per request."""

    def __init__(self, head_dim: int, max_position: int, params: dict[str, Any], original_max_position: int) -> None:
        nn.Module.__init__(self)
        self.head_dim = head_dim
        self.rotary_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        self.max_position = max_position
        self.original_max_position = original_max_position
        self.params = params
        longrope_tables(self.rotary_dim, params, 1, original_max_position)  # validate the factors at build time
        self.register_buffer("cos_sin_cache", torch.empty(2 * max_position, self.rotary_dim), persistent=False)
        self.init_buffers()

    def init_buffers(self) -> None:
        device = self.cos_sin_cache.device
        if device.type == "meta":
            self.cos_sin_cache = torch.empty(2 * self.max_position, self.rotary_dim, device=device)
            return
        short, long = longrope_tables(self.rotary_dim, self.params, self.max_position, self.original_max_position)
        self.cos_sin_cache = torch.cat([short, long]).to(device)

    def table_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """positions, plus max_position for the tokens of requests in the long regime (the long half's rows)."""
        md = get_forward_context().metadata
        n, b = md.num_actual_tokens, md.num_reqs
        qsl = md.query_start_loc[: b + 1]
        lengths = md.num_tokens if md.num_tokens is not None else md.seq_lens
        long_req = (lengths[:b] > self.original_max_position).to(positions.dtype)
        long_tok = torch.repeat_interleave(long_req, qsl[1:] - qsl[:-1], output_size=n)
        if positions.shape[0] > n:  # padded rows past the real tokens
            long_tok = torch.cat([long_tok, long_tok.new_zeros(positions.shape[0] - n)])
        return positions + long_tok * self.max_position


class Phi3ForCausalLM(LlamaForCausalLM):
    qkv_bias = False
    o_bias = False

    def __init__(self, config) -> None:
        rope = get_rope_parameters(config)
        if rope["rope_type"] not in LONGROPE_TYPES:
            super().__init__(config)
            return
        # Build the decoder with plain RoPE, then give every layer the LongRoPE tables.
        plain = copy.copy(config)
        plain.rope_parameters = {k: rope[k] for k in ("rope_theta", "partial_rotary_factor") if k in rope}
        plain.rope_parameters["rope_type"] = "default"
        plain.rope_scaling = None
        super().__init__(plain)
        self.config = config
        original = longrope_original_max_position(config)
        if not original:
            raise ValueError("Phi-3 longrope needs original_max_position_embeddings in the config.")
        for layer in self.model.layers:
            attn = layer.self_attn
            attn.rotary_emb = LongRopeRotaryEmbedding(
                attn.head_dim, config.max_position_embeddings, rope, int(original)
            )

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
