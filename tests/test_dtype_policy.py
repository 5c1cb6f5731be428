"""dtype="auto": the checkpoint's dtype, but bfloat16 for float32 checkpoints where bf16 is native."""

from __future__ import annotations

import pytest
import torch

from vllm_lite import config
from vllm_lite.config import resolve_dtype

CPU = torch.device("cpu")


@pytest.mark.parametrize("native", [True, False])
def test_auto_runs_float32_checkpoints_in_bf16_only_where_cpu_has_native_bf16(monkeypatch, native: bool) -> None:
    monkeypatch.setattr(config, "cpu_has_native_bf16", lambda: native)
    want = torch.bfloat16 if native else torch.float32
    assert resolve_dtype("auto", "float32", CPU) == want
    assert resolve_dtype("auto", None, CPU) == want
    assert resolve_dtype("float32", "float32", CPU) == torch.float32  # explicit float32 stays exact
    assert resolve_dtype("auto", "bfloat16", CPU) == torch.bfloat16


def test_float16_is_never_used_on_cpu() -> None:
    assert resolve_dtype("auto", "float16", CPU) == torch.bfloat16
    assert resolve_dtype("float16", None, CPU) == torch.bfloat16


def test_unknown_dtype_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="dtype must be one of"):
        resolve_dtype("int8", None, CPU)


def test_this_machine_reports_its_bf16_support_consistently() -> None:
    flags = open("/proc/cpuinfo").read()
    assert config.cpu_has_native_bf16() == ("avx512_bf16" in flags or "amx_bf16" in flags)
