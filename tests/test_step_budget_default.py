"""The default step budget (max_num_batched_tokens) follows vLLM's per-device table.

A large CUDA GPU (70 GiB or more, not an A100) takes 16384 tokens a step for the offline LLM and 8192 for a
server; CPUs and smaller GPUs keep max(2048, min(max_model_len, 8192)). The device facts are stand-ins here.
"""

from __future__ import annotations

import pytest
import torch

from vllm_lite import platform as _platform
from vllm_lite.engine_args import LLM_CLASS, EngineArgs, default_max_num_batched_tokens
from vllm_lite.testing.checkpoints import get_checkpoint

GIB = 1024**3


def _fake_gpu(monkeypatch: pytest.MonkeyPatch, name: str, gib: int) -> None:
    monkeypatch.setattr(_platform, "cuda_device_count", lambda: 1)
    monkeypatch.setattr(_platform, "cuda_device_names", lambda: (name,))
    monkeypatch.setattr(_platform, "cuda_device_total_memory", lambda index=0: gib * GIB)


@pytest.mark.parametrize(
    ("name", "gib", "context", "expected"),
    [
        ("NVIDIA H100 80GB HBM3", 80, LLM_CLASS, 16384),
        ("NVIDIA H100 80GB HBM3", 80, None, 8192),
        ("NVIDIA H200", 140, LLM_CLASS, 16384),
        ("NVIDIA A100-SXM4-80GB", 80, LLM_CLASS, 2048),  # vLLM measured the big budget slower on an A100
        ("NVIDIA L4", 24, LLM_CLASS, 2048),
    ],
)
def test_large_cuda_gpus_take_vllms_bigger_budget(monkeypatch, name, gib, context, expected):
    _fake_gpu(monkeypatch, name, gib)
    assert default_max_num_batched_tokens(torch.device("cuda", 0), 1024, context) == expected


def test_a_cuda_device_that_cannot_be_asked_keeps_the_model_length_rule(monkeypatch):
    """Tests fake CUDA device counts on a CPU build of torch: the budget must not ask torch.cuda then."""
    monkeypatch.setattr(_platform, "cuda_available", lambda: True)
    monkeypatch.setattr(_platform, "cuda_device_count", lambda: 4)

    def no_cuda(*args):
        raise AssertionError("Torch not compiled with CUDA enabled")

    monkeypatch.setattr(_platform, "cuda_device_names", no_cuda)
    assert default_max_num_batched_tokens(torch.device("cuda", 1), 1024, LLM_CLASS) == 2048


def test_cpu_keeps_the_model_length_rule_whatever_the_context():
    cpu = torch.device("cpu")
    assert default_max_num_batched_tokens(cpu, 1024, LLM_CLASS) == 2048
    assert default_max_num_batched_tokens(cpu, 4096, LLM_CLASS) == 4096
    assert default_max_num_batched_tokens(cpu, 32768, None) == 8192


def test_the_usage_context_reaches_the_scheduler_config_and_an_explicit_budget_wins(monkeypatch):
    """create_engine_config uses the table only when max_num_batched_tokens is unset."""
    model = get_checkpoint("llama")
    calls = []

    def table(device, max_model_len, usage_context=None):
        calls.append(usage_context)
        return 3000

    monkeypatch.setattr("vllm_lite.engine_args.default_max_num_batched_tokens", table)
    cfg = EngineArgs(model=model, device="cpu", max_model_len=256).create_engine_config(LLM_CLASS)
    assert cfg.scheduler_config.max_num_batched_tokens == 3000 and calls == [LLM_CLASS]
    cfg = EngineArgs(model=model, device="cpu", max_model_len=256, max_num_batched_tokens=512).create_engine_config()
    assert cfg.scheduler_config.max_num_batched_tokens == 512


def test_the_offline_llm_asks_for_the_llm_class_budget(monkeypatch):
    """LLM(...) builds its engine with vLLM's LLM_CLASS usage context (a server passes none)."""
    from vllm_lite.client.llm_engine import LLMEngine
    from vllm_lite.entrypoints.llm import LLM

    seen = {}

    def capture(cls, engine_args, multiprocess_mode=True, usage_context=None):
        seen["usage_context"] = usage_context
        raise RuntimeError("stop before starting a core")

    monkeypatch.setattr(LLMEngine, "from_engine_args", classmethod(capture))
    with pytest.raises(RuntimeError, match="stop before"):
        LLM(model=get_checkpoint("llama"), device="cpu")
    assert seen == {"usage_context": LLM_CLASS}
