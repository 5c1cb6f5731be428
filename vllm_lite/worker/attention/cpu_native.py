"""Attention backend for CPU that runs the native C++ kernels (torch.ops.vllm_lite.*)."""

from __future__ import annotations

import logging
from typing import Optional

import torch

from vllm_lite import envs
from vllm_lite.worker.attention.backend import AttentionBackend, AttentionMetadata
from vllm_lite.worker.attention.cpu_kernels import ATTENTION_IMPLS, load_cpu_ops

logger = logging.getLogger(__name__)


def _check_cpu(t: torch.Tensor, name: str) -> None:
    if t.device.type != "cpu":
        raise ValueError(f"CpuNativeBackend needs CPU tensors; {name} is on {t.device}.")


class CpuNativeBackend(AttentionBackend):
    """Paged attention, KV writes and block copies in OpenMP C++ (float32 / bfloat16)."""

    name = "cpu"

    def __init__(self, impl: Optional[str] = None) -> None:
        """impl: which key loop to ask for ("auto", "avx512", "avx2", "portable"); None reads
        VLLM_LITE_CPU_ATTENTION_IMPL (default "auto": the fastest one built for this CPU)."""
        impl = impl if impl is not None else (envs.VLLM_LITE_CPU_ATTENTION_IMPL or "auto")
        if impl not in ATTENTION_IMPLS:
            raise ValueError(f"impl must be one of {ATTENTION_IMPLS}, got {impl!r}")
        if not load_cpu_ops():
            raise RuntimeError("vllm-lite CPU kernels could not be built or loaded; use the torch backend.")
        self._ops = torch.ops.vllm_lite
        built = self.built_impls()
        if impl not in ("auto", *built):
            raise ValueError(f"impl={impl!r} is not built for this CPU; built here: {built}")
        self.impl = impl
        self._announced: set[tuple[int, bool]] = set()
        # The step's kernel arguments, reused by every layer of the step (_step_args).
        self._step: Optional[tuple] = None

    def built_impls(self) -> list[str]:
        """The key loops built into the loaded kernels for this CPU, fastest first."""
        return list(self._ops.attention_impls())

    def key_loop(self, head_size: int, logits_soft_cap: Optional[float] = None) -> str:
        """The key loop ("avx512", "avx2" or "portable") that forward runs for this head size."""
        return str(self._ops.paged_attention_impl(int(head_size), float(logits_soft_cap or 0.0), self.impl))

    def announce(self, head_size: int, logits_soft_cap: Optional[float]) -> None:
        """Logs, once per head size and soft-cap setting, which key loop the kernel runs (forward does this; a
        caller that runs the kernel itself, csrc's cpu_decoder_layers, calls it)."""
        self._announce(head_size, logits_soft_cap)

    def _announce(self, head_size: int, logits_soft_cap: Optional[float]) -> None:
        key = (head_size, bool(logits_soft_cap))
        if key in self._announced:
            return
        self._announced.add(key)
        logger.info(
            "CPU paged attention: %s key loop (head size %d%s, impl=%s)",
            self.key_loop(head_size, logits_soft_cap),
            head_size,
            ", soft-capped" if logits_soft_cap else "",
            self.impl,
        )

    def step_args(self, md: AttentionMetadata, n: int) -> tuple[torch.Tensor, ...]:
        """(block_table, seq_lens, query_start_loc, slots int64) for `n` tokens, as forward and write_kv_step pass
        them to the kernels (built once a step: _step_args)."""
        return self._step_args(md, n)

    def _step_args(self, md: AttentionMetadata, n: int) -> tuple[torch.Tensor, ...]:
        """(block_table, seq_lens, query_start_loc, slots): the batch's rows of the metadata as the kernels take
        them, for `n` tokens. Built once a step and reused by every layer when they are views of the metadata's
        own tensors (the usual case: no dtype change or copy), which saves ~19 us of Python a layer (12-layer
        decode step: ~0.2 ms). Keyed on the metadata object and its tensors (held, so no id is reused), and the
        counts; anything else (a copy, another object) is rebuilt, so a stale argument is never passed."""
        b = md.num_reqs
        c = self._step
        if (
            c is not None
            and c[0] is md
            and c[1] is md.block_table
            and c[2] is md.seq_lens
            and c[3] is md.query_start_loc
            and c[4] is md.slot_mapping
            and c[5] == (b, n)
        ):
            return c[6]
        slots = md.slot_mapping[:n]
        if slots.dtype != torch.int64:
            slots = slots.to(torch.int64)
        args = (
            md.block_table[:b].contiguous(),
            md.seq_lens[:b].contiguous(),
            md.query_start_loc[: b + 1].contiguous(),
            slots.contiguous(),
        )
        views = (md.block_table, md.seq_lens, md.query_start_loc, md.slot_mapping)
        if all(a.untyped_storage().data_ptr() == v.untyped_storage().data_ptr() for a, v in zip(args, views)):
            self._step = (md, *views, (b, n), args)
        else:
            self._step = None
        return args

    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        _check_cpu(kv_cache, "kv_cache")
        n = key.shape[0]
        slots = slot_mapping[:n]
        if slots.dtype != torch.int64:
            slots = slots.to(torch.int64)
        self._write_kv(key, value, kv_cache, slots.contiguous())

    def _write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor) -> None:
        if key.dtype != kv_cache.dtype:
            key, value = key.to(kv_cache.dtype), value.to(kv_cache.dtype)
        self._ops.write_kv(_rows_contiguous(key), _rows_contiguous(value), kv_cache, slots)

    def write_kv_step(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata
    ) -> None:
        """write_kv of the step's tokens, at the slots metadata.slot_mapping gives (the step's arguments reused)."""
        _check_cpu(kv_cache, "kv_cache")
        self._write_kv(key, value, kv_cache, self._step_args(metadata, key.shape[0])[3])

    def forward(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: Optional[int] = None,
        logits_soft_cap: Optional[float] = None,
    ) -> torch.Tensor:
        _check_cpu(kv_cache, "kv_cache")
        n = query.shape[0]
        q = query if query.stride(-1) == 1 else query.contiguous()
        out = torch.empty(n, q.shape[1], q.shape[2], dtype=q.dtype, device=q.device)
        if (q.shape[2], bool(logits_soft_cap)) not in self._announced:
            self._announce(q.shape[2], logits_soft_cap)
        block_table, seq_lens, query_start_loc, _ = self._step_args(metadata, metadata.num_actual_tokens)
        self._ops.paged_attention(
            out,
            q,
            kv_cache,
            block_table,
            seq_lens,
            query_start_loc,
            float(scale),
            int(sliding_window or 0),
            float(logits_soft_cap or 0.0),
            self.impl,
        )
        return out

    def copy_blocks(self, kv_caches: list[torch.Tensor] | torch.Tensor, src_to_dst: torch.Tensor) -> None:
        caches = [kv_caches] if isinstance(kv_caches, torch.Tensor) else list(kv_caches)
        if src_to_dst.numel() == 0 or not caches:
            return
        if any(c.device.type != "cpu" for c in caches):
            return super().copy_blocks(caches, src_to_dst)
        self._ops.copy_blocks(caches, _pairs(src_to_dst))

    def swap_blocks(
        self,
        src_caches: list[torch.Tensor] | torch.Tensor,
        dst_caches: list[torch.Tensor] | torch.Tensor,
        src_to_dst: torch.Tensor,
    ) -> None:
        srcs = [src_caches] if isinstance(src_caches, torch.Tensor) else list(src_caches)
        dsts = [dst_caches] if isinstance(dst_caches, torch.Tensor) else list(dst_caches)
        if len(srcs) != len(dsts):
            raise ValueError(f"swap_blocks got {len(srcs)} source caches but {len(dsts)} destination caches.")
        if src_to_dst.numel() == 0:
            return
        if any(c.device.type != "cpu" for c in srcs + dsts):
            # Host <-> accelerator moves are plain tensor copies; the native op is CPU-only.
            return super().swap_blocks(srcs, dsts, src_to_dst)
        pairs = _pairs(src_to_dst)
        for s, d in zip(srcs, dsts):
            self._ops.swap_blocks(s, d, pairs)


def _rows_contiguous(t: torch.Tensor) -> torch.Tensor:
    """The kernel accepts any row stride but needs each [KVH, D] row packed."""
    if t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2]:
        return t
    return t.contiguous()


def _pairs(src_to_dst: torch.Tensor) -> torch.Tensor:
    return src_to_dst.to(device="cpu", dtype=torch.int64).contiguous()
