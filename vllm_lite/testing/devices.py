"""Test markers for how many CUDA devices a test needs, asked of the platform module (one probe for all)."""

from __future__ import annotations

from typing import Any

from vllm_lite import platform


def visible_cuda_devices() -> int:
    """CUDA devices this process can use (0 without CUDA)."""
    return platform.cuda_device_count() if platform.cuda_available() else 0


def requires_cuda_devices(n: int) -> Any:
    """A pytest skip marker for a test that puts one rank on each of `n` CUDA devices.

    The reason names both numbers, so a skipped multi-GPU test says what it would need. Tests of
    the same feature on CPU ranks pin device="cpu" and run everywhere.
    """
    import pytest

    visible = visible_cuda_devices()
    return pytest.mark.skipif(visible < n, reason=f"needs {n} CUDA devices, {visible} visible")
