"""Build our model for a checkpoint and stream its safetensors weights in, one tensor at a time.

The module is constructed on the meta device (no random init, no memory),
materialised empty on the target device in the target dtype, then filled
from the checkpoint; so peak memory is one model plus one tensor.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Iterator

import torch
from torch import nn

from vllm_lite.config import ModelConfig
from vllm_lite.worker.models.registry import get_model_class


def safetensors_files(model_dir: str) -> list[str]:
    """The checkpoint's weight files: those named by model.safetensors.index.json, else every *.safetensors."""
    if not os.path.isdir(model_dir):
        raise FileNotFoundError(f"model directory {model_dir!r} does not exist.")
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map") or {}
        files = sorted({os.path.join(model_dir, v) for v in weight_map.values()})
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise FileNotFoundError(f"shards named in {index} are missing: {missing}.")
    else:
        files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir!r}.")
    return files


def iterate_weights(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of the checkpoint, read lazily one at a time."""
    from safetensors import safe_open

    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _hf_config(model_config: ModelConfig):
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_config.model)
    return config


def init_non_persistent_buffers(model: nn.Module) -> None:
    """Recompute buffers that checkpoints do not carry (RoPE tables) after materialising the module."""
    for m in model.modules():
        if m is not model and hasattr(m, "init_buffers"):
            m.init_buffers()


def load_model(model_config: ModelConfig, device: torch.device) -> nn.Module:
    """Our model for model_config.model in model_config.dtype on device, with the checkpoint's weights."""
    device = torch.device(device)
    files = safetensors_files(model_config.model)  # fail on a bad dir before building anything
    hf_config = _hf_config(model_config)
    archs = getattr(hf_config, "architectures", None) or [model_config.architecture]
    cls = get_model_class(archs)
    with torch.device("meta"):
        model = cls(hf_config)
    model = model.to(dtype=model_config.dtype).to_empty(device=device)
    init_non_persistent_buffers(model)
    loaded = model.load_weights(iterate_weights(model_config.model))
    expected = {name for name, _ in model.named_parameters()}
    missing = sorted(expected - loaded)
    if missing:
        shown = ", ".join(missing[:8]) + (f" ... ({len(missing)} in all)" if len(missing) > 8 else "")
        raise ValueError(f"checkpoint {model_config.model!r} ({len(files)} file(s)) lacks parameters: {shown}.")
    return model.eval()
