"""Reading a PEFT LoRA adapter directory as `peft` saves it: ``adapter_config.json`` + weights.

Pure file reading, no model: the frontend's Processor checks an adapter here before a request is
sent (config, rank, target modules), and the worker reads the tensors here to place them in its slots.
Weights: ``adapter_model.safetensors``, or ``adapter_model.bin`` read with ``torch.load(weights_only=True)``
(never unpickling code). Keys look like ``base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight``.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any

# Projections we can apply an adapter to, and the submodule each sits in.
ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
SUPPORTED_MODULES = ATTN_MODULES + MLP_MODULES
CONFIG_NAME = "adapter_config.json"
SAFETENSORS_NAME = "adapter_model.safetensors"
BIN_NAME = "adapter_model.bin"

_KEY = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_(A|B)\.weight$")


@dataclass(frozen=True)
class PEFTConfig:
    """The fields of adapter_config.json that decide how the adapter computes."""

    r: int
    lora_alpha: float
    target_modules: tuple[str, ...]
    use_rslora: bool = False

    @property
    def scaling(self) -> float:
        """PEFT's scale of B·A: alpha/r, or alpha/sqrt(r) with rsLoRA."""
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)


def _fail(msg: str) -> ValueError:
    return ValueError(f"lora_request.lora_path: {msg}")


def read_peft_config(path: str) -> PEFTConfig:
    """adapter_config.json of the adapter at `path`; ValueError naming lora_request.lora_path when unusable."""
    if not isinstance(path, str) or not path:
        raise _fail("a LoRA adapter needs the path of its PEFT directory, got an empty path.")
    cfg_path = os.path.join(path, CONFIG_NAME)
    if not os.path.isfile(cfg_path):
        raise _fail(f"{path!r} is not a PEFT adapter directory (no {CONFIG_NAME}).")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise _fail(f"cannot read {cfg_path!r}: {e}") from None
    if not isinstance(cfg, dict):
        raise _fail(f"{cfg_path!r} is not a JSON object.")
    ptype = cfg.get("peft_type", "LORA")
    if str(ptype).upper() != "LORA":
        raise _fail(f"peft_type {ptype!r} is not a LoRA adapter.")
    r = cfg.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise _fail(f"adapter_config.json has r={r!r}; a LoRA rank must be an integer >= 1.")
    alpha = cfg.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise _fail(f"adapter_config.json has lora_alpha={alpha!r}; it must be a number.")
    for unsupported, off in (
        ("use_dora", False),
        ("fan_in_fan_out", False),
        ("modules_to_save", None),
        ("rank_pattern", {}),
        ("alpha_pattern", {}),
    ):
        value = cfg.get(unsupported, off)
        if value not in (off, None, {}, []):
            raise _fail(f"adapter_config.json sets {unsupported}={value!r}, which this engine cannot apply.")
    if cfg.get("bias", "none") != "none":
        raise _fail(f"adapter_config.json sets bias={cfg.get('bias')!r}; only 'none' is supported.")
    targets = _target_modules(cfg.get("target_modules"))
    return PEFTConfig(r=r, lora_alpha=float(alpha), target_modules=targets, use_rslora=bool(cfg.get("use_rslora")))


def _target_modules(value: Any) -> tuple[str, ...]:
    if value == "all-linear":
        return SUPPORTED_MODULES
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not value or not all(isinstance(m, str) for m in value):
        raise _fail(f"adapter_config.json target_modules must be a list of module names, got {value!r}.")
    names = tuple(m.rsplit(".", 1)[-1] for m in value)
    bad = sorted(set(names) - set(SUPPORTED_MODULES))
    if bad:
        raise _fail(f"target_modules {bad} cannot be applied; supported: {list(SUPPORTED_MODULES)}.")
    return names


def weights_file(path: str) -> str:
    """The adapter's weights file (safetensors preferred, else .bin)."""
    for name in (SAFETENSORS_NAME, BIN_NAME):
        full = os.path.join(path, name)
        if os.path.isfile(full):
            return full
    raise _fail(f"{path!r} holds no {SAFETENSORS_NAME} or {BIN_NAME}.")


def parse_key(key: str) -> tuple[int, str, str]:
    """(layer index, module name, "A" or "B") of a PEFT weight key; ValueError for a key we cannot apply."""
    m = _KEY.match(key)
    if m is None or m.group(3) not in SUPPORTED_MODULES:
        raise _fail(f"adapter weight {key!r} targets a module this engine cannot apply a LoRA to.")
    return int(m.group(1)), m.group(3), m.group(4)


def check_adapter(path: str, max_lora_rank: int) -> PEFTConfig:
    """Everything about an adapter that can be known without loading it: config, rank, files, weight names."""
    cfg = read_peft_config(path)
    if cfg.r > max_lora_rank:
        raise ValueError(
            f"lora_request: the adapter at {path!r} has rank r={cfg.r}, more than max_lora_rank={max_lora_rank}."
        )
    file = weights_file(path)
    if file.endswith(".safetensors"):
        from safetensors import safe_open

        try:
            with safe_open(file, framework="pt") as f:
                keys = list(f.keys())
        except Exception as e:  # noqa: BLE001 -- a corrupt file, whatever safetensors raises
            raise _fail(f"cannot read {file!r}: {e}") from None
        if not keys:
            raise _fail(f"{file!r} holds no weights.")
        for k in keys:
            parse_key(k)
    return cfg


def load_adapter_tensors(path: str) -> tuple[PEFTConfig, dict[tuple[int, str], dict[str, Any]]]:
    """The config and {(layer, module): {"A": [r, in], "B": [out, r]}} in float32 on the CPU."""
    import torch

    cfg = read_peft_config(path)
    file = weights_file(path)
    if file.endswith(".safetensors"):
        from safetensors.torch import load_file

        state = load_file(file, device="cpu")
    else:
        state = torch.load(file, map_location="cpu", weights_only=True)
        if not isinstance(state, dict):
            raise _fail(f"{file!r} is not a state dict.")
    out: dict[tuple[int, str], dict[str, Any]] = {}
    for key, tensor in state.items():
        layer, module, which = parse_key(key)
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 2:
            raise _fail(f"adapter weight {key!r} is not a matrix.")
        out.setdefault((layer, module), {})[which] = tensor.to(torch.float32)
    for (layer, module), ab in out.items():
        if set(ab) != {"A", "B"}:
            raise _fail(f"layer {layer} {module} has lora_{'A' if 'A' not in ab else 'B'} missing.")
        if ab["A"].shape[0] != ab["B"].shape[1]:
            raise _fail(f"layer {layer} {module}: lora_A rank {ab['A'].shape[0]} != lora_B rank {ab['B'].shape[1]}.")
    if not out:
        raise _fail(f"{file!r} holds no LoRA weights.")
    return cfg, out


def rank_of(tensors: dict[tuple[int, str], dict[str, Any]]) -> int:
    """The largest rank among an adapter's modules."""
    return max(int(ab["A"].shape[0]) for ab in tensors.values())
