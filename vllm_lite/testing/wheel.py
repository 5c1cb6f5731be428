"""Build the project's wheel from a copy of the source tree, as `pip wheel .` on a checkout would.

Packaging tests (the default model's assets, the CPU kernels' sources) inspect the same wheel, so the
suite builds it once (a session fixture in tests/conftest.py) instead of once per test: a build costs
a pip run of several seconds.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# What a checkout holds that the build reads; everything else (tests, docs, benchmarks) stays out.
TOP_LEVEL_FILES = ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md")


def build_wheel(workdir: Path, repo: Path = REPO, timeout_s: float = 600.0) -> Path:
    """Copy the sources under ``workdir/src`` (no caches or built .so files), run `pip wheel` there; the wheel's path.

    AssertionError with pip's stderr when the build fails, so a packaging test fails with the reason."""
    src = workdir / "src"
    src.mkdir(parents=True)
    for name in TOP_LEVEL_FILES:
        if (repo / name).exists():
            shutil.copy(repo / name, src)
    if (repo / "csrc").is_dir():
        shutil.copytree(repo / "csrc", src / "csrc")
    shutil.copytree(
        repo / "vllm_lite", src / "vllm_lite", ignore=shutil.ignore_patterns("__pycache__", "*.so", "build")
    )
    dist = workdir / "dist"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist)],
        cwd=src,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    (wheel,) = dist.glob("*.whl")
    return wheel
