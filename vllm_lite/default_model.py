"""Where the bundled default model lives, so a fresh install runs with no download.

The checkpoint (a tiny Llama trained on Python's own documentation by
scripts/train_default_model.py) ships as package data under
``vllm_lite/assets/default_model``.
"""

from __future__ import annotations

import os

DEFAULT_MODEL_NAME = "vllm-lite-default"

_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")


def default_model_path() -> str:
    """Absolute path of the bundled checkpoint directory (config, weights, tokenizer).

    Raises FileNotFoundError naming the missing file when the package data did not
    get installed (e.g. a build that dropped ``assets/``).
    """
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "default_model")
    for name in _REQUIRED_FILES:
        if not os.path.isfile(os.path.join(path, name)):
            raise FileNotFoundError(
                f"The bundled default model is incomplete: {os.path.join(path, name)!r} is missing. "
                "Reinstall vllm-lite, or pass a model directory explicitly."
            )
    return path


def resolve_model(model: str | None) -> str:
    """The model a caller named, or the bundled default when they named none."""
    if model is None or model == "":
        return default_model_path()
    if not isinstance(model, str):
        raise TypeError(f"model must be a str path or None, got {type(model).__name__}.")
    return model
