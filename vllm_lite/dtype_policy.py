"""Which dtype the model computes in: the checkpoint's, the user's, and what this hardware does fast.

`choose_dtype` is the policy as a pure function of its inputs and a `HostFacts` (so it can be
tested for any host); `resolve_dtype` applies it to this machine and logs the reason once.

- CPU without native bf16 (no AVX-512 BF16/AMX, e.g. AVX2-only Zen 3): a bf16 matmul runs ~6x
  slower than float32 there, so ``auto`` computes bfloat16 and float16 checkpoints in float32.
- CPU with native bf16, and CUDA: ``auto`` runs a float32 checkpoint in bfloat16 (float16 on
  GPUs without bf16), as vLLM downcasts; 16-bit checkpoints keep their dtype.
- float16 becomes bfloat16 on CPU (float16 matmuls crawl there).
- An explicit dtype is obeyed; a warning says when it will be slow on this host.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch

from vllm_lite import platform
from vllm_lite.platform import HostFacts

logger = logging.getLogger(__name__)

STR_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}

_SLOW_BF16 = "bfloat16 matmuls run ~6x slower than float32 on a CPU without AVX-512 BF16/AMX"


@dataclass(frozen=True)
class DtypeChoice:
    """The dtype to compute in, and the one log line that explains it (a warning when it is slow)."""

    dtype: torch.dtype
    message: Optional[str] = None
    warn: bool = False


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _checkpoint_dtype(config_dtype: Optional[str]) -> torch.dtype:
    """The checkpoint's dtype from config.json (float32 when it names none or one we do not know)."""
    if not config_dtype:
        return torch.float32
    return STR_DTYPES.get(str(config_dtype).replace("torch.", ""), torch.float32)


def _requested(dtype: str | torch.dtype) -> Optional[torch.dtype]:
    """The explicit dtype asked for; None for 'auto'."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return None
    if dtype in STR_DTYPES:
        return STR_DTYPES[dtype]
    raise ValueError(f"dtype must be one of 'auto', {sorted(STR_DTYPES)}, got {dtype!r}.")


def _auto(ckpt: torch.dtype, device: torch.device, host: HostFacts) -> DtypeChoice:
    if device.type == "cpu":
        if not host.cpu_native_bf16:
            if ckpt in (torch.bfloat16, torch.float16):
                return DtypeChoice(
                    torch.float32,
                    (
                        f"dtype=auto: the {_name(ckpt)} checkpoint computes in float32 on {host.cpu_name} "
                        f"({_SLOW_BF16}); pass dtype='bfloat16' to keep 16-bit weights."
                    ),
                )
            return DtypeChoice(ckpt)
        if ckpt in (torch.float32, torch.float16):
            return DtypeChoice(
                torch.bfloat16,
                (
                    f"dtype=auto: the {_name(ckpt)} checkpoint computes in bfloat16, native on {host.cpu_name} "
                    "(as vLLM downcasts); pass dtype='float32' for exact float32."
                ),
            )
        return DtypeChoice(ckpt)
    if device.type == "cuda":
        half = torch.bfloat16 if host.cuda_bf16 else torch.float16
        if ckpt == torch.float32 or (ckpt == torch.bfloat16 and not host.cuda_bf16):
            return DtypeChoice(
                half,
                (
                    f"dtype=auto: the {_name(ckpt)} checkpoint computes in {_name(half)} on this GPU "
                    "(as vLLM downcasts); pass dtype='float32' for exact float32."
                ),
            )
        return DtypeChoice(ckpt)
    return DtypeChoice(ckpt)


def _explicit(want: torch.dtype, device: torch.device, host: HostFacts) -> DtypeChoice:
    if device.type == "cpu":
        if want == torch.float16:
            slow = "" if host.cpu_native_bf16 else f"; {_SLOW_BF16}: dtype='float32' is faster here"
            return DtypeChoice(
                torch.bfloat16,
                (f"dtype=float16 computes in bfloat16 on CPU (float16 matmuls crawl there){slow}."),
                warn=True,
            )
        if want == torch.bfloat16 and not host.cpu_native_bf16:
            return DtypeChoice(
                torch.bfloat16,
                (f"dtype=bfloat16 on {host.cpu_name}: {_SLOW_BF16}; dtype='auto' or 'float32' is faster here."),
                warn=True,
            )
    if device.type == "cuda" and want == torch.bfloat16 and not host.cuda_bf16:
        return DtypeChoice(
            want, "dtype=bfloat16 on a GPU without native bf16 will be slow; 'float16' is faster.", warn=True
        )
    return DtypeChoice(want)


def choose_dtype(
    dtype: str | torch.dtype, config_dtype: Optional[str], device: torch.device, host: HostFacts
) -> DtypeChoice:
    """The policy above for a host described by `host` (pure: no probing, no logging)."""
    want = _requested(dtype)
    if want is None:
        return _auto(_checkpoint_dtype(config_dtype), device, host)
    return _explicit(want, device, host)


_announced: set[str] = set()


def resolve_dtype(dtype: str | torch.dtype, config_dtype: Optional[str], device: torch.device) -> torch.dtype:
    """`choose_dtype` on this machine; its reason is logged once per process (configs are built repeatedly)."""
    choice = choose_dtype(dtype, config_dtype, device, platform.host_facts())
    if choice.message and choice.message not in _announced:
        _announced.add(choice.message)
        logger.log(logging.WARNING if choice.warn else logging.INFO, choice.message)
    return choice.dtype
