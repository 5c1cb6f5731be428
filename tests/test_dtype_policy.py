"""dtype policy: the checkpoint's dtype, what the user asked for, and what this hardware runs fast.

The policy is checked as a table of literal expectations for described hosts (an AVX2-only CPU, an
AVX-512 BF16 CPU, GPUs with and without bf16), so no test re-derives the answer the way the code does;
then once on this machine, against the facts the platform module probed.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

from vllm_lite import dtype_policy, platform
from vllm_lite.dtype_policy import choose_dtype, resolve_dtype
from vllm_lite.engine_args import EngineArgs
from vllm_lite.platform import HostFacts

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16

AVX2 = HostFacts(cpu_native_bf16=False, cpu_name="Zen 3 (AVX2 only)")
AVX512_BF16 = HostFacts(cpu_native_bf16=True, cpu_name="Zen 4 (AVX-512 BF16)")
GPU_BF16 = HostFacts(cpu_native_bf16=False, cuda_bf16=True)
GPU_NO_BF16 = HostFacts(cpu_native_bf16=False, cuda_bf16=False)

# (host, device, requested, checkpoint dtype) -> (dtype, log line expected?, warning?)
CASES = [
    # AVX2-only CPU: 16-bit checkpoints compute in float32 under auto; explicit bf16 obeyed with a warning.
    (AVX2, CPU, "auto", "bfloat16", F32, True, False),
    (AVX2, CPU, "auto", "float16", F32, True, False),
    (AVX2, CPU, "auto", "float32", F32, False, False),
    (AVX2, CPU, "auto", None, F32, False, False),
    (AVX2, CPU, "bfloat16", "float32", BF16, True, True),
    (AVX2, CPU, "bfloat16", "bfloat16", BF16, True, True),
    (AVX2, CPU, "float16", None, BF16, True, True),
    (AVX2, CPU, "half", "float16", BF16, True, True),
    (AVX2, CPU, "float32", "bfloat16", F32, False, False),
    (AVX2, CPU, F32, "bfloat16", F32, False, False),
    # AVX-512 BF16 CPU: float32 checkpoints run in bf16 under auto (as vLLM downcasts).
    (AVX512_BF16, CPU, "auto", "float32", BF16, True, False),
    (AVX512_BF16, CPU, "auto", None, BF16, True, False),
    (AVX512_BF16, CPU, "auto", "torch.float32", BF16, True, False),
    (AVX512_BF16, CPU, "auto", "bfloat16", BF16, False, False),
    (AVX512_BF16, CPU, "auto", "float16", BF16, True, False),
    (AVX512_BF16, CPU, "bfloat16", "float32", BF16, False, False),
    (AVX512_BF16, CPU, "float32", "float32", F32, False, False),
    (AVX512_BF16, CPU, "float", "bfloat16", F32, False, False),
    (AVX512_BF16, CPU, "float16", "float32", BF16, True, True),
    # GPUs: bf16 where native, else float16.
    (GPU_BF16, CUDA, "auto", "float32", BF16, True, False),
    (GPU_BF16, CUDA, "auto", "bfloat16", BF16, False, False),
    (GPU_BF16, CUDA, "auto", "float16", F16, False, False),
    (GPU_NO_BF16, CUDA, "auto", "float32", F16, True, False),
    (GPU_NO_BF16, CUDA, "auto", "bfloat16", F16, True, False),
    (GPU_NO_BF16, CUDA, "bfloat16", None, BF16, True, True),
    (GPU_NO_BF16, CUDA, "float32", "bfloat16", F32, False, False),
    (GPU_BF16, CUDA, "float16", "bfloat16", F16, False, False),
]


@pytest.mark.parametrize("host, device, requested, ckpt, want, logged, warns", CASES)
def test_choice_for_described_hosts(host, device, requested, ckpt, want, logged, warns) -> None:
    choice = choose_dtype(requested, ckpt, device, host)
    assert choice.dtype == want
    assert (choice.message is not None) == logged, choice.message
    assert choice.warn == warns


def test_float32_fallback_line_names_the_cpu_and_the_reason() -> None:
    msg = choose_dtype("auto", "bfloat16", CPU, AVX2).message
    assert "float32" in msg and "Zen 3 (AVX2 only)" in msg and "6x slower" in msg
    warning = choose_dtype("bfloat16", "bfloat16", CPU, AVX2).message
    assert "slower" in warning and "float32" in warning


def test_unknown_dtype_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="dtype must be one of"):
        choose_dtype("int8", None, CPU, AVX2)
    with pytest.raises(ValueError, match="dtype must be one of"):
        resolve_dtype("int8", None, CPU)


def test_this_host_uses_the_probed_facts() -> None:
    facts = platform.host_facts()
    assert facts.cpu_native_bf16 == platform.cpu_has_native_bf16()
    for requested, ckpt in [("auto", "bfloat16"), ("auto", "float32"), ("float16", None), ("float32", None)]:
        assert resolve_dtype(requested, ckpt, CPU) == choose_dtype(requested, ckpt, CPU, facts).dtype
    # Whatever the host, auto never computes a 16-bit checkpoint in bf16 on a CPU without native bf16.
    auto_bf16 = resolve_dtype("auto", "bfloat16", CPU)
    assert auto_bf16 == (BF16 if facts.cpu_native_bf16 else F32)


def test_engine_config_applies_the_policy(tmp_path) -> None:
    """create_engine_config reads only config.json, so a bf16 checkpoint's config is enough here."""
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "torch_dtype": "bfloat16",
        "vocab_size": 128,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_hidden_layers": 1,
        "intermediate_size": 128,
        "max_position_embeddings": 256,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    got = EngineArgs(model=str(tmp_path), device="cpu").create_engine_config().model_config.dtype
    assert got == choose_dtype("auto", "bfloat16", CPU, platform.host_facts()).dtype
    exact = EngineArgs(model=str(tmp_path), device="cpu", dtype="float32").create_engine_config()
    assert exact.model_config.dtype == F32


def test_reason_is_logged_once_per_process(monkeypatch, caplog) -> None:
    monkeypatch.setattr(dtype_policy, "_announced", set())
    with caplog.at_level(logging.INFO, logger="vllm_lite.dtype_policy"):
        for _ in range(3):  # e.g. a serve daemon building one config per data-parallel core
            assert resolve_dtype("float16", None, CPU) == BF16  # a warning on every kind of CPU
    lines = [r for r in caplog.records if r.name == "vllm_lite.dtype_policy"]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING
    assert "float16 computes in bfloat16" in lines[0].getMessage()
