"""Pieces every decoder-only model here shares, so each model file keeps only what its architecture changes.

- `CausalLM`: the LM head (tied to the token embedding or its own), logits through it, and the tied
  names the HF loader may find missing.
- `PreNormResidualLayer` / `PreNormDecoder`: Llama's layer wiring (pre-norm attention and MLP, the
  residual stream carried beside the hidden states so each RMSNorm fuses the preceding add) and its
  embedding -> layers -> final norm loop, used by Llama and the mixture-of-experts decoders.

Rows past the last attention: after the last layer's attention (which still runs on every row: it writes
every token's K/V), only the rows whose hidden states are read afterwards (the logits of the rows that
sample) matter. `forward(..., logits_rows=idx)` runs the rest of the last layer (the attention's output projection
where the attention module takes `keep=`, as LlamaAttention does; MLP, norms) and the final norm on those rows only
and returns hidden states for them alone, [len(idx), hidden]. For a 128-token prefill that is ~7.5% of the
prefill's linear FLOPs (the last layer's MLP and o_proj). `CausalLM.selects_rows()` says
whether a model honours it (the PreNormDecoder models); the runner passes it on bf16/fp16 steps only (a row's
float32 result then stays the one every row count gives, for HF matching).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from vllm_lite.worker.models.layers import RMSNorm
from vllm_lite.worker.models.vocab_parallel import ParallelLMHead, VocabParallelEmbedding, lm_head_logits


class CausalLM(nn.Module):
    """A decoder + LM head; `forward` runs `self.model` (models that name it otherwise override forward)."""

    model: nn.Module

    def init_lm_head(
        self, config, embedding: VocabParallelEmbedding, tie_default: bool, width: int | None = None
    ) -> None:
        """Tie to `embedding` when the config says so (`tie_default`: the family's HF default), else a new head."""
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", tie_default))
        if self.tie_word_embeddings:
            self.lm_head = embedding
        else:
            self.lm_head = ParallelLMHead(config.vocab_size, width or config.hidden_size)

    def tied_names(self) -> tuple[str, ...]:
        """Checkpoint tensors a tied model may lack (the head is the embedding)."""
        return ("lm_head.weight",) if self.tie_word_embeddings else ()

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, logits_rows: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        if logits_rows is None:
            return self.model(input_ids, positions)
        return self.model(input_ids, positions, logits_rows=logits_rows)

    def selects_rows(self) -> bool:
        """forward(..., logits_rows=) is honoured: the decoder is a PreNormDecoder run by this forward."""
        return isinstance(getattr(self, "model", None), PreNormDecoder) and type(self).forward is CausalLM.forward

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return lm_head_logits(hidden_states, self.lm_head)


class PreNormResidualLayer(nn.Module):
    """Attention then MLP, each behind an RMSNorm that also adds the carried residual (fused add+norm).

    Subclasses set self_attn, input_layernorm, post_attention_layernorm, and either `mlp` or their own
    `feed_forward` (Mixtral's checkpoint calls its MLP block_sparse_moe).
    """

    def feed_forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.mlp(hidden)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        keep: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`keep`: int64 row indices; past the attention only those rows go on (and come out)."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        if keep is None:
            hidden = self.self_attn(positions, hidden)
        else:
            if getattr(self.self_attn, "selects_rows", False):  # its output projection on the kept rows only
                hidden = self.self_attn(positions, hidden, keep=keep)
            else:
                hidden = self.self_attn(positions, hidden).index_select(0, keep)
            residual = residual.index_select(0, keep)
            if keep.numel() == 0:
                return hidden, residual
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.feed_forward(hidden), residual


class PreNormDecoder(nn.Module):
    """Token embedding, the given PreNormResidualLayers, and a final norm that adds the last residual."""

    def __init__(self, config, layers: list[nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, logits_rows: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """Hidden states [T, hidden]; with `logits_rows` (int64 [S]) those rows' alone, [S, hidden] (module doc)."""
        hidden = self.embed_tokens(input_ids)
        residual = None
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            if i == last and logits_rows is not None:
                hidden, residual = layer(positions, hidden, residual, logits_rows)
            else:
                hidden, residual = layer(positions, hidden, residual)
        if hidden.shape[0] == 0:
            return hidden
        hidden, _ = self.norm(hidden, residual)
        return hidden
