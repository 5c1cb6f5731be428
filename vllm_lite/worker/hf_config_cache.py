"""A checkpoint's transformers config, without importing transformers once we have seen its config.json.

Why: ``AutoConfig.from_pretrained`` imports most of transformers (activations, hub kernels, accelerate,
sympy, ...): seconds, the largest single share of an engine core's start-up on CPU. Our models only read
the config's attributes, so the first load snapshots every public attribute of the resolved config (class
defaults, normalised RoPE fields, aliases from ``attribute_map``, properties such as ``num_labels``) into a
JSON file keyed by the config.json bytes and the transformers version; later loads rebuild that snapshot as
an attribute namespace. A config with any attribute JSON cannot carry faithfully is never snapshotted: it
is loaded through transformers every time, as before.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import tempfile
import types
from pathlib import Path
from typing import Any, Optional

from vllm_lite import envs

logger = logging.getLogger(__name__)

# Bump when the snapshot's layout or meaning changes: old files are then simply not found.
SCHEMA_VERSION = 1
_CONFIG = "__config__"  # a nested transformers config (Gemma 3's text_config, ...)
_DTYPE = "__torch_dtype__"  # a torch.dtype attribute (``dtype``), by name
_INT_KEYS = "__int_keys__"  # a dict keyed by ints (``id2label``), as [key, value] pairs


class ConfigSnapshot(types.SimpleNamespace):
    """A resolved transformers config as plain attributes (what our model classes read)."""

    def to_dict(self) -> dict[str, Any]:
        return {k: (v.to_dict() if isinstance(v, ConfigSnapshot) else v) for k, v in vars(self).items()}


def cache_dir() -> Path:
    """$VLLM_LITE_CACHE_DIR/hf_configs, else ~/.cache/vllm_lite/hf_configs."""
    root = envs.VLLM_LITE_CACHE_DIR
    return (Path(root).expanduser() if root else Path.home() / ".cache" / "vllm_lite") / "hf_configs"


def load_hf_config(model_dir: str) -> Any:
    """The config our model classes are built from: the snapshot when there is one, else AutoConfig's."""
    key = _cache_key(model_dir)
    path = cache_dir() / f"{key}.json" if key is not None else None
    if path is not None:
        snapshot = _read(path)
        if snapshot is not None:
            return _rebuild(snapshot)
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_dir)
    if path is not None:
        snapshot = snapshot_config(config)
        if snapshot is not None:
            _write(path, snapshot)
    return config


def snapshot_config(config: Any) -> Optional[dict[str, Any]]:
    """The config's data as JSON-able values; None if any of it has no JSON form.

    Its data: every ``to_dict()`` field (config.json plus class defaults), the ``attribute_map`` aliases,
    and the public properties and attributes whose values JSON carries (``num_labels``, ...). Class-level
    plans and views (``base_model_pp_plan``, tuples, sets) are left out: model code does not read them.
    """
    import torch

    fields = set(config.to_dict())
    names = {n for n in dir(config) if not n.startswith("_")} | fields | set(getattr(config, "attribute_map", {}) or {})
    out: dict[str, Any] = {}
    for name in sorted(names - _DEPRECATED_ALIASES):
        try:
            value = getattr(config, name)
        except Exception:  # noqa: BLE001 -- a property that does not apply to this config: absent, as there
            continue
        if callable(value) and not isinstance(value, torch.dtype):
            continue
        encoded = _encode(value, torch)
        if encoded is not _UNREPRESENTABLE:
            out[name] = encoded
        elif name in fields:
            logger.debug("config field %r (%s) has no JSON form; not snapshotting", name, type(value).__name__)
            return None
    return out


# Deprecated spellings that warn when read (transformers v5); their new names are snapshotted.
_DEPRECATED_ALIASES = frozenset({"torch_dtype", "use_return_dict"})
_UNREPRESENTABLE = object()


def _encode(value: Any, torch: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.dtype):
        return {_DTYPE: str(value).replace("torch.", "")}
    if isinstance(value, dict):
        items = {k: _encode(v, torch) for k, v in value.items()}
        if any(v is _UNREPRESENTABLE for v in items.values()):
            return _UNREPRESENTABLE
        if all(isinstance(k, str) for k in items):
            return items
        if all(isinstance(k, int) and not isinstance(k, bool) for k in items):
            return {_INT_KEYS: [[k, v] for k, v in items.items()]}
        return _UNREPRESENTABLE
    if isinstance(value, list):
        listed = [_encode(v, torch) for v in value]
        return _UNREPRESENTABLE if any(v is _UNREPRESENTABLE for v in listed) else listed
    if hasattr(value, "to_dict") and hasattr(value, "model_type"):  # a nested transformers config
        nested = snapshot_config(value)
        return _UNREPRESENTABLE if nested is None else {_CONFIG: nested}
    return _UNREPRESENTABLE  # tuples, sets, objects: would not come back the same


def _decode(value: Any) -> Any:
    if isinstance(value, dict):
        if _CONFIG in value and len(value) == 1:
            return _rebuild(value[_CONFIG])
        if _INT_KEYS in value and len(value) == 1:
            return {int(k): _decode(v) for k, v in value[_INT_KEYS]}
        if _DTYPE in value and len(value) == 1:
            import torch

            return getattr(torch, value[_DTYPE])
        return {k: _decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


def _rebuild(snapshot: dict[str, Any]) -> ConfigSnapshot:
    return ConfigSnapshot(**{k: _decode(v) for k, v in snapshot.items()})


def _cache_key(model_dir: str) -> Optional[str]:
    """sha256 of config.json, the transformers version and our schema; None when either is missing."""
    try:
        raw = Path(model_dir, "config.json").read_bytes()
        version = importlib.metadata.version("transformers")
    except (OSError, importlib.metadata.PackageNotFoundError):
        return None
    h = hashlib.sha256(raw)
    h.update(f"\0transformers={version}\0schema={SCHEMA_VERSION}".encode())
    return h.hexdigest()


def _read(path: Path) -> Optional[dict[str, Any]]:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _write(path: Path, snapshot: dict[str, Any]) -> None:
    """Atomically (temp file + rename), so a concurrent reader never sees half a file; failures only log."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(snapshot, f)
        os.replace(tmp, path)
    except OSError as e:
        logger.debug("could not cache the resolved config at %s: %s", path, e)
