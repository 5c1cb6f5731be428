"""OPT: learned absolute positions (offset 2), LayerNorm (pre- or post-), ReLU FFN, optional embedding projections."""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from vllm_lite.worker.attention.layer import Attention
from vllm_lite.worker.models.decoder import CausalLM
from vllm_lite.worker.models.layers import ColumnParallelLinear, QKVLinear, RowParallelLinear, get_activation
from vllm_lite.worker.models.loading import load_hf_weights
from vllm_lite.worker.models.vocab_parallel import VocabParallelEmbedding

STACKED = (
    (".qkv_proj.", ".q_proj.", "q"),
    (".qkv_proj.", ".k_proj.", "k"),
    (".qkv_proj.", ".v_proj.", "v"),
)

# OPT's position table reserves its first two rows (a fairseq padding convention).
POSITION_OFFSET = 2


class OPTAttention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        d = config.hidden_size
        total_heads = config.num_attention_heads
        self.head_dim = d // total_heads
        bias = bool(getattr(config, "enable_bias", True))
        self.qkv_proj = QKVLinear(d, self.head_dim, total_heads, total_heads, bias)
        self.num_heads = self.qkv_proj.num_heads  # this rank's heads
        self.out_proj = RowParallelLinear(d, d, bias, "num_attention_heads*head_dim")
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_heads)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        return self.out_proj(self.attn(q, k, v))


class OPTDecoderLayer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        d = config.hidden_size
        affine = bool(getattr(config, "layer_norm_elementwise_affine", True))
        bias = bool(getattr(config, "enable_bias", True))
        self.pre_norm = bool(config.do_layer_norm_before)
        self.self_attn = OPTAttention(config)
        self.self_attn_layer_norm = nn.LayerNorm(d, elementwise_affine=affine)
        self.fc1 = ColumnParallelLinear(d, config.ffn_dim, bias, "ffn_dim")
        self.fc2 = RowParallelLinear(config.ffn_dim, d, bias, "ffn_dim")
        self.final_layer_norm = nn.LayerNorm(d, elementwise_affine=affine)
        self.act = get_activation(config.activation_function)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        residual = hidden
        if self.pre_norm:
            hidden = self.self_attn_layer_norm(hidden)
        hidden = residual + self.self_attn(hidden)
        if not self.pre_norm:
            hidden = self.self_attn_layer_norm(hidden)
        residual = hidden
        if self.pre_norm:
            hidden = self.final_layer_norm(hidden)
        hidden = residual + self.fc2(self.act(self.fc1(hidden)))
        if not self.pre_norm:
            hidden = self.final_layer_norm(hidden)
        return hidden


class OPTDecoder(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        d, e = config.hidden_size, config.word_embed_proj_dim
        affine = bool(getattr(config, "layer_norm_elementwise_affine", True))
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, e)
        self.embed_positions = nn.Embedding(config.max_position_embeddings + POSITION_OFFSET, d)
        self.project_in = nn.Linear(e, d, bias=False) if e != d else None
        self.project_out = nn.Linear(d, e, bias=False) if e != d else None
        has_final = config.do_layer_norm_before and not getattr(config, "_remove_final_layer_norm", False)
        self.final_layer_norm = nn.LayerNorm(d, elementwise_affine=affine) if has_final else None
        self.layers = nn.ModuleList([OPTDecoderLayer(config) for _ in range(config.num_hidden_layers)])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        if self.project_in is not None:
            hidden = self.project_in(hidden)
        hidden = hidden + self.embed_positions(positions + POSITION_OFFSET)
        for layer in self.layers:
            hidden = layer(hidden)
        if self.final_layer_norm is not None:
            hidden = self.final_layer_norm(hidden)
        if self.project_out is not None:
            hidden = self.project_out(hidden)
        return hidden


class OPTModel(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.decoder = OPTDecoder(config)


class OPTForCausalLM(CausalLM):
    """OPT decoder + LM head (over word_embed_proj_dim; tied to the token embedding by default)."""

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.model = OPTModel(config)
        self.init_lm_head(config, self.model.decoder.embed_tokens, tie_default=True, width=config.word_embed_proj_dim)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Returns [T, word_embed_proj_dim] (the LM head's input width, equal to hidden_size in most OPTs)."""
        return self.model.decoder(input_ids, positions)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        # Old OPT checkpoints name tensors "decoder.*" without the "model." prefix.
        renamed = ((("model." + n) if n.startswith("decoder.") else n, t) for n, t in weights)
        return load_hf_weights(self, renamed, STACKED, tied_names=self.tied_names())
