"""Test-wide settings: offline, single-threaded torch."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"

import torch  # noqa: E402

torch.set_num_threads(1)

import json  # noqa: E402
import os.path  # noqa: E402
from typing import Any, Callable  # noqa: E402

import pytest  # noqa: E402

from vllm_lite.testing.checkpoints import build_checkpoint, get_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def tiny_checkpoint(request) -> str:
    """Cached tiny checkpoint; parametrize indirectly with an arch name (default "llama")."""
    return get_checkpoint(getattr(request, "param", "llama"))


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory) -> Callable[..., str]:
    """build_checkpoint(arch, **kwargs) into a session temp dir, memoised per arguments."""
    built: dict[str, str] = {}

    def make(arch: str, **kwargs: Any) -> str:
        key = json.dumps([arch, {k: str(v) for k, v in sorted(kwargs.items())}])
        if key not in built:
            path = str(tmp_path_factory.mktemp(f"ckpt-{arch}"))
            built[key] = build_checkpoint(arch, os.path.join(path, "model"), **kwargs)
        return built[key]

    return make
