"""Draft checkpoints for speculative decoding tests and benchmarks: a target's first layers, same vocabulary.

A random draft would almost never agree with a random target, so acceptance would be ~0 and a test of the
draft path would prove little. Keeping the target's embeddings, first `num_layers` decoder layers, final norm
and LM head gives a much smaller model of the same vocabulary and tokenizer that agrees with the target often
(the layer-skip draft). Built once per (target, num_layers) into the test cache, like `checkpoints`.
"""

from __future__ import annotations

import json
import os
import re
import shutil

from vllm_lite.testing.checkpoints import cached_build

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_COPIED = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def build_layer_skip_draft(target_dir: str, path: str, num_layers: int) -> str:
    """Write the first `num_layers` layers of the (Llama/Qwen-shaped) checkpoint at target_dir to path."""
    import safetensors.torch

    with open(os.path.join(target_dir, "config.json")) as f:
        config = json.load(f)
    total = int(config["num_hidden_layers"])
    if not 1 <= num_layers < total:
        raise ValueError(f"num_layers must be in [1, {total}), got {num_layers!r}.")
    tensors = {}
    for name in sorted(os.listdir(target_dir)):
        if not name.endswith(".safetensors"):
            continue
        for key, value in safetensors.torch.load_file(os.path.join(target_dir, name)).items():
            m = _LAYER.match(key)
            if m is None or int(m.group(1)) < num_layers:
                tensors[key] = value.contiguous()
    os.makedirs(path, exist_ok=True)
    config["num_hidden_layers"] = num_layers
    for key in ("layer_types", "max_window_layers"):  # per-layer lists would name layers the draft lacks
        if isinstance(config.get(key), list):
            config[key] = config[key][:num_layers]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    safetensors.torch.save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    for name in _COPIED:
        if os.path.isfile(os.path.join(target_dir, name)):
            shutil.copy(os.path.join(target_dir, name), os.path.join(path, name))
    return path


def get_layer_skip_draft(target_dir: str, num_layers: int = 1) -> str:
    """Cached draft of `target_dir` (a cached checkpoint directory) keeping its first `num_layers` layers."""
    name = f"draft-v1-{os.path.basename(os.path.normpath(target_dir))}-l{num_layers}"
    return cached_build(name, lambda tmp: build_layer_skip_draft(target_dir, tmp, num_layers))


def build_damped_target(source_dir: str, path: str, damping: float) -> str:
    """A copy of source_dir whose layers after the first write `damping` times less into the residual stream
    (o_proj and down_proj scaled), so its first-layer draft agrees with it often but not always."""
    import safetensors.torch

    os.makedirs(path, exist_ok=True)
    for name in os.listdir(source_dir):
        if name.endswith(".safetensors"):
            tensors = safetensors.torch.load_file(os.path.join(source_dir, name))
            for key, value in tensors.items():
                m = _LAYER.match(key)
                if m is not None and int(m.group(1)) >= 1 and key.endswith(("o_proj.weight", "down_proj.weight")):
                    tensors[key] = value * damping
            safetensors.torch.save_file(tensors, os.path.join(path, name), metadata={"format": "pt"})
        elif os.path.isfile(os.path.join(source_dir, name)):
            shutil.copy(os.path.join(source_dir, name), os.path.join(path, name))
    return path


def get_target_and_draft(arch: str = "llama", damping: float = 0.1, size: str = "tiny") -> tuple[str, str]:
    """(target, draft) directories for draft-model speculation tests and benchmarks: the cached `arch`/`size`
    checkpoint with its later layers damped, and its one-layer draft (same tokenizer). Their agreement is by
    construction, so timings with it measure the mechanism's cost, not a real draft's quality."""
    from vllm_lite.testing.checkpoints import get_checkpoint

    source = get_checkpoint(arch, size)
    target = cached_build(
        f"spec-v1-{arch}-{size}-damped{damping}", lambda tmp: build_damped_target(source, tmp, damping)
    )
    return target, get_layer_skip_draft(target, 1)
