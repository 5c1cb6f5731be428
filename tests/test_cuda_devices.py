"""CUDA device handling checked without a GPU: every device the worker uses carries an index, and
asking for more ranks than visible devices fails at config time naming both sizes."""

from __future__ import annotations

import pytest
import torch

from vllm_lite import platform
from vllm_lite.config import ParallelConfig
from vllm_lite.device_layout import verify_cuda_device_count
from vllm_lite.engine_args import EngineArgs
from vllm_lite.worker.gpu_worker import indexed_device
from vllm_lite.worker.parallel_state import nccl_device


def test_worker_device_always_carries_an_index() -> None:
    assert indexed_device(torch.device("cuda")) == torch.device("cuda", 0)
    assert indexed_device(torch.device("cuda"), local_rank=3) == torch.device("cuda", 3)
    assert indexed_device(torch.device("cuda:2"), local_rank=3) == torch.device("cuda", 2)
    assert indexed_device(torch.device("cpu")) == torch.device("cpu")


def test_nccl_rank_device_must_be_an_indexed_cuda_device() -> None:
    assert nccl_device(torch.device("cuda:1")) == torch.device("cuda", 1)
    with pytest.raises(ValueError, match="indexed CUDA device"):
        nccl_device(torch.device("cuda"))
    with pytest.raises(ValueError, match="indexed CUDA device"):
        nccl_device(torch.device("cpu"))


def test_more_ranks_than_devices_is_refused_naming_both_sizes() -> None:
    cuda = torch.device("cuda")
    verify_cuda_device_count(ParallelConfig(tensor_parallel_size=2, data_parallel_size=2), cuda, 4)
    with pytest.raises(
        ValueError, match=r"tensor_parallel_size=2 x data_parallel_size=2.*4 CUDA devices.*3 are visible"
    ):
        verify_cuda_device_count(ParallelConfig(tensor_parallel_size=2, data_parallel_size=2), cuda, 3)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=1 x data_parallel_size=1.*0 are visible"):
        verify_cuda_device_count(ParallelConfig(), cuda, 0)
    # Multi-node: each node holds tensor_parallel_size / nnodes ranks.
    two_nodes = ParallelConfig(tensor_parallel_size=4, nnodes=2, master_port=29500)
    verify_cuda_device_count(two_nodes, cuda, 2)
    with pytest.raises(ValueError, match="2 tensor-parallel ranks on each of 2 nodes"):
        verify_cuda_device_count(two_nodes, cuda, 1)
    with pytest.raises(ValueError, match="cuda:2 does not exist"):
        verify_cuda_device_count(ParallelConfig(), torch.device("cuda:2"), 2)


def test_engine_args_check_the_device_count_before_anything_starts(monkeypatch, tiny_checkpoint: str) -> None:
    monkeypatch.setattr(platform, "cuda_available", lambda: True)
    monkeypatch.setattr(platform, "cuda_device_count", lambda: 1)
    args = EngineArgs(model=tiny_checkpoint, device="cuda", dtype="float32", tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 x data_parallel_size=1.*1 is visible"):
        args.create_engine_config()
    args = EngineArgs(model=tiny_checkpoint, device="cuda", dtype="float32", data_parallel_size=2)
    with pytest.raises(ValueError, match=r"data_parallel_size=2"):
        args.create_engine_config()
    monkeypatch.setattr(platform, "cuda_device_count", lambda: 2)
    assert (
        EngineArgs(model=tiny_checkpoint, device="cuda", dtype="float32", tensor_parallel_size=2)
        .create_engine_config()
        .parallel_config.tensor_parallel_size
        == 2
    )
    # The CPU is never limited by a CUDA device count.
    monkeypatch.setattr(platform, "cuda_device_count", lambda: 0)
    EngineArgs(model=tiny_checkpoint, device="cpu", tensor_parallel_size=2).create_engine_config()
