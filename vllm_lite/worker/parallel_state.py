"""Tensor-parallel process state: thin wrappers over torch.distributed.

Model layers ask `get_tp_size()`/`get_tp_rank()` while they are built and call
the collectives below in forward. With no process group (TP=1, the default)
the size is 1 and every collective returns its input untouched, so a
single-device engine pays nothing for tensor parallelism.
"""

from __future__ import annotations

import datetime
import logging
from typing import Optional

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

_TP_RANK = 0
_TP_SIZE = 1


def default_backend(device: torch.device) -> str:
    """NCCL for CUDA tensors, gloo for CPU ones."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_distributed(
    world_size: int,
    rank: int,
    store: dist.Store,
    backend: str = "gloo",
    timeout_s: float = 600.0,
    device: Optional[torch.device] = None,
) -> None:
    """Join the tensor-parallel group (one group: TP is the whole world) through a rendezvous store.

    The store is a torch.distributed TCPStore client (or any Store): every rank
    must pass one connected to the same server. Under NCCL the group is bound to
    this rank's CUDA device (`device`, else the current one), which must carry an
    index: NCCL guesses the device from the global rank otherwise, wrong off node 0.
    """
    global _TP_RANK, _TP_SIZE
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}.")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}.")
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process.")
    device_id = nccl_device(device) if backend == "nccl" else None
    if device_id is not None:
        torch.cuda.set_device(device_id)
    dist.init_process_group(
        backend=backend,
        store=store,
        world_size=world_size,
        rank=rank,
        timeout=datetime.timedelta(seconds=timeout_s),
        device_id=device_id,
    )
    _TP_RANK, _TP_SIZE = rank, world_size
    logger.info(
        "rank %d/%d joined the %s tensor-parallel group%s",
        rank,
        world_size,
        backend,
        f" on {device_id}" if device_id is not None else "",
    )


def nccl_device(device: Optional[torch.device]) -> torch.device:
    """The indexed CUDA device an NCCL rank binds to: `device` if given, else the current CUDA device."""
    if device is None:
        return torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device)
    if device.type != "cuda" or device.index is None:
        raise ValueError(f"an NCCL rank needs an indexed CUDA device (cuda:N), got {device}.")
    return device


def destroy_distributed() -> None:
    global _TP_RANK, _TP_SIZE
    if dist.is_initialized():
        dist.destroy_process_group()
    _TP_RANK, _TP_SIZE = 0, 1


def set_tp_state_for_testing(rank: int, size: int) -> None:
    """Pretend to be rank `rank` of `size` without a process group (for building/loading shards in tests)."""
    global _TP_RANK, _TP_SIZE
    if not 0 <= rank < size:
        raise ValueError(f"rank must be in [0, {size}), got {rank!r}.")
    _TP_RANK, _TP_SIZE = rank, size


def get_tp_rank() -> int:
    return _TP_RANK


def get_tp_size() -> int:
    return _TP_SIZE


def is_driver() -> bool:
    """Rank 0 samples and reports results to the engine core."""
    return _TP_RANK == 0


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum x over the ranks (in place when there is more than one); identity at TP=1."""
    if _TP_SIZE == 1:
        return x
    dist.all_reduce(x)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's x along dim (rank order); identity at TP=1."""
    if _TP_SIZE == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_TP_SIZE)]
    dist.all_gather(parts, x)
    return torch.cat(parts, dim=dim)


def broadcast_from_driver(
    x: Optional[torch.Tensor], shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Rank 0's x on every rank (other ranks pass None and the expected shape/dtype); identity at TP=1."""
    if _TP_SIZE == 1:
        assert x is not None
        return x
    if _TP_RANK == 0:
        assert x is not None
        buf = x.to(device=device, dtype=dtype).contiguous()
    else:
        buf = torch.empty(shape, dtype=dtype, device=device)
    dist.broadcast(buf, src=0)
    return buf
