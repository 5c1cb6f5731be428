"""Gemma 3 (text): Gemma 2's layer with q/k RMSNorm, per-layer-type RoPE bases and its own sliding pattern.

As transformers' modeling_gemma3 does it: q and k are RMS-normalised per head (Gemma's 1 + weight gain)
before RoPE; sliding layers rotate with the local base (`rope_parameters["sliding_attention"]`, from the
old `rope_local_base_freq`), full layers with the global one and its scaling (e.g. linear x8); which
layers slide comes from `layer_types` (from `sliding_window_pattern`: every pattern-th layer is global);
attention and final-logit soft-capping apply only where the config sets them (null in released configs).
Embedding scale, sandwich norms, gelu-tanh MLP and the tied LM head are Gemma 2's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vllm_lite.worker.attention.layer import Attention
from vllm_lite.worker.models.gemma2 import Gemma2ForCausalLM, Gemma2MLP, GemmaRMSNorm
from vllm_lite.worker.models.layers import QKVLinear, RotaryEmbedding, RowParallelLinear
from vllm_lite.worker.models.sliding_window import layer_sliding_windows
from vllm_lite.worker.models.vocab_parallel import (
    ParallelLMHead,
    VocabParallelEmbedding,
)

DEFAULT_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}


def layer_rope_parameters(config: Any, layer_type: str) -> dict[str, Any]:
    """RoPE settings of one layer type: transformers' per-type `rope_parameters`, else the old flat fields."""
    rp = getattr(config, "rope_parameters", None)
    params = dict(rp[layer_type]) if isinstance(rp, dict) and isinstance(rp.get(layer_type), dict) else {}
    if not params:
        if layer_type == "full_attention":
            params = dict(getattr(config, "rope_scaling", None) or {})
            params.setdefault("rope_theta", getattr(config, "rope_theta", None))
        else:
            params["rope_theta"] = getattr(config, "rope_local_base_freq", None)
    if params.get("rope_theta") is None:
        params["rope_theta"] = DEFAULT_THETA[layer_type]
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


class Gemma3Attention(nn.Module):
    def __init__(self, config, sliding_window: int | None) -> None:
        super().__init__()
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVLinear(config.hidden_size, self.head_dim, heads, kv_heads, bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(heads * self.head_dim, config.hidden_size, bias, "num_attention_heads*head_dim")
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        layer_type = "sliding_attention" if sliding_window else "full_attention"
        self.rotary_emb = RotaryEmbedding(
            self.head_dim, config.max_position_embeddings, layer_rope_parameters(config, layer_type)
        )
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            float(config.query_pre_attn_scalar) ** -0.5,
            self.num_kv_heads,
            sliding_window=sliding_window,
            logits_soft_cap=getattr(config, "attn_logit_softcapping", None),
        )

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        t = q.shape[0]
        q = self.q_norm(q.reshape(t, self.num_heads, self.head_dim)).view(t, -1)
        k = self.k_norm(k.reshape(t, self.num_kv_heads, self.head_dim)).view(t, -1)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config, sliding_window: int | None) -> None:
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Gemma3Attention(config, sliding_window)
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "gelu_pytorch_tanh")
        self.mlp = Gemma2MLP(d, config.intermediate_size, act)
        self.input_layernorm = GemmaRMSNorm(d, eps)
        self.post_attention_layernorm = GemmaRMSNorm(d, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(d, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(d, eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.post_attention_layernorm(self.self_attn(positions, self.input_layernorm(hidden)))
        return hidden + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))


class Gemma3Model(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.hidden_size = config.hidden_size
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([Gemma3DecoderLayer(config, w) for w in layer_sliding_windows(config)])
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        # transformers casts the sqrt(hidden) scale to the weights' dtype before multiplying.
        hidden = hidden * torch.tensor(self.hidden_size**0.5, dtype=hidden.dtype)
        for layer in self.layers:
            hidden = layer(positions, hidden)
        return self.norm(hidden)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 text decoder; logits, soft-capping and loading are Gemma 2's."""

    def __init__(self, config) -> None:
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention (EmbeddingGemma) is not supported for causal generation.")
        nn.Module.__init__(self)
        self.config = config
        self.model = Gemma3Model(config)
        self.final_logit_softcapping = getattr(config, "final_logit_softcapping", None)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        if self.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
