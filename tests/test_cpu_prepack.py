"""oneDNN-prepacked bfloat16 weights give bit-identical logits to plain F.linear."""

from __future__ import annotations

import torch

from vllm_lite.config import EngineArgs
from vllm_lite.testing.checkpoints import get_checkpoint
from vllm_lite.testing.paged import PagedModelDriver
from vllm_lite.worker.attention.torch_ref import TorchRefBackend
from vllm_lite.worker.model_loader import load_model
from vllm_lite.worker.models.cpu_prepack import can_prepack, prepack_linear_weights


def _logits(arch: str, prepack: bool) -> tuple[list[torch.Tensor], int]:
    cfg = EngineArgs(model=get_checkpoint(arch), dtype="bfloat16", device="cpu").create_engine_config()
    model = load_model(cfg.model_config, torch.device("cpu"))
    n = prepack_linear_weights(model) if prepack else 0
    prompts = [[5 + i for i in range(17)], [40 + 2 * i for i in range(9)]]
    driver = PagedModelDriver(model, prompts, block_size=4, backend=TorchRefBackend(), dtype=torch.bfloat16)
    out = driver.step([10, 9])  # a prefill chunk and a whole prompt
    out += driver.step([7, 0])  # the rest of the first prompt, second idle
    return out, n


def test_prepacked_bf16_logits_equal_plain_linear_exactly() -> None:
    assert can_prepack(torch.device("cpu"), torch.bfloat16)
    assert not can_prepack(torch.device("cpu"), torch.float32)  # float32 keeps the exact HF path
    for arch in ("qwen2", "opt"):  # tied head; OPT's unpacked project_in/out stay plain nn.Linear
        plain, _ = _logits(arch, prepack=False)
        packed, n = _logits(arch, prepack=True)
        assert n > 0, "nothing was prepacked"
        for a, b in zip(plain, packed):
            assert torch.equal(a, b), f"{arch}: prepacked logits differ by {(a - b).abs().max().item()}"
