"""Triton kernels checked without a GPU: check drivers under the interpreter, and ahead-of-time sm_90 compiles.

TRITON_INTERPRET must be set before triton is imported, so a test never sets it in its own process: it runs a
driver module (``python -m vllm_lite.testing.<driver> --device cpu``, printing one JSON report as its last
``{``-line) in a child whose environment alone carries it. The interpreter accepts code the CUDA compiler would
not, so the same kernels are also compiled for an H100/H200 (sm_90) here, with no device.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from typing import Any, Callable, Mapping, Optional

# The source tree, so a child imports this checkout's vllm_lite whether or not it is installed.
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def child_env(**extra: str) -> dict[str, str]:
    """This environment plus ``extra``, with the source tree importable and TRITON_INTERPRET only where asked."""
    env = dict(os.environ, **extra)
    if "TRITON_INTERPRET" not in extra:
        env.pop("TRITON_INTERPRET", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH", "")) if p)
    return env


def interpreter_env() -> dict[str, str]:
    """A child's environment for the interpreter: TRITON_INTERPRET=1 and no CUDA device visible."""
    return child_env(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")


def last_report(stdout: str, stderr: str, returncode: Any) -> dict[str, Any]:
    """The driver's JSON report (its last line starting with '{'); an AssertionError with its stderr when none."""
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    assert lines, f"the interpreter driver printed no result (exit {returncode}):\n{stderr[-4000:]}"
    return json.loads(lines[-1])


def run_interpreter_driver(module: str, timeout: float = 900.0) -> dict[str, Any]:
    """Run ``python -m module --device cpu`` under the interpreter and return its report."""
    proc = subprocess.run(
        [sys.executable, "-m", module, "--device", "cpu"],
        env=interpreter_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return last_report(proc.stdout, proc.stderr, proc.returncode)


def run_named_checks(checks: Mapping[str, Callable[[], Any]]) -> dict[str, Optional[str]]:
    """A driver's report body: name -> None when its check passed, else its failure text (one never hides the rest)."""
    results: dict[str, Optional[str]] = {}
    for name, check in checks.items():
        try:
            check()
            results[name] = None
        except Exception:  # noqa: BLE001 - the report carries every failure's text
            results[name] = traceback.format_exc(limit=-6)
    return results


def compile_for_sm90(fn: Any, signature: dict[str, str], constexprs: dict[str, Any]) -> Any:
    """``fn`` compiled for sm_90 without a GPU (the constexprs join the signature); skips the calling test where
    this Triton has no CUDA backend or ptxas."""
    import pytest
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {**signature, **{name: "constexpr" for name in constexprs}}
    try:
        return triton.compile(
            ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=GPUTarget("cuda", 90, 32)
        )
    except (ImportError, FileNotFoundError) as e:  # a Triton build without the CUDA backend or its ptxas
        pytest.skip(f"this Triton cannot compile for CUDA here: {e}")
