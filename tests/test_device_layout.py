"""Data parallel x tensor parallel on CUDA: every engine and every rank gets a device of its own.

DP rank r owns cuda:[first + r*tp, first + (r+1)*tp); its TP rank k runs on the engine's index + k.
Pure functions, plus `create_dp_engine_configs` on a CPU-only host with the CUDA probe patched
(monkeypatch restores it), so no GPU is needed.
"""

from __future__ import annotations

import pytest
import torch

from vllm_lite import platform
from vllm_lite.device_layout import check_engine_devices, engine_device, tp_rank_device
from vllm_lite.engine_args import EngineArgs
from vllm_lite.testing.checkpoints import get_checkpoint

ENGINE_KW = {"dtype": "float32", "max_model_len": 64, "max_num_seqs": 4}


def all_rank_devices(base: torch.device, dp: int, tp: int, visible: int) -> list[list[int]]:
    """The device index of every TP rank of every DP engine, as the engine and its ranks compute them."""
    out = []
    for r in range(dp):
        engine = engine_device(base, r, tp)
        out.append([tp_rank_device(engine, k, visible).index for k in range(tp)])
    return out


@pytest.mark.parametrize("dp,tp", [(1, 1), (2, 1), (1, 2), (2, 2), (3, 2), (2, 4)])
def test_each_tp_rank_of_each_dp_engine_owns_a_distinct_device(dp, tp):
    layout = all_rank_devices(torch.device("cuda"), dp, tp, visible=dp * tp)
    assert layout == [list(range(r * tp, (r + 1) * tp)) for r in range(dp)]


def test_a_named_first_device_shifts_the_whole_layout():
    assert all_rank_devices(torch.device("cuda:2"), dp=2, tp=2, visible=6) == [[2, 3], [4, 5]]


def test_cpu_devices_are_shared_not_offset():
    cpu = torch.device("cpu")
    assert engine_device(cpu, 3, 2) == cpu
    assert tp_rank_device(cpu, 1, visible=0) == cpu


def test_a_rank_past_the_visible_devices_is_a_clear_error():
    with pytest.raises(ValueError, match="needs cuda:3, but 3 CUDA device"):
        tp_rank_device(torch.device("cuda:2"), 1, visible=3)
    with pytest.raises(ValueError, match=r"needs cuda:1\.\.cuda:2; cuda:2 does not exist"):
        check_engine_devices(torch.device("cuda:1"), 2, visible=2)
    check_engine_devices(torch.device("cuda:1"), 2, visible=3)  # fits exactly


@pytest.fixture
def four_cuda_devices(monkeypatch):
    """Pretend this host has 4 CUDA devices (for config validation only; nothing runs on them)."""
    monkeypatch.setattr(platform, "cuda_available", lambda: True)
    monkeypatch.setattr(platform, "cuda_device_count", lambda: 4)


@pytest.fixture(scope="module")
def ckpt() -> str:
    return get_checkpoint("llama")


def test_dp_engine_configs_place_engine_r_on_its_first_tp_device(ckpt, four_cuda_devices):
    configs = EngineArgs(
        model=ckpt, device="cuda", data_parallel_size=2, tensor_parallel_size=2, **ENGINE_KW
    ).create_dp_engine_configs()
    engines = [c.device_config.device for c in configs]
    assert engines == [torch.device("cuda", 0), torch.device("cuda", 2)]
    ranks = [[tp_rank_device(e, k, 4).index for k in range(2)] for e in engines]
    assert ranks == [[0, 1], [2, 3]]


def test_dp_engine_configs_refuse_more_ranks_than_devices(ckpt, four_cuda_devices):
    with pytest.raises(ValueError, match="needs 6 CUDA devices"):
        EngineArgs(
            model=ckpt, device="cuda", data_parallel_size=3, tensor_parallel_size=2, **ENGINE_KW
        ).create_dp_engine_configs()
    with pytest.raises(ValueError, match="needs cuda:4..cuda:5; cuda:4 does not exist"):  # engine 1, from cuda:2
        EngineArgs(
            model=ckpt, device="cuda:2", data_parallel_size=2, tensor_parallel_size=2, **ENGINE_KW
        ).create_dp_engine_configs()
