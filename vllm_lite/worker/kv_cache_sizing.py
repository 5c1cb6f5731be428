"""How many KV-cache blocks a worker allocates: the arithmetic, kept pure so it is tested anywhere.

On CUDA the budget follows vLLM: `gpu_memory_utilization` of the card's total memory, minus what
is in use once the weights are loaded (weights, CUDA context, anything else on the card), minus
the peak activation memory of a profiling forward pass at the largest step the scheduler can
build. `kv_cache_memory_bytes` overrides all of that; on CPU a fixed default applies.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

GiB = 1 << 30


def kv_budget_from_utilization(
    total_bytes: int,
    gpu_memory_utilization: float,
    in_use_bytes: int,
    peak_activation_bytes: int,
    free_bytes: Optional[int] = None,
) -> int:
    """Bytes left for the KV cache; ValueError (with the figures) when nothing is left.

    As in vLLM, gpu_memory_utilization is this instance's share of the card: ``in_use_bytes`` is what this
    process took (weights, buffers), not what other processes on the same GPU hold. ``free_bytes`` (the card's
    free memory now) also bounds the budget, so an instance never plans more than the card still has.
    """
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}.")
    allowed = int(total_bytes * gpu_memory_utilization)
    budget = allowed - in_use_bytes - peak_activation_bytes
    if free_bytes is not None:
        budget = min(budget, free_bytes - peak_activation_bytes)
    if budget <= 0:
        free = "" if free_bytes is None else f", {free_bytes / GiB:.2f} GiB of the card is free"
        raise ValueError(
            f"No memory left for the KV cache: gpu_memory_utilization={gpu_memory_utilization} of "
            f"{total_bytes / GiB:.2f} GiB allows {allowed / GiB:.2f} GiB, but {in_use_bytes / GiB:.2f} GiB "
            f"is in use after loading the weights and the profiling pass peaked at "
            f"{peak_activation_bytes / GiB:.2f} GiB of activations{free}. Raise gpu_memory_utilization, "
            "lower max_num_batched_tokens or max_num_seqs, or use a smaller model."
        )
    return budget


def blocks_per_seq(
    block_size: int, max_model_len: int, sliding_window: Optional[int] = None, max_step_tokens: Optional[int] = None
) -> int:
    """Blocks one sequence can hold at once.

    Without a window: all of max_model_len. With a uniform sliding window W (every layer windowed, so the
    KV manager frees blocks wholly behind the window before each step), only the keys a step's queries can
    see: W - 1 tokens before its first new token plus the step's own `max_step_tokens`, which may start
    mid-block (+1). That bound is what lets a windowed model serve requests longer than its cache holds.
    """
    full = -(-max_model_len // block_size)
    if sliding_window is None or max_step_tokens is None:
        return full
    return min(full, -(-(sliding_window - 1 + max_step_tokens) // block_size) + 1)


def num_kv_blocks(
    budget_bytes: int,
    bytes_per_block: int,
    block_size: int,
    max_model_len: int,
    max_num_seqs: int,
    per_seq: Optional[int] = None,
) -> int:
    """Blocks that fit the budget, capped at what can ever be used (every sequence at its most blocks,
    plus the null block); ValueError when one max_model_len sequence would not fit.

    `per_seq`: blocks one sequence can hold at once (`blocks_per_seq`; default all of max_model_len)."""
    if bytes_per_block <= 0:
        raise ValueError(f"bytes_per_block must be positive, got {bytes_per_block!r}.")
    per_seq = blocks_per_seq(block_size, max_model_len) if per_seq is None else per_seq
    useful = per_seq * max_num_seqs + 1  # +1: the null block
    fit = max(budget_bytes, 0) // bytes_per_block
    if fit < per_seq + 1:
        need = (per_seq + 1) * bytes_per_block
        raise ValueError(
            f"KV cache too small: {budget_bytes} bytes hold {fit} blocks of {block_size} tokens, "
            f"but one max_model_len={max_model_len} sequence needs {per_seq + 1} blocks "
            f"({need} bytes). Raise kv_cache_memory_bytes or gpu_memory_utilization, or lower max_model_len."
        )
    return int(min(fit, useful))


def override_num_blocks(override: int, block_size: int, max_model_len: int, per_seq: Optional[int] = None) -> int:
    """vLLM's num_gpu_blocks_override, checked: exactly `override` blocks, or a ValueError when they cannot hold
    one max_model_len sequence (plus the null block) or the value is not a positive integer."""
    if isinstance(override, bool) or not isinstance(override, int) or override < 1:
        raise ValueError(f"num_gpu_blocks_override must be a positive integer, got {override!r}.")
    per_seq = blocks_per_seq(block_size, max_model_len) if per_seq is None else per_seq
    if override < per_seq + 1:
        raise ValueError(
            f"num_gpu_blocks_override={override} is too small: one max_model_len={max_model_len} sequence needs "
            f"{per_seq + 1} blocks of {block_size} tokens (the null block included). Raise "
            "num_gpu_blocks_override or lower max_model_len."
        )
    return override


def max_concurrency(num_blocks: int, block_size: int, max_model_len: int, per_seq: Optional[int] = None) -> float:
    """How many max_model_len sequences the cache holds at once: its tokens / max_model_len, or under a
    sliding window (`per_seq` below a full sequence's blocks) its blocks / the blocks one sequence holds."""
    if per_seq is not None and per_seq < -(-max_model_len // block_size):
        return num_blocks / per_seq
    return block_size * num_blocks / max_model_len


def describe_kv_cache(
    num_blocks: int, bytes_per_block: int, block_size: int, max_model_len: int, per_seq: Optional[int] = None
) -> str:
    """The one log line that reports the cache size."""
    return (
        f"KV cache: {num_blocks} blocks of {block_size} tokens ({num_blocks * bytes_per_block / GiB:.2f} GiB); "
        f"maximum concurrency at max_model_len={max_model_len}: "
        f"{max_concurrency(num_blocks, block_size, max_model_len, per_seq):.2f}x"
    )


@dataclass
class PeakMemory:
    """What a profiled region allocated on a CUDA device beyond what was held when it began."""

    peak_bytes: int = 0


@contextlib.contextmanager
def measure_peak_allocated(device: torch.device) -> Iterator[PeakMemory]:
    """Peak of torch's allocator inside the block, less the bytes allocated at entry (0 off CUDA)."""
    result = PeakMemory()
    if device.type != "cuda":
        yield result
        return
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    baseline = torch.cuda.memory_allocated(device)
    yield result
    torch.cuda.synchronize(device)
    result.peak_bytes = max(0, torch.cuda.max_memory_allocated(device) - baseline)
