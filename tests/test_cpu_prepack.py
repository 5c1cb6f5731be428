"""oneDNN bf16 weight prepacking: bit-identical logits where this CPU packs bf16, plain F.linear where not.

Whether oneDNN packs bf16 here is the platform probe's answer (AVX2-only CPUs refuse at run time);
the tests check the packed path where it exists and the fallback everywhere (forcing the probe's
answer to "no" on hosts where it is yes).
"""

from __future__ import annotations

import logging

import pytest
import torch

from vllm_lite import platform
from vllm_lite.engine_args import EngineArgs
from vllm_lite.platform import Capability
from vllm_lite.testing.checkpoints import get_checkpoint
from vllm_lite.testing.paged import PagedModelDriver
from vllm_lite.worker.attention.torch_ref import TorchRefBackend
from vllm_lite.worker.model_loader import load_model
from vllm_lite.worker.models import cpu_prepack
from vllm_lite.worker.models.cpu_prepack import maybe_prepack, prepack_linear_weights

CPU = torch.device("cpu")
LOGGER = "vllm_lite.worker.models.cpu_prepack"


def _model(arch: str) -> torch.nn.Module:
    cfg = EngineArgs(model=get_checkpoint(arch), dtype="bfloat16", device="cpu").create_engine_config()
    return load_model(cfg.model_config, CPU)


def _logits(model: torch.nn.Module) -> list[torch.Tensor]:
    prompts = [[5 + i for i in range(17)], [40 + 2 * i for i in range(9)]]
    driver = PagedModelDriver(model, prompts, block_size=4, backend=TorchRefBackend(), dtype=torch.bfloat16)
    out = driver.step([10, 9])  # a prefill chunk and a whole prompt
    out += driver.step([7, 0])  # the rest of the first prompt, second idle
    return out


def _packed_modules(model: torch.nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if getattr(m, "packed_weight", None) is not None]


def _assert_equal(arch: str, plain: list[torch.Tensor], other: list[torch.Tensor]) -> None:
    for a, b in zip(plain, other, strict=True):
        assert torch.equal(a, b), f"{arch}: logits differ by {(a - b).abs().max().item()}"


@pytest.mark.parametrize("arch", ["qwen2", "opt"])  # tied head; OPT's unpacked project_in/out stay plain
def test_this_host_packs_bit_exactly_or_falls_back_to_plain_linear(arch, caplog, monkeypatch) -> None:
    # oneDNN's packing is what must be bit-exact; the 1-2 row kernel (its own test file) sums in another order.
    monkeypatch.setenv("VLLM_LITE_CPU_BF16_SMALL_M", "0")
    plain = _logits(_model(arch))
    model = _model(arch)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        n = prepack_linear_weights(model)
    if platform.onednn_bf16_prepack().ok:
        assert n > 0 and len(_packed_modules(model)) == n, "oneDNN packs bf16 here, but nothing was prepacked"
    else:
        assert n == 0 and _packed_modules(model) == []
        lines = [r.getMessage() for r in caplog.records if "prepacking unavailable" in r.getMessage()]
        assert lines == [
            f"weight prepacking unavailable ({platform.onednn_bf16_prepack().reason}); using plain F.linear"
        ]
    _assert_equal(arch, plain, _logits(model))


def test_fallback_when_onednn_cannot_pack_bf16(monkeypatch, caplog) -> None:
    """On every host: told oneDNN cannot pack, nothing is packed, weights stay, one log line, same logits."""
    monkeypatch.setattr(platform, "onednn_bf16_prepack", lambda: Capability(False, "no avx512bw here"))
    plain = _logits(_model("qwen2"))
    model = _model("qwen2")
    shapes = {name: p.shape for name, p in model.named_parameters()}
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert maybe_prepack(model, CPU, torch.bfloat16) == 0
    assert _packed_modules(model) == []
    assert {name: p.shape for name, p in model.named_parameters()} == shapes  # nothing released
    lines = [r for r in caplog.records if r.name == LOGGER]
    assert [r.getMessage() for r in lines] == ["weight prepacking unavailable (no avx512bw here); using plain F.linear"]
    _assert_equal("qwen2", plain, _logits(model))


def test_prepack_applies_only_to_bf16_on_cpu_and_can_be_turned_off(monkeypatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(
        cpu_prepack, "prepack_linear_weights", lambda model, batch_hint=64: calls.append(batch_hint) or 1
    )
    model = torch.nn.Linear(2, 2)
    assert maybe_prepack(model, CPU, torch.float32) == 0  # float32 keeps the exact HF path
    assert maybe_prepack(model, torch.device("meta"), torch.bfloat16) == 0
    monkeypatch.setenv("VLLM_LITE_PREPACK", "0")
    assert maybe_prepack(model, CPU, torch.bfloat16) == 0
    monkeypatch.setenv("VLLM_LITE_PREPACK", "1")
    assert maybe_prepack(model, CPU, torch.bfloat16, batch_hint=8) == 1
    assert calls == [8]
