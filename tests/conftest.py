"""Test-wide settings: offline, single-threaded torch, no tokenizer thread pools."""

from __future__ import annotations

import os

# Read once when huggingface_hub is imported (below, through transformers), so it cannot wait for a fixture.
# README's test command documents it; CI exports it too.
os.environ["HF_HUB_OFFLINE"] = "1"

import json  # noqa: E402
import os.path  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from vllm_lite.testing.checkpoints import build_checkpoint, get_checkpoint  # noqa: E402
from vllm_lite.testing.wheel import build_wheel  # noqa: E402

# $VLLM_LITE_TEST_FAILURE_LOG: each failure's report appended as it happens (scripts/gpu_check.py sets it).
pytest_plugins = ["vllm_lite.testing.failure_log"]


@pytest.fixture(scope="session", autouse=True)
def _quiet_threads() -> Iterator[None]:
    """One torch thread and no tokenizers thread pool for the session (children inherit the variable);
    both are put back afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TOKENIZERS_PARALLELISM", "false")
        yield
    torch.set_num_threads(threads)


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


@pytest.fixture(scope="session")
def project_wheel(tmp_path_factory) -> Path:
    """The project's wheel, built once per session from a copy of the tree; packaging tests inspect it."""
    return build_wheel(tmp_path_factory.mktemp("wheel"))
