"""Which layers of a Hugging Face config attend through a sliding window, as transformers decides it.

Pure Python over a config object or its config.json dict, so the KV-cache manager (core) and the
model code (worker) read the same answer without importing torch or transformers.

Rules, per transformers 4.4x-5.x:
- an explicit `layer_types` list wins ("sliding_attention" -> windowed);
- Qwen2/Qwen3 apply the window only with `use_sliding_window`, and only to layers
  i >= `max_window_layers`;
- Gemma 2 alternates, starting with a windowed layer (i even);
- Gemma 3 makes every `sliding_window_pattern`-th layer global (default 6): i windowed iff (i+1) % pattern;
- otherwise (Mistral) a non-null `sliding_window` applies to every layer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def _getter(config: Any):
    if isinstance(config, Mapping):
        return lambda k, d=None: config.get(k, d)
    return lambda k, d=None: getattr(config, k, d)


def layer_sliding_windows(config: Any) -> list[int | None]:
    """Per layer: the window W (a query at p sees keys in (p - W, p]) or None for full attention."""
    get = _getter(config)
    n = int(get("num_hidden_layers", 0) or get("n_layer", 0) or 0)
    window = get("sliding_window")
    if not window or get("use_sliding_window", True) is False:
        return [None] * n
    window = int(window)
    layer_types = get("layer_types")
    if isinstance(layer_types, (list, tuple)) and len(layer_types) == n:
        return [window if t == "sliding_attention" else None for t in layer_types]
    model_type = get("model_type", "")
    if model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        first = int(get("max_window_layers", 0) or 0)
        return [window if i >= first else None for i in range(n)]
    if model_type == "gemma2":
        return [window if i % 2 == 0 else None for i in range(n)]
    if model_type == "gemma3_text":
        pattern = int(get("sliding_window_pattern", 6) or 6)
        return [window if (i + 1) % pattern else None for i in range(n)]
    return [window] * n


def uniform_sliding_window(config: Any) -> int | None:
    """W when every layer is windowed with the same W (its KV blocks can be freed past the window), else None."""
    windows = layer_sliding_windows(config)
    if not windows or any(w is None for w in windows) or len(set(windows)) != 1:
        return None
    return windows[0]
