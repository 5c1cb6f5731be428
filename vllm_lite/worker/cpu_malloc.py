"""glibc malloc settings for a process that runs the model on CPU: step activations reuse the heap's pages.

Why: torch's CPU allocator is plain malloc. By default glibc returns the top of the heap to the kernel (brk down)
whenever more than M_TRIM_THRESHOLD of it is free, and serves a block of M_MMAP_THRESHOLD or more with its own
mmap, unmapped on free. Both thresholds start at 128 KiB and follow the largest mmapped block freed so far, capped
at 32 MiB (trim at twice that). A 2,048-token prefill step of the bench Qwen2 in bf16 frees ~50 MB of activations
at the heap's top between layers (gate_up's output alone is 25 MB), so the heap was trimmed and grown back every
few layers: 13,000-62,000 minor faults a step, 43,000-120,000 a run of vs_vllm's workload, each a fresh zeroed
4 KiB page written by a oneDNN matmul or a kernel (benchmarks/PROFILE.md, "Prefill page faults"). Larger token
budgets put gate_up's output past the 32 MiB cap: an mmap and munmap per layer, every page faulted each time.

What: a fixed M_MMAP_THRESHOLD of 256 MiB (blocks below it come from the heap; setting it also stops glibc's
sliding thresholds) and M_TRIM_THRESHOLD of twice that (glibc's own ratio), so the heap keeps the pages of its
largest step and the next step writes into memory already mapped. Peak RSS stays the same (those pages were
resident at the step's peak anyway); between bursts the process keeps up to 512 MiB of free heap instead of
returning it. vLLM's CPU guide preloads tcmalloc for the same reason. Applied once, after the weights and the KV
cache are allocated (their large blocks are still mmapped and go back to the OS whole when freed), in every process
that runs the model on CPU: the engine core, tensor-parallel ranks, or the caller's own process for an in-process
engine. $VLLM_LITE_CPU_MALLOC_POLICY=0 leaves malloc alone.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import Optional

from vllm_lite import envs

logger = logging.getLogger(__name__)

# mallopt parameters (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD = 256 << 20
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD

_lock = threading.Lock()
_applied: list[dict[str, int]] = []


def _glibc() -> Optional[ctypes.CDLL]:
    """This process's C library when it is glibc (mallopt and gnu_get_libc_version exported), else None."""
    try:
        libc = ctypes.CDLL(None)
        for symbol in ("gnu_get_libc_version", "mallopt"):  # musl and other C libraries lack the first
            getattr(libc, symbol)
    except (OSError, AttributeError):
        return None
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    return libc


def apply_cpu_malloc_policy() -> Optional[dict[str, int]]:
    """Set the thresholds once in this process; the settings applied (now or earlier), or None where the flag is
    off or the C library is not glibc."""
    if not envs.VLLM_LITE_CPU_MALLOC_POLICY:
        return None
    with _lock:
        if _applied:
            return _applied[0]
        libc = _glibc()
        if libc is None:
            logger.debug("CPU malloc policy: not glibc, malloc left alone")
            return None
        # The trim threshold first: it takes any value. older glibc caps the mmap threshold at HEAP_MAX_SIZE / 2
        # (32 MiB on 64-bit); that cap is taken where the larger value is refused.
        if libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) != 1:
            logger.warning("CPU malloc policy: glibc refused mallopt(M_TRIM_THRESHOLD, %d)", TRIM_THRESHOLD)
            return None
        mmap_threshold = next((v for v in (MMAP_THRESHOLD, 32 << 20) if libc.mallopt(M_MMAP_THRESHOLD, v) == 1), 0)
        settings = {"M_MMAP_THRESHOLD": mmap_threshold, "M_TRIM_THRESHOLD": TRIM_THRESHOLD}
        _applied.append(settings)
        logger.debug("CPU malloc policy: %s", settings)
        return settings
