"""Random LoRA adapters in PEFT's on-disk format, for tests and benchmarks (no download, no `peft` needed).

``build_lora_adapter`` writes ``adapter_config.json`` and ``adapter_model.safetensors`` (or ``.bin``) for a
base checkpoint, with PEFT's key names (``base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight``),
random A and a non-zero random B (PEFT initialises B to zero, which would change nothing), so an adapter
visibly changes greedy outputs. ``peft_greedy`` is the oracle: Hugging Face + ``peft`` on the same files.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class AdapterSpec:
    """What an adapter looks like: rank, alpha, which projections, rsLoRA, weight file kind, seed."""

    r: int
    lora_alpha: float
    target_modules: tuple[str, ...] = ATTN + MLP
    use_rslora: bool = False
    seed: int = 0
    bin_file: bool = False
    std: float = 0.2

    def name(self) -> str:
        mods = "-".join(m.split("_")[0] for m in self.target_modules)
        kind = "bin" if self.bin_file else "st"
        return f"r{self.r}-a{self.lora_alpha:g}-{mods}-rs{int(self.use_rslora)}-s{self.seed}-{kind}-std{self.std:g}"


def _shapes(hf: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(in, out) of each projection of a Llama-family config."""
    hidden = hf["hidden_size"]
    heads = hf["num_attention_heads"]
    kv = hf.get("num_key_value_heads") or heads
    head_dim = hf.get("head_dim") or hidden // heads
    inter = hf["intermediate_size"]
    return {
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv * head_dim),
        "v_proj": (hidden, kv * head_dim),
        "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def build_lora_adapter(base_model: str, path: str, spec: AdapterSpec) -> str:
    """Write a PEFT LoRA adapter for the checkpoint at base_model into path; returns path."""
    with open(os.path.join(base_model, "config.json")) as f:
        hf = json.load(f)
    shapes = _shapes(hf)
    g = torch.Generator().manual_seed(spec.seed)
    state: dict[str, torch.Tensor] = {}
    for layer in range(hf["num_hidden_layers"]):
        for module in spec.target_modules:
            fan_in, fan_out = shapes[module]
            part = "self_attn" if module in ATTN else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{module}"
            state[f"{prefix}.lora_A.weight"] = torch.randn((spec.r, fan_in), generator=g) * spec.std
            state[f"{prefix}.lora_B.weight"] = torch.randn((fan_out, spec.r), generator=g) * spec.std
    os.makedirs(path, exist_ok=True)
    if spec.bin_file:
        torch.save(state, os.path.join(path, "adapter_model.bin"))
    else:
        from safetensors.torch import save_file

        save_file(state, os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": spec.r,
        "lora_alpha": spec.lora_alpha,
        "lora_dropout": 0.0,
        "target_modules": list(spec.target_modules),
        "use_rslora": spec.use_rslora,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "modules_to_save": None,
        "init_lora_weights": True,
    }
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return path


def peft_model(base_model: str, adapter: str, merged: bool = False) -> torch.nn.Module:
    """transformers' float32 model with the adapter applied by ``peft`` (merged into the weights if asked)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32)
    wrapped = PeftModel.from_pretrained(model, adapter)
    return (wrapped.merge_and_unload() if merged else wrapped).eval()


@torch.no_grad()
def hf_greedy_tokens(model: torch.nn.Module, prompt: Sequence[int], n: int) -> list[int]:
    """Greedy tokens with the model's KV cache (the oracle for one prompt)."""
    ids = torch.tensor([list(prompt)])
    out: list[int] = []
    past = None
    for _ in range(n):
        res = model(input_ids=ids, past_key_values=past, use_cache=True)
        past = res.past_key_values
        tok = int(res.logits[0, -1].float().argmax())
        out.append(tok)
        ids = torch.tensor([[tok]])
    return out


def peft_greedy(
    base_model: str, adapter: Optional[str], prompts: Sequence[Sequence[int]], n: int, merged: bool = False
) -> list[list[int]]:
    """HF (+ peft when an adapter is given) greedy tokens for each prompt."""
    if adapter is None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32).eval()
    else:
        model = peft_model(base_model, adapter, merged)
    return [hf_greedy_tokens(model, p, n) for p in prompts]
