"""Loaded by scripts/as_avx2_host.sh in every Python process it starts: this host looks like an AVX2-only x86 CPU
(a Zen 3 without AVX-512 or native bfloat16) to torch, oneDNN, MKL and vllm-lite, so the paths such a CI or user
host takes (float32 by default, bf16 without oneDNN packing, the AVX2 kernels built for znver3) run and are tested
on an AVX-512 machine. Correctness only: speed on a real Zen 3 differs.

Known differences from a real AVX2 host, none of them a product bug: tests that read /proc/cpuinfo themselves
(test_platform's flags check), the check that vllm_lite.platform imports nothing above it (this file imports the
kernel builder), and the wheel test's child (its PYTHONPATH drops this file, so it builds for the native CPU)."""

import os
import sys

for _name, _value in (
    ("ATEN_CPU_CAPABILITY", "avx2"),  # torch's own kernels and get_cpu_capability()
    ("ONEDNN_MAX_CPU_ISA", "AVX2"),  # oneDNN: no AVX-512 (so no bf16 weight packing either)
    ("DNNL_MAX_CPU_ISA", "AVX2"),
    ("MKL_ENABLE_INSTRUCTIONS", "AVX2"),
):
    os.environ.setdefault(_name, _value)

try:
    import functools

    import vllm_lite.platform as _platform
    import vllm_lite.worker.attention.cpu_kernels as _kernels

    _native_flags = _platform.cpu_flags.__wrapped__

    @functools.cache
    def _avx2_flags() -> tuple[str, ...]:
        """The CPU's flags without AVX-512 and AMX, as an AVX2-only CPU reports them."""
        return tuple(f for f in _native_flags() if not f.startswith(("avx512", "amx")))

    _platform.cpu_flags = _avx2_flags
    _kernels.EXTRA_CFLAGS[:] = ["-march=znver3" if f == "-march=native" else f for f in _kernels.EXTRA_CFLAGS]
except Exception as e:  # noqa: BLE001 - say so loudly: a half-applied disguise tests the wrong thing
    print(f"as_avx2_host: could not disguise this host ({type(e).__name__}: {e})", file=sys.stderr)
    raise
