"""One step's flattened model inputs, built from the persistent batch with numpy.

Scheduled requests are laid out in batch-row order; request i owns tokens
query_start_loc[i]:query_start_loc[i+1]. Everything is computed on the host in
a few vectorised ops, then copied to the device once (`to_device`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

from vllm_lite.worker.attention.backend import AttentionMetadata
from vllm_lite.worker.input_batch import InputBatch


@dataclass
class StepInputs:
    """Host-side (numpy) inputs of one forward pass."""

    req_ids: list[str]  # scheduled requests, in batch-row order
    rows: np.ndarray  # int64 [B] their batch rows, ascending
    num_scheduled: np.ndarray  # int64 [B] tokens run this step
    query_start_loc: np.ndarray  # int64 [B+1]
    num_computed: np.ndarray  # int64 [B] tokens already in the KV cache before this step
    seq_lens: np.ndarray  # int64 [B] tokens in the KV cache after this step
    input_ids: np.ndarray  # int64 [T]
    positions: np.ndarray  # int64 [T]
    slot_mapping: np.ndarray  # int64 [T]
    block_table: np.ndarray  # int32 [B, max blocks any scheduled request needs]
    req_num_tokens: Optional[np.ndarray] = None  # int64 [B] each request's known tokens (prompt + outputs so far)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    def sampling_mask(self, num_tokens_known: np.ndarray) -> np.ndarray:
        """bool [B]: rows whose known tokens are all computed after this step, so they sample one more."""
        return self.seq_lens >= num_tokens_known

    def to_device(
        self, device: torch.device, stage: Optional[Callable[[np.ndarray], torch.Tensor]] = None
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(input_ids, positions, attention metadata) on the device, each copied once, asynchronously.

        `stage` (async scheduling on CUDA: PinnedRing.stage) copies through pinned memory, so no copy waits for
        the step still running; None copies from the arrays themselves, as ever."""
        qsl_cpu = torch.from_numpy(self.query_start_loc.astype(np.int32))
        seq_cpu = torch.from_numpy(self.seq_lens.astype(np.int32))
        if stage is None and device.type == "cpu":  # the arrays themselves, as `.to(cpu)` returns them
            stage = torch.from_numpy
            qsl_dev, seq_dev = qsl_cpu, seq_cpu
        elif stage is None:

            def stage(arr: np.ndarray) -> torch.Tensor:
                return torch.from_numpy(arr).to(device, non_blocking=True)

            qsl_dev, seq_dev = qsl_cpu.to(device, non_blocking=True), seq_cpu.to(device, non_blocking=True)
        else:
            qsl_dev, seq_dev = stage(qsl_cpu.numpy()), stage(seq_cpu.numpy())
        md = AttentionMetadata(
            num_actual_tokens=self.num_tokens,
            num_reqs=self.num_reqs,
            max_query_len=int(self.num_scheduled.max()),
            max_seq_len=int(self.seq_lens.max()),
            query_start_loc=qsl_dev,
            seq_lens=seq_dev,
            block_table=stage(np.ascontiguousarray(self.block_table)),
            slot_mapping=stage(self.slot_mapping),
            query_start_loc_cpu=qsl_cpu,
            seq_lens_cpu=seq_cpu,
            num_tokens=None if self.req_num_tokens is None else stage(self.req_num_tokens.astype(np.int32)),
        )
        input_ids = stage(self.input_ids)
        positions = stage(self.positions)
        return input_ids, positions, md


def build_step_inputs(
    batch: InputBatch, num_scheduled_tokens: dict[str, int], block_size: int, arange: np.ndarray
) -> StepInputs:
    """Flatten the scheduled requests' tokens; `arange` is a reused 0..N int64 buffer (N >= tokens)."""
    req_ids = list(num_scheduled_tokens)
    n = len(req_ids)
    rows = batch.rows_of(req_ids)
    num_sched = np.fromiter(num_scheduled_tokens.values(), dtype=np.int64, count=n)
    if n > 1 and not bool((rows[1:] > rows[:-1]).all()):  # already in row order (as after condensing): kept
        order = np.argsort(rows, kind="stable")
        rows = rows[order]
        num_sched = num_sched[order]
        req_ids = [req_ids[i] for i in order.tolist()]
    computed = batch.num_computed_tokens[rows]
    decode = bool((num_sched == 1).all())  # one token a request (n = 0 too): one comparison, not sum + min
    total = n if decode else int(num_sched.sum())
    if decode:  # no repeats
        cu = arange[: n + 1].copy()
        positions = computed.copy()
        tok_rows = rows
    else:
        cu = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(num_sched, out=cu[1:])
        # Position of every token: its request's computed count + its offset within this step.
        req_of_tok = np.repeat(np.arange(n), num_sched)
        positions = computed[req_of_tok] + arange[:total] - np.repeat(cu[:-1], num_sched)
        tok_rows = rows[req_of_tok]
    block_idx = batch.block_table[tok_rows, positions // block_size].astype(np.int64)
    seq_lens = computed + num_sched
    max_blocks = -(-int(seq_lens.max()) // block_size)  # Python ints: numpy scalar math is slower
    return StepInputs(
        req_ids=req_ids,
        rows=rows,
        num_scheduled=num_sched,
        query_start_loc=cu,
        num_computed=computed,
        seq_lens=seq_lens,
        input_ids=batch.token_ids[tok_rows, positions],
        positions=positions,
        slot_mapping=block_idx * block_size + positions % block_size,
        block_table=batch.block_table[rows, :max_blocks],
        req_num_tokens=batch.num_tokens[rows],
    )
