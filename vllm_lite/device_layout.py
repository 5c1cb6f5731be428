"""Which CUDA devices each engine core and each tensor-parallel rank own on a node.

Data parallel x tensor parallel: DP rank ``r`` owns the ``tp`` devices
``[first + r*tp, first + (r+1)*tp)`` (``first``: the index of the device the user named,
0 for plain ``cuda``), and its TP rank ``local_rank`` runs on ``engine index + local_rank``.
Before, DP rank r took ``cuda:r`` and its TP ranks ``cuda:local_rank``, so with both > 1
engines shared devices (NCCL: "Duplicate GPU detected"). Also the check, before any process
starts, that a layout fits the visible devices. Pure functions of a device and counts, so the
layout is tested on a machine without CUDA.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from vllm_lite.config import ParallelConfig


def first_index(device: torch.device) -> int:
    """The index a CUDA device names; plain ``cuda`` means device 0 (torch's default current device)."""
    return device.index if device.index is not None else 0


def engine_device(base: torch.device, dp_rank: int, ranks_per_node: int) -> torch.device:
    """DP rank ``dp_rank``'s device: the first of its ``ranks_per_node`` devices after those of lower ranks.

    A non-CUDA device is returned as is (the CPU is shared, split by threads instead).
    """
    if dp_rank < 0 or ranks_per_node < 1:
        raise ValueError(f"dp_rank must be >= 0 and ranks_per_node >= 1, got {dp_rank}, {ranks_per_node}.")
    if base.type != "cuda":
        return base
    return torch.device("cuda", first_index(base) + dp_rank * ranks_per_node)


def tp_rank_device(engine: torch.device, local_rank: int, visible: int) -> torch.device:
    """The device of tensor-parallel rank ``local_rank`` of the engine on ``engine``: offset from its index.

    ``visible``: CUDA devices on this node; naming one past them is a clear error here rather
    than "invalid device ordinal" from CUDA later. A non-CUDA device is returned as is.
    """
    if local_rank < 0:
        raise ValueError(f"local_rank must be >= 0, got {local_rank}.")
    if engine.type != "cuda":
        return engine
    index = first_index(engine) + local_rank
    if index >= visible:
        raise ValueError(
            f"tensor-parallel rank {local_rank} of the engine on {engine} needs cuda:{index}, "
            f"but {visible} CUDA device(s) are visible."
        )
    return torch.device("cuda", index)


def check_engine_devices(device: torch.device, ranks_per_node: int, visible: int) -> None:
    """Refuse an engine whose devices ``[index, index + ranks_per_node)`` run past the visible ones."""
    first = first_index(device)
    last = first + ranks_per_node - 1
    if last < visible:
        return
    if ranks_per_node == 1:
        raise ValueError(f"device={device} does not exist: {visible} CUDA device(s) are visible.")
    raise ValueError(
        f"device={device} with {ranks_per_node} tensor-parallel ranks needs cuda:{first}..cuda:{last}; "
        f"cuda:{max(first, visible)} does not exist: {visible} CUDA device(s) are visible."
    )


def verify_cuda_device_count(pc: ParallelConfig, device: torch.device, visible: int) -> None:
    """Every rank on this node needs its own CUDA device: refuse more ranks than devices, before any
    process starts (NCCL would fail later with "Duplicate GPU detected" or "invalid device ordinal")."""
    tp, dp = pc.tensor_parallel_size, pc.data_parallel_size
    need = pc.ranks_per_node * dp
    if need > visible:
        where = f" ({pc.ranks_per_node} tensor-parallel ranks on each of {pc.nnodes} nodes)" if pc.nnodes > 1 else ""
        raise ValueError(
            f"tensor_parallel_size={tp} x data_parallel_size={dp} needs {need} CUDA devices on this node{where}, "
            f"but {visible} {'is' if visible == 1 else 'are'} visible. Lower tensor_parallel_size or "
            "data_parallel_size, or make more devices visible (CUDA_VISIBLE_DEVICES)."
        )
    check_engine_devices(device, pc.ranks_per_node, visible)  # this engine's TP ranks sit at index + local_rank
