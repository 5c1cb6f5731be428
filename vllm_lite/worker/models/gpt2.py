"""GPT-2: learned absolute positions, pre-LayerNorm blocks, gelu_new MLP, LM head tied to wte.

HF stores GPT-2's projections as Conv1D, i.e. weights [in, out]: they are transposed on load,
and c_attn's fused [d, 3d] is split into q/k/v for the tensor-parallel shard loaders. Hub
checkpoints name tensors without the "transformer." prefix; both spellings load.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from vllm_lite.worker.attention.layer import Attention
from vllm_lite.worker.models.decoder import CausalLM
from vllm_lite.worker.models.layers import (
    ColumnParallelLinear,
    QKVLinear,
    RowParallelLinear,
    get_activation,
    read_shard,
)
from vllm_lite.worker.models.loading import load_hf_weights
from vllm_lite.worker.models.vocab_parallel import VocabParallelEmbedding

STACKED = (
    (".qkv_proj.", ".q_proj.", "q"),
    (".qkv_proj.", ".k_proj.", "k"),
    (".qkv_proj.", ".v_proj.", "v"),
)
# Conv1D modules whose weights are stored [in, out].
_CONV1D = (".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")
# Non-persistent causal-mask buffers that old checkpoints saved.
_SKIP = (".attn.bias", ".attn.masked_bias")


class GPT2Attention(nn.Module):
    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        d, heads = config.hidden_size, config.num_attention_heads
        self.head_dim = d // heads
        self.qkv_proj = QKVLinear(d, self.head_dim, heads, heads, True)
        self.c_proj = RowParallelLinear(d, d, True, "n_head*head_dim")
        scale = self.head_dim**-0.5 if getattr(config, "scale_attn_weights", True) else 1.0
        if getattr(config, "scale_attn_by_inverse_layer_idx", False):
            scale /= float(layer_idx + 1)
        self.attn = Attention(self.qkv_proj.num_heads, self.head_dim, scale, self.qkv_proj.num_heads)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        return self.c_proj(self.attn(q, k, v))


class GPT2MLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        d = config.hidden_size
        inner = getattr(config, "n_inner", None) or 4 * d
        self.c_fc = ColumnParallelLinear(d, inner, True, "n_inner")
        self.c_proj = RowParallelLinear(inner, d, True, "n_inner")
        self.act = get_activation(config.activation_function)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        d, eps = config.hidden_size, config.layer_norm_epsilon
        self.ln_1 = nn.LayerNorm(d, eps=eps)
        self.attn = GPT2Attention(config, layer_idx)
        self.ln_2 = nn.LayerNorm(d, eps=eps)
        self.mlp = GPT2MLP(config)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.attn(self.ln_1(hidden))
        return hidden + self.mlp(self.ln_2(hidden))


class GPT2Model(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.wte = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.h = nn.ModuleList([GPT2Block(config, i) for i in range(config.num_hidden_layers)])
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.wte(input_ids) + self.wpe(positions)
        for block in self.h:
            hidden = block(hidden)
        return self.ln_f(hidden)


class GPT2LMHeadModel(CausalLM):
    """GPT-2 decoder + LM head (tied to wte unless the config unties it)."""

    def __init__(self, config) -> None:
        super().__init__()
        if getattr(config, "add_cross_attention", False):
            raise ValueError("GPT-2 with cross-attention (an encoder-decoder setup) is not supported.")
        self.config = config
        self.transformer = GPT2Model(config)
        self.init_lm_head(config, self.transformer.wte, tie_default=True)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.transformer(input_ids, positions)

    def _hf_to_ours(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        d = self.config.hidden_size
        for name, tensor in weights:
            if not name.startswith(("transformer.", "lm_head.")):
                name = "transformer." + name
            if name.endswith(_SKIP):
                continue
            if ".attn.c_attn." in name:
                t = read_shard(tensor)
                t = t.t() if name.endswith(".weight") else t  # [d, 3d] -> [3d, d]
                for i, part in enumerate("qkv"):
                    yield name.replace(".c_attn.", f".{part}_proj."), t.narrow(0, i * d, d)
            elif name.endswith(_CONV1D):
                yield name, read_shard(tensor).t()
            else:
                yield name, tensor

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        return load_hf_weights(self, self._hf_to_ours(weights), STACKED, tied_names=self.tied_names())
