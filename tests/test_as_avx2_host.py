"""scripts/as_avx2_host.sh disguises this host as an AVX2-only CPU for every Python process it starts, so the suite
can test an AVX2 (Zen 3) CI host's paths here: torch's dispatch, vllm-lite's flags and bf16 checks, the kernel
build target and cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import json, torch
import vllm_lite.platform as p
from vllm_lite.worker.attention import cpu_kernels as k
print(json.dumps({
    "capability": torch.backends.cpu.get_cpu_capability(),
    "avx512_flags": [f for f in p.cpu_flags() if f.startswith(("avx512", "amx"))],
    "native_bf16": p.cpu_has_native_bf16(),
    "cflags": k.EXTRA_CFLAGS,
    "cache": str(k.cache_dir()),
}))
"""


def test_every_child_python_sees_an_avx2_cpu_and_builds_for_znver3(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "VLLM_LITE_CACHE_DIR")}
    out = subprocess.run(
        ["bash", str(ROOT / "scripts" / "as_avx2_host.sh"), sys.executable, "-c", PROBE],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["capability"] in ("AVX2", "DEFAULT")  # DEFAULT: a CPU below AVX2 stays below it
    assert got["avx512_flags"] == [] and got["native_bf16"] is False
    assert "-march=znver3" in got["cflags"] and "-march=native" not in got["cflags"]
    assert got["cache"] == str(ROOT / ".avx2-host-cache")  # never the native build's cache
