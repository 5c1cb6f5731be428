"""Every environment variable is read through vllm_lite/envs.py, and envs.py reads them afresh."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from vllm_lite import envs

PACKAGE = Path(envs.__file__).resolve().parent


def _is_os_attr(node: ast.AST, name: str) -> bool:
    """`os.<name>` (the module is imported as `os` everywhere in the package)."""
    return (
        isinstance(node, ast.Attribute)
        and node.attr == name
        and isinstance(node.value, ast.Name)
        and node.value.id == "os"
    )


def environment_reads(source: str) -> list[tuple[int, str]]:
    """(line, code) of each read of a variable's value: os.getenv(), os.environ.get()/setdefault()/pop(),
    os.environ[...] as a value, and `... in os.environ`. Copying the whole environment to build a child's
    (dict(os.environ), {**os.environ}, os.environ.copy(), .items()) and writes are not reads."""
    tree = ast.parse(source)
    lines = source.splitlines()
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        hit = False
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            hit = _is_os_attr(f, "getenv") or (
                f.attr in ("get", "setdefault", "pop") and _is_os_attr(f.value, "environ")
            )
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            hit = _is_os_attr(node.value, "environ")
        elif isinstance(node, ast.Compare):
            hit = any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops) and any(
                _is_os_attr(c, "environ") for c in node.comparators
            )
        if hit:
            found.append((node.lineno, lines[node.lineno - 1].strip()))
    return found


def test_the_detector_tells_reads_from_copies() -> None:
    src = (
        "import os\n"
        "a = os.environ.get('A')\n"
        "b = os.getenv('B', '1')\n"
        "c = os.environ['C']\n"
        "d = 'D' in os.environ\n"
        "child = dict(os.environ, HF_HUB_OFFLINE='1')\n"
        "child2 = {**os.environ}\n"
        "child3 = {k: v for k, v in os.environ.items() if k != 'SECRET'}\n"
        "os.environ['E'] = '1'\n"
    )
    assert [line for line, _ in environment_reads(src)] == [2, 3, 4, 5]


def test_no_environment_reads_outside_envs_py() -> None:
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "envs.py" and path.parent == PACKAGE:
            continue
        for line, code in environment_reads(path.read_text(encoding="utf-8")):
            offenders.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {code}")
    assert not offenders, "read these through vllm_lite/envs.py:\n" + "\n".join(offenders)


def test_values_are_read_afresh_with_defaults(monkeypatch) -> None:
    monkeypatch.delenv("VLLM_LITE_PREPACK", raising=False)
    assert envs.VLLM_LITE_PREPACK is True
    monkeypatch.setenv("VLLM_LITE_PREPACK", "0")
    assert envs.VLLM_LITE_PREPACK is False
    monkeypatch.setenv("VLLM_LITE_LOG_LEVEL", "debug")
    assert envs.VLLM_LITE_LOG_LEVEL == "DEBUG"
    monkeypatch.setenv("VLLM_LITE_TP_STEP_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="VLLM_LITE_TP_STEP_TIMEOUT_S"):
        _ = envs.VLLM_LITE_TP_STEP_TIMEOUT_S
    with pytest.raises(AttributeError):
        _ = envs.VLLM_LITE_NOT_A_VARIABLE
