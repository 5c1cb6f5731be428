"""What the bfloat16 CPU attention tests share: the skip rule for hosts whose build has no VDPBF16PS paths, and
the native backend those paths run under (the AVX-512 key loop's builds)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from vllm_lite import platform

if TYPE_CHECKING:
    from vllm_lite.worker.attention.cpu_native import CpuNativeBackend

# Tolerance against the float64 oracle: the bf16 output's rounding plus probabilities rounded to bf16 before P@V.
BF16_ATTENTION_TOL = 3e-2

requires_avx512_bf16 = pytest.mark.skipif(
    "avx512_bf16" not in platform.cpu_flags(),
    reason="needs a CPU with AVX512-BF16 (the bf16 VDPBF16PS attention paths are not built elsewhere)",
)


def avx512_native_backend() -> "CpuNativeBackend":
    """The native backend on an AVX-512 build, where bf16 decode and prefill items take the VDPBF16PS paths."""
    from vllm_lite.worker.attention import cpu_kernels
    from vllm_lite.worker.attention.cpu_native import CpuNativeBackend

    assert cpu_kernels.load_cpu_ops(), "the CPU kernels must build on a machine with a C++ compiler"
    b = CpuNativeBackend("auto")
    assert b.key_loop(64) == "avx512"
    return b
