"""Qwen3-MoE: Qwen3 attention (q/k RMSNorm, no bias) with sparse MoE MLPs on some layers.

Layer i is sparse when it is not in `mlp_only_layers` and (i + 1) % `decoder_sparse_step` == 0, as
transformers decides; other layers keep a dense gated MLP of `intermediate_size`. Experts have
`moe_intermediate_size`; top-k weights are renormalised only with `norm_topk_prob`. Qwen3-MoE configs
carry no shared expert (Qwen2-MoE's); a config that asks for one is refused rather than half-run.
"""

from __future__ import annotations

from vllm_lite.worker.models.fused_moe import SparseMoeBlock
from vllm_lite.worker.models.llama import LlamaMLP
from vllm_lite.worker.models.mixtral import MixtralForCausalLM, MoEDecoderLayer


def is_sparse_layer(config, index: int) -> bool:
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    only_dense = set(getattr(config, "mlp_only_layers", None) or ())
    return index not in only_dense and config.num_experts > 0 and (index + 1) % step == 0


class Qwen3MoeForCausalLM(MixtralForCausalLM):
    qk_norm = True

    def __init__(self, config) -> None:
        if getattr(config, "shared_expert_intermediate_size", 0):
            raise ValueError("shared experts (shared_expert_intermediate_size) are not supported for Qwen3-MoE.")
        super().__init__(config)

    def make_layer(self, config, index: int, sliding_window: int | None) -> MoEDecoderLayer:
        act = getattr(config, "hidden_act", "silu")
        if is_sparse_layer(config, index):
            mlp = SparseMoeBlock(
                config.num_experts,
                config.num_experts_per_tok,
                config.hidden_size,
                config.moe_intermediate_size,
                renormalize=bool(getattr(config, "norm_topk_prob", False)),
                act=act,
                round_weights=True,
            )
        else:
            mlp = LlamaMLP(config.hidden_size, config.intermediate_size, False, act)
        return MoEDecoderLayer(config, self.make_attention(config, sliding_window), mlp, "mlp")
