"""What this machine can do, probed once per process and asked everywhere (vLLM's ``platforms``).

CUDA, the CPU's model and features, whether oneDNN's bfloat16 weight prepacking really runs here,
and whether the native C++ kernels can be built: each answer comes from doing the thing the way the
engine will do it (or reading what the kernel loader found), not from what torch was built with.
``torch.backends.mkldnn.is_available()`` says yes on AVX2-only CPUs whose oneDNN then refuses the
bf16 reorder at run time; the probe here runs that reorder on a tiny tensor instead.

Top level: imports nothing from client/core/worker/entrypoints. The worker's kernel loader reports
its result here (``record_native_kernels``) so the answer lives in one place.
"""

from __future__ import annotations

import functools
import os
import platform as _stdlib_platform
import shutil
from dataclasses import dataclass
from typing import Any, Optional

import torch

from vllm_lite import envs


@dataclass(frozen=True)
class Capability:
    """A yes/no answer with the reason when it is no (what the log and describe_host say)."""

    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


@dataclass(frozen=True)
class HostFacts:
    """The facts the dtype policy decides from; tests build fake ones for either kind of host."""

    cpu_native_bf16: bool
    cuda_bf16: bool = False
    cpu_name: str = "this CPU"


# ---------------------------------------------------------------------------- CUDA
@functools.cache
def cuda_available() -> bool:
    return torch.cuda.is_available()


@functools.cache
def cuda_device_count() -> int:
    return torch.cuda.device_count() if cuda_available() else 0


@functools.cache
def cuda_device_names() -> tuple[str, ...]:
    return tuple(torch.cuda.get_device_name(i) for i in range(cuda_device_count()))


@functools.cache
def cuda_device_total_memory(index: int = 0) -> int:
    """Bytes of memory on CUDA device ``index`` (0 without CUDA): vLLM sizes its default step budget by it."""
    return torch.cuda.get_device_properties(index).total_memory if cuda_available() else 0


@functools.cache
def cuda_bf16_supported() -> bool:
    """bfloat16 runs natively on the current CUDA device (Ampere and later)."""
    return cuda_available() and torch.cuda.is_bf16_supported()


def resolve_device(device: str | torch.device) -> torch.device:
    """'auto' is CUDA when present, else CPU; naming CUDA on a machine without it is a clear error."""
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        return torch.device("cuda" if cuda_available() else "cpu")
    out = torch.device(device)
    if out.type == "cuda" and not cuda_available():
        raise ValueError(f"device={device!r}, but this machine has no usable CUDA device (torch {torch.__version__}).")
    return out


# ---------------------------------------------------------------------------- CPU
@functools.cache
def _cpuinfo() -> dict[str, str]:
    """The first processor's fields from /proc/cpuinfo (empty where there is none)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    if fields:
                        break
                    continue
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


@functools.cache
def cpu_flags() -> tuple[str, ...]:
    """The CPU's feature flags in /proc/cpuinfo order (x86 'flags', Arm 'Features')."""
    info = _cpuinfo()
    return tuple((info.get("flags") or info.get("Features") or "").split())


@functools.cache
def cpu_model_name() -> str:
    info = _cpuinfo()
    return info.get("model name") or info.get("Hardware") or _stdlib_platform.processor() or _stdlib_platform.machine()


@functools.cache
def cpu_capability() -> str:
    """The SIMD level torch's CPU kernels dispatch to here (e.g. AVX2, AVX512)."""
    return torch.backends.cpu.get_cpu_capability()


@functools.cache
def cpu_has_native_bf16() -> bool:
    """AVX-512 BF16 or AMX-BF16: bfloat16 matmuls then run ~2x float32; without them ~6x slower."""
    flags = set(cpu_flags())
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cpu_affinity() -> int:
    """How many cores this process may run on (cgroups and taskset included)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@functools.cache
def onednn_bf16_prepack() -> Capability:
    """Whether oneDNN's bf16 linear-weight prepacking runs here, tried once as the worker uses it.

    Small integers keep every product and sum exact in bfloat16/float32, so any correct kernel gives
    exactly F.linear's answer; a difference means the packed path is wrong here, not rounding.
    """
    if not torch.backends.mkldnn.is_available():
        return Capability(False, "torch was built without oneDNN")
    w = (torch.arange(16 * 32).reshape(16, 32) % 5 - 2).to(torch.bfloat16)
    x = (torch.arange(4 * 32).reshape(4, 32) % 3 - 1).to(torch.bfloat16)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 4)
        y = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    except (RuntimeError, AttributeError) as e:
        return Capability(False, str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
    if not torch.equal(y, torch.nn.functional.linear(x, w)):
        return Capability(False, "oneDNN's packed bf16 linear gave a different result from F.linear")
    return Capability(True)


# ---------------------------------------------------------------------------- native kernels
@functools.cache
def _which(name: str) -> Optional[str]:
    return shutil.which(name)


def cxx_compiler() -> Optional[str]:
    """Path of the C++ compiler ($CXX, default c++) the native kernels are built with; None if absent."""
    return _which(envs.CXX)


_native_kernels_loaded: Optional[bool] = None


def record_native_kernels(loaded: bool) -> None:
    """Called by the kernel loader with its (cached) result, so that this module can answer it."""
    global _native_kernels_loaded
    _native_kernels_loaded = loaded


def native_kernels() -> Capability:
    """Whether the native CPU kernels are usable: the loader's result once it has run, else whether a
    compiler is there to build them (nothing is built here)."""
    if _native_kernels_loaded is not None:
        return Capability(
            _native_kernels_loaded, "" if _native_kernels_loaded else "the kernel loader failed (see its log)"
        )
    if cxx_compiler() is None:
        return Capability(False, f"no C++ compiler (CXX={envs.CXX!r})")
    return Capability(True, "")


def native_kernels_loaded() -> Optional[bool]:
    """The kernel loader's result in this process; None when it has not run yet."""
    return _native_kernels_loaded


# ---------------------------------------------------------------------------- summaries
@functools.cache
def host_facts() -> HostFacts:
    """This machine's facts for the dtype policy."""
    return HostFacts(cpu_native_bf16=cpu_has_native_bf16(), cuda_bf16=cuda_bf16_supported(), cpu_name=cpu_model_name())


def describe_host() -> dict[str, Any]:
    """What a benchmark prints about the machine it ran on (JSON-serialisable)."""
    prepack = onednn_bf16_prepack()
    return {
        "cpu_model": cpu_model_name(),
        "cpu_capability": cpu_capability(),
        "cpu_native_bf16": cpu_has_native_bf16(),
        "onednn_bf16_prepack": prepack.ok,
        "cpu_count": os.cpu_count(),
        "cpu_affinity": cpu_affinity(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda_devices": list(cuda_device_names()),
        "cxx_compiler": cxx_compiler(),
        "native_kernels_loaded": native_kernels_loaded(),
    }


if __name__ == "__main__":
    import json

    print(json.dumps(describe_host(), indent=2))
