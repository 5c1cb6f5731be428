"""Every environment variable vllm-lite reads, in one place (as vLLM's ``envs.py``).

Read them as attributes: ``from vllm_lite import envs; envs.VLLM_LITE_PREPACK``. Each access
reads the environment afresh, so a subprocess started with a changed environment sees its own
values; nothing caches a value at import time. Code elsewhere in ``vllm_lite/`` never calls
``os.environ``/``os.getenv`` for these; it asks this module. Names that are not ours (``CXX``,
``HF_HUB_OFFLINE``, ``TRITON_INTERPRET``) are read here too, with the meaning their owners give them.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional


def _str(name: str, default: Optional[str]) -> Callable[[], Optional[str]]:
    return lambda: os.environ.get(name, default)


def _flag(name: str, default: bool) -> Callable[[], bool]:
    def read() -> bool:
        raw = os.environ.get(name)
        if raw is None or raw == "":
            return default
        return raw.strip().lower() not in ("0", "false", "no", "off")

    return read


def _float(name: str, default: float) -> Callable[[], float]:
    def read() -> float:
        raw = os.environ.get(name)
        if raw is None or raw == "":
            return default
        try:
            return float(raw)
        except ValueError:
            raise ValueError(f"${name} must be a number, got {raw!r}.") from None

    return read


# name -> (reader, one-line doc). The doc is what `python -m vllm_lite.envs` prints.
_VARIABLES: dict[str, tuple[Callable[[], Any], str]] = {
    "VLLM_LITE_LOG_LEVEL": (
        lambda: os.environ.get("VLLM_LITE_LOG_LEVEL", "INFO").upper(),
        "Log level of every vllm-lite process (default INFO); a child process is told its level as an "
        "argument by the launcher, so this is read only in the process the user started.",
    ),
    "VLLM_LITE_ATTENTION_BACKEND": (
        _str("VLLM_LITE_ATTENTION_BACKEND", None),
        "Force an attention backend (torch, cpu, triton); unset: chosen by the platform.",
    ),
    "VLLM_LITE_CPU_ATTENTION_IMPL": (
        _str("VLLM_LITE_CPU_ATTENTION_IMPL", None),
        "Key loop of the C++ CPU attention kernel: auto (default: fastest built here), avx512, avx2, portable.",
    ),
    "VLLM_LITE_CPU_LINEAR_SLICES": (
        _flag("VLLM_LITE_CPU_LINEAR_SLICES", True),
        "Run wide float32 CPU linears (>= 4096 outputs, 16-128 rows) over 768-output weight slices, "
        "bit-identical to F.linear and faster with MKL on AVX2 hosts (default on; 0 turns it off).",
    ),
    "VLLM_LITE_CPU_LINEAR_KBLOCKED": (
        _flag("VLLM_LITE_CPU_LINEAR_KBLOCKED", True),
        "Run float32 CPU linears of 8-512 rows through csrc's f32_linear_kblocked where it sums in MKL's order "
        "here (each case checked bit for bit against F.linear once; default on; 0 turns it off).",
    ),
    "VLLM_LITE_ADAPTIVE_THREADS": (
        _flag("VLLM_LITE_ADAPTIVE_THREADS", True),
        "On CPU, let the engine core change its torch thread count between steps by what other processes "
        "use (default on; 0 keeps the start-up count: all cores but one). An explicit num_threads is fixed.",
    ),
    "VLLM_LITE_CPU_MALLOC_POLICY": (
        _flag("VLLM_LITE_CPU_MALLOC_POLICY", True),
        "On CPU, a process that runs the model sets glibc's M_MMAP_THRESHOLD (256 MiB) and M_TRIM_THRESHOLD "
        "(512 MiB) once its KV cache is allocated, so step activations reuse heap pages instead of being trimmed or "
        "unmapped and faulted back every step (worker/cpu_malloc.py; default on; 0 leaves malloc alone).",
    ),
    "VLLM_CPU_OMP_THREADS_BIND": (
        _str("VLLM_CPU_OMP_THREADS_BIND", "auto"),
        "vLLM's name: 'auto' (default) binds the CPU engine core's compute threads one per core while it uses "
        "every core it may run on; 'nobind' never binds. CPU lists are not supported (read as 'auto').",
    ),
    "VLLM_LITE_PREPACK": (
        _flag("VLLM_LITE_PREPACK", True),
        "Prepack bfloat16 linear weights for oneDNN on CPU at load (default on; 0 turns it off).",
    ),
    "VLLM_LITE_CPU_ENCODER_PACK": (
        _flag("VLLM_LITE_CPU_ENCODER_PACK", True),
        "Run a float32 BERT encoder's CPU linears on oneDNN-packed weights with GELU and residual adds fused "
        "(1.3-1.5x plain F.linear at prefill sizes; sums in another order, ~1e-6 apart; default on; 0 turns it off).",
    ),
    "VLLM_LITE_CPU_ENCODER_ATTN": (
        _flag("VLLM_LITE_CPU_ENCODER_ATTN", True),
        "Run a float32 BERT encoder's CPU attention in csrc's encoder_attention_cpu (the whole batch in one call; "
        "default on where the CPU kernels build; 0: torch, one bmm/softmax or SDPA per prompt).",
    ),
    "VLLM_LITE_CPU_MOE_PACK": (
        _flag("VLLM_LITE_CPU_MOE_PACK", True),
        "Run a mixture-of-experts layer's CPU expert matmuls on oneDNN-packed per-expert weights (about 2x MKL's "
        "F.linear at decode's 8-32 rows an expert; float32 sums in another order, ~1e-6 apart; default on; 0 turns "
        "it off).",
    ),
    "VLLM_LITE_CPU_MOE_KERNEL": (
        _flag("VLLM_LITE_CPU_MOE_KERNEL", True),
        "Run a mixture-of-experts layer's whole CPU expert path (grouped gate/up, SiLU-and-mul, down, weighted "
        "sum) as one C++ op (csrc/moe_cpu.cpp; float32, and bf16 where the build targets AVX512-BF16) instead of "
        "oneDNN calls per expert (default on; 0 turns "
        "it off; VLLM_LITE_CPU_MOE_PACK=0 turns off both).",
    ),
    "VLLM_LITE_CPU_BF16_SMALL_M": (
        _flag("VLLM_LITE_CPU_BF16_SMALL_M", True),
        "On CPUs with AVX512-BF16, run bfloat16 linears of 1-64 rows (decode batches) through vllm-lite's own "
        "kernels on extra, re-laid-out copies of the weight (1.06-1.6x oneDNN there; default on; 0 turns it off).",
    ),
    "VLLM_LITE_CPU_FUSED_OPS": (
        _flag("VLLM_LITE_CPU_FUSED_OPS", True),
        "On CPU, run RMSNorm (with its residual add), rotary embedding and SiLU-and-mul as fused C++ kernels "
        "(csrc/fused_cpu_ops.cpp; the torch code's results, bit for bit on AVX2/AVX-512 hosts; default on; 0 turns them off).",
    ),
    "VLLM_LITE_GC_FREEZE": (
        _flag("VLLM_LITE_GC_FREEZE", True),
        "Freeze the engine core's start-up heap (gc.freeze, as vLLM's freeze_gc_heap) so the cyclic garbage "
        "collector never walks the model and other long-lived objects during steps (default on; 0 turns it off). "
        "The core's own process collects first; an in-process core freezes nothing and only raises the young "
        "threshold while it lives (given back at shutdown, or when a core never shut down is collected).",
    ),
    "VLLM_LITE_GC_GEN0_THRESHOLD": (
        _float("VLLM_LITE_GC_GEN0_THRESHOLD", 10000.0),
        "The engine core's youngest-generation gc threshold while its heap is frozen (Python's default is 700, "
        "which a decode step at batch 256 crosses about twice; default 10000; 0 keeps the interpreter's).",
    ),
    "VLLM_LITE_CACHE_DIR": (
        _str("VLLM_LITE_CACHE_DIR", None),
        "Where built native kernels are cached (default ~/.cache/vllm_lite).",
    ),
    "VLLM_LITE_AUTH_TOKEN": (
        _str("VLLM_LITE_AUTH_TOKEN", None),
        "Default for --auth-token: the token frontends must present to an engine core.",
    ),
    "VLLM_LITE_API_KEY": (
        _str("VLLM_LITE_API_KEY", None),
        "Default for --api-key: the bearer key HTTP clients must present.",
    ),
    "VLLM_LITE_TP_STARTUP_TIMEOUT_S": (
        _float("VLLM_LITE_TP_STARTUP_TIMEOUT_S", 600.0),
        "Seconds tensor-parallel ranks may take to join and load (default 600).",
    ),
    "VLLM_LITE_TP_STEP_TIMEOUT_S": (
        _float("VLLM_LITE_TP_STEP_TIMEOUT_S", 600.0),
        "Seconds one tensor-parallel step may take before the engine is declared dead (default 600).",
    ),
    "VLLM_LITE_MAX_MESSAGE_BYTES": (
        _float("VLLM_LITE_MAX_MESSAGE_BYTES", 0.0),
        "Largest message (bytes) an engine core accepts from a frontend; a bigger one drops that "
        "connection (ZMQ_MAXMSGSIZE). Unset or 0: sized from the model (16 MiB + 32 B per token of "
        "max_model_len and of the vocabulary).",
    ),
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING": (
        _flag("VLLM_ALLOW_RUNTIME_LORA_UPDATING", False),
        "vLLM's switch: serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (default off; "
        "anyone who can reach the API may then load adapters from the server's disk).",
    ),
    "VLLM_TORCH_PROFILER_DIR": (
        _str("VLLM_TORCH_PROFILER_DIR", None),
        "vLLM's switch: a directory where the engine core writes a torch.profiler Chrome trace for each "
        "start_profile()/stop_profile() (and the server's POST /start_profile, /stop_profile, served only when "
        "set); unset: profiling is off. Read in the engine core's process.",
    ),
    "VLLM_LITE_TEST_CACHE": (
        _str("VLLM_LITE_TEST_CACHE", None),
        "Where tests and benchmarks cache the checkpoints they build (default ~/.cache/vllm_lite_test).",
    ),
    "VLLM_LITE_TEST_FAILURE_LOG": (
        _str("VLLM_LITE_TEST_FAILURE_LOG", None),
        "A file the test suite appends each failure's report to as it happens (scripts/gpu_check.py sets it, "
        "so a run cut short by a device lease still says why its tests failed).",
    ),
    "PYTEST_XDIST_WORKER": (
        _str("PYTEST_XDIST_WORKER", None),
        "pytest-xdist's own: set in its worker processes (the failure log is written by the controller only).",
    ),
    "HF_HUB_OFFLINE": (
        _flag("HF_HUB_OFFLINE", False),
        "Hugging Face's own switch: never reach the hub (the test suite sets it).",
    ),
    "PROMETHEUS_MULTIPROC_DIR": (
        _str("PROMETHEUS_MULTIPROC_DIR", None),
        "prometheus-client's own switch: metrics of several processes in this directory, scraped as one "
        "(`vllm-lite serve` sets it for its HTTP frontends).",
    ),
    "TRITON_INTERPRET": (
        _flag("TRITON_INTERPRET", False),
        "Triton's own switch: run Triton kernels in its interpreter (tests on CPU).",
    ),
    "CXX": (
        _str("CXX", "c++"),
        "The C++ compiler that builds the native CPU kernels (default c++).",
    ),
}

# Names children must never inherit from a parent's environment: secrets travel by other means.
SECRET_VARIABLES = ("VLLM_LITE_AUTH_TOKEN", "VLLM_LITE_API_KEY")


def __getattr__(name: str) -> Any:
    if name in _VARIABLES:
        return _VARIABLES[name][0]()
    raise AttributeError(f"module 'vllm_lite.envs' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(_VARIABLES) + ["SECRET_VARIABLES", "describe"])


def describe() -> str:
    """One line per variable: name, current value, doc."""
    return "\n".join(f"{name}={__getattr__(name)!r}\n    {doc}" for name, (_, doc) in _VARIABLES.items())


if __name__ == "__main__":
    print(describe())
