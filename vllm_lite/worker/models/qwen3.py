"""Qwen3: the Llama decoder with a per-head RMSNorm on q and k before RoPE (explicit head_dim)."""

from __future__ import annotations

from vllm_lite.worker.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
