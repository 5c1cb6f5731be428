"""Which int4 format a checkpoint is in, read as vLLM reads it, and the `quantization` argument checked against it.

The format comes from config.json's `quantization_config` (written by AutoAWQ, GPTQModel/AutoGPTQ via
transformers/optimum), else from a `quantize_config.json` / `quant_config.json` beside it (older AutoGPTQ and
AutoAWQ saves). `quantization=None` means "as the checkpoint says"; a named method must agree with it, as in
vLLM. We never quantize at load: a method with no quantized checkpoint under it is refused.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Optional

# Methods vllm-lite implements (vLLM's names).
QUANTIZATION_METHODS: tuple[str, ...] = ("awq", "gptq")
# Files older tools wrote beside config.json (vLLM reads the same ones).
_SIDE_FILES = ("quantize_config.json", "quant_config.json")


@dataclass(frozen=True)
class QuantizationConfig:
    """One int4 checkpoint format's settings (the fields the tools write, with their names)."""

    quant_method: str  # "awq" or "gptq"
    bits: int = 4
    group_size: int = 128  # -1: one group over the whole input dimension
    zero_point: bool = True  # AWQ: asymmetric with stored zeros
    version: str = "gemm"  # AWQ packing
    desc_act: bool = False  # GPTQ: act-order, g_idx a permutation-derived group map
    sym: bool = True  # GPTQ: symmetric (zero 2**(bits-1))
    checkpoint_format: str = "gptq"  # GPTQ: "gptq" stores zero - 1, "gptq_v2" the zero

    def __post_init__(self) -> None:
        if self.quant_method not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization: {_unsupported(self.quant_method)}")
        if self.bits != 4:
            raise ValueError(f"quantization: {self.quant_method} with bits={self.bits} is not supported; only 4-bit.")
        if self.group_size != -1 and (self.group_size <= 0 or self.group_size % 8):
            raise ValueError(f"quantization: group_size={self.group_size} must be -1 or a positive multiple of 8.")
        if self.quant_method == "awq":
            if self.version.lower() != "gemm":
                raise ValueError(
                    f"quantization: AWQ version {self.version!r} is not supported; only 'gemm' (AutoAWQ's GEMM packing)."
                )
            if not self.zero_point:
                raise ValueError("quantization: AWQ with zero_point=false is not supported; only zero_point=true.")
        elif self.checkpoint_format not in ("gptq", "gptq_v2"):
            raise ValueError(
                f"quantization: GPTQ checkpoint_format {self.checkpoint_format!r} is not supported; "
                "expected 'gptq' or 'gptq_v2'."
            )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "QuantizationConfig":
        """From a `quantization_config` dict as the tools write it (unknown keys ignored, odd ones refused)."""
        method = str(d.get("quant_method", "")).lower()
        if method not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization: the checkpoint's quant_method {method!r}: {_unsupported(method)}")
        bits = d.get("bits", d.get("w_bit", 4))
        group_size = d.get("group_size", d.get("q_group_size", 128))
        if method == "awq":
            not_converted = d.get("modules_to_not_convert") or []
            if not_converted:
                raise ValueError(
                    f"quantization: AWQ modules_to_not_convert={not_converted!r} is not supported (every linear "
                    "layer of the decoder must be quantized)."
                )
            return cls(
                "awq", int(bits), int(group_size), bool(d.get("zero_point", True)), str(d.get("version", "gemm"))
            )
        if d.get("lm_head"):
            raise ValueError("quantization: GPTQ with a quantized lm_head (lm_head=true) is not supported.")
        if d.get("dynamic"):
            raise ValueError("quantization: GPTQ with per-module `dynamic` overrides is not supported.")
        fmt = d.get("checkpoint_format") or "gptq"
        return cls(
            "gptq",
            int(bits),
            int(group_size),
            desc_act=bool(d.get("desc_act", False)),
            sym=bool(d.get("sym", True)),
            checkpoint_format=str(fmt),
        )


def _unsupported(method: Any) -> str:
    return f"{method!r} is not supported; quantization methods vllm-lite implements: {', '.join(QUANTIZATION_METHODS)}."


def checkpoint_quantization_config(hf_config: dict[str, Any], model_dir: str) -> Optional[dict[str, Any]]:
    """The checkpoint's quantization settings as saved: config.json's `quantization_config`, else a side file."""
    qc = hf_config.get("quantization_config")
    if isinstance(qc, dict):
        return qc
    for name in _SIDE_FILES:
        path = os.path.join(model_dir, name)
        if os.path.isfile(path):
            with open(path) as f:
                side = json.load(f)
            if isinstance(side, dict):
                side = dict(side)
                # AutoGPTQ's quantize_config.json carries no quant_method; AutoAWQ's quant_config.json has "version".
                side.setdefault("quant_method", "awq" if "w_bit" in side or "version" in side else "gptq")
                return side
    return None


def resolve_quantization(
    quantization: Optional[str], hf_config: dict[str, Any], model_dir: str
) -> Optional[QuantizationConfig]:
    """The format to load, from the user's `quantization` and the checkpoint; ValueError naming `quantization`."""
    if quantization is not None:
        if not isinstance(quantization, str):
            raise TypeError(f"quantization must be a string or None, got {type(quantization).__name__}.")
        quantization = quantization.lower()
        if quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization={_unsupported(quantization)}")
    saved = checkpoint_quantization_config(hf_config, model_dir)
    if saved is None:
        if quantization is None:
            return None
        raise ValueError(
            f"quantization={quantization!r}: the checkpoint {model_dir!r} is not quantized (config.json has no "
            "quantization_config); vllm-lite loads AWQ/GPTQ checkpoints as saved and does not quantize at load."
        )
    config = QuantizationConfig.from_dict(saved)
    if quantization is not None and quantization != config.quant_method:
        raise ValueError(
            f"quantization={quantization!r} contradicts the checkpoint, whose quantization_config says "
            f"quant_method={config.quant_method!r}; pass quantization={config.quant_method!r} or leave it unset."
        )
    return config
