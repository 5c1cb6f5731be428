"""Qwen2: the Llama decoder with biases on the q/k/v projections (none on o_proj)."""

from __future__ import annotations

from vllm_lite.worker.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True
    o_bias = False
