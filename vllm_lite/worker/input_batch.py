"""The worker's persistent batch: one row per live request, kept across steps.

Rows are updated in place from the scheduler's diff; removing a request moves
the last row into its hole (condensing) so rows 0..num_reqs-1 stay dense. Token
ids, block tables and progress live in numpy arrays so building a step's inputs
is a handful of vectorised numpy ops and one copy to the device.

The batch also owns the rows' sampling state (`SamplingState`): adding,
removing, condensing and recording sampled tokens happen here, in one place,
so the token rows and the sampler's rows can never drift apart.
"""

from __future__ import annotations

from itertools import compress
from typing import Optional

import numpy as np
import torch

from vllm_lite.sampling_params import SamplingParams
from vllm_lite.worker.sampling_metadata import SamplingMetadata
from vllm_lite.worker.sampling_state import SamplingState
from vllm_lite.worker.step import NewRequestData

# Async scheduling: a token sampled by a step whose ids are not on the host yet (its row's slot in token_ids).
PLACEHOLDER_TOKEN = -1
# update_requests appends one new block each for this many requests or more in one numpy write (fewer: a loop).
_VECTOR_APPEND = 4
# Steps whose tokens may be pending at once (the engine keeps at most two in flight): pending_pos's columns.
PENDING_STEPS = 2

# Per-row scalars that move with a row when the batch condenses.
_ROW_SCALARS = ("num_tokens", "num_prompt_tokens", "num_computed_tokens", "num_blocks", "lora_ids")


class InputBatch:
    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        max_blocks_per_req: int,
        vocab_size: int,
        device: torch.device,
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.max_blocks_per_req = max_blocks_per_req
        self.req_ids: list[Optional[str]] = [None] * max_num_reqs
        self.req_id_to_row: dict[str, int] = {}
        self.params: list[Optional[SamplingParams]] = [None] * max_num_reqs
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        self.lora_ids = np.zeros(max_num_reqs, dtype=np.int64)  # each row's LoRA adapter id (0: none)
        self.sampling = SamplingState(max_num_reqs, vocab_size, max_model_len, device)
        # Async scheduling: pending_pos[row, step % 2] = the position of the row's token sampled by that launched
        # step while it is still on its way to the host (token_ids holds PLACEHOLDER_TOKEN there); -1: none.
        self.pending_pos = np.full((max_num_reqs, PENDING_STEPS), -1, dtype=np.int64)
        # pending_idx[row, step % 2]: that token's index in the launched step's sampled tensor (where the next step
        # reads it on the device, and where its value lands on the host); -1 where pending_pos is.
        self.pending_idx = np.full((max_num_reqs, PENDING_STEPS), -1, dtype=np.int64)
        self._arange = np.arange(max_num_reqs, dtype=np.int64)  # pending_idx's values: 0 .. rows sampled - 1
        # Requests in the batch whose parameters ask for prompt logprobs (the runner skips that work at 0).
        self.num_prompt_logprob_reqs = 0
        # rows_of's last answer: (version, request ids, rows); `_version` counts removals (the only change that
        # takes an id away or moves one: condensing).
        self._version = 0
        self._rows_cache: Optional[tuple[int, list[str], np.ndarray]] = None

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_row)

    # ------------------------------------------------------------------ the scheduler's diff
    def add_request(self, new: NewRequestData) -> int:
        """Put a request (new, or re-sent after preemption) in the first free row; returns the row.

        Raises ValueError for a request whose sampling parameters cannot run here; the batch
        is then unchanged.
        """
        req_id = new.req_id
        if req_id in self.req_id_to_row:
            raise ValueError(f"request {req_id!r} is already in the batch")
        row = self.num_reqs
        if row >= self.max_num_reqs:
            raise RuntimeError(f"persistent batch is full ({self.max_num_reqs} rows)")
        n_prompt, n_out = len(new.prompt_token_ids), len(new.output_token_ids)
        if n_prompt + n_out > self.max_model_len:
            raise ValueError(f"request {req_id!r} holds {n_prompt + n_out} tokens > max_model_len={self.max_model_len}")
        if len(new.block_ids) > self.max_blocks_per_req:
            raise RuntimeError(
                f"request {req_id!r} would hold {len(new.block_ids)} blocks > max {self.max_blocks_per_req}"
            )
        try:  # first, since it validates the parameters
            self.sampling.add_request(
                row, new.sampling_params, new.prompt_token_ids, new.output_token_ids, new.eos_token_id
            )
        except BaseException:
            self.sampling.remove_request(row)
            raise
        self.req_ids[row] = req_id
        self.req_id_to_row[req_id] = row
        self.params[row] = new.sampling_params
        self.num_prompt_logprob_reqs += _wants_prompt_logprobs(new.sampling_params)
        self.token_ids[row, :n_prompt] = new.prompt_token_ids
        self.token_ids[row, n_prompt : n_prompt + n_out] = new.output_token_ids
        self.num_prompt_tokens[row] = n_prompt
        self.num_tokens[row] = n_prompt + n_out
        self.num_computed_tokens[row] = new.num_computed_tokens
        self.num_blocks[row] = 0
        self.lora_ids[row] = new.lora_request.lora_int_id if new.lora_request is not None else 0
        self.pending_pos[row] = -1  # a (re-)added request comes with every token known
        self.pending_idx[row] = -1
        self.append_block_ids(row, new.block_ids)
        return row

    def update_request(self, req_id: str, new_block_ids: list[int], num_computed_tokens: int) -> None:
        """A request already in the batch: its newly allocated blocks and the scheduler's progress."""
        row = self.req_id_to_row[req_id]
        self.append_block_ids(row, new_block_ids)
        self.num_computed_tokens[row] = num_computed_tokens

    def update_requests(
        self, req_ids: list[str], new_block_ids: list[list[int]], num_computed_tokens: list[int]
    ) -> None:
        """`update_request` for many requests at once: the progress in one numpy write, blocks where any came."""
        if len(req_ids) != len(new_block_ids) or len(req_ids) != len(num_computed_tokens):
            # zip's truncation, as the one-at-a-time loop had it
            k = min(len(req_ids), len(new_block_ids), len(num_computed_tokens))
            req_ids, new_block_ids, num_computed_tokens = req_ids[:k], new_block_ids[:k], num_computed_tokens[:k]
        if not req_ids:
            return
        rows = self.rows_of(req_ids)
        # A decode step gives a new block to about one request in block_size: find those in C (compress tests
        # each list's truth), then append in Python; many requests with one block each (a large batch's usual
        # step) in one numpy write instead.
        got = list(compress(range(len(new_block_ids)), new_block_ids))
        if len(got) >= _VECTOR_APPEND and all(len(new_block_ids[i]) == 1 for i in got):
            r = rows[got]
            start = self.num_blocks[r]
            if start.max() < self.max_blocks_per_req and len(np.unique(r)) == len(r):
                self.block_table[r, start] = [new_block_ids[i][0] for i in got]
                self.num_blocks[r] = start + 1
                got = []
        for i in got:
            self.append_block_ids(int(rows[i]), new_block_ids[i])
        self.num_computed_tokens[rows] = num_computed_tokens

    def append_block_ids(self, row: int, block_ids: list[int]) -> None:
        if not block_ids:
            return
        start = int(self.num_blocks[row])
        end = start + len(block_ids)
        if end > self.max_blocks_per_req:
            raise RuntimeError(f"row {row} would hold {end} blocks > max {self.max_blocks_per_req}")
        self.block_table[row, start:end] = block_ids
        self.num_blocks[row] = end

    def remove_request(self, req_id: str) -> bool:
        """Drop a request and condense (the last row fills its hole); False if it was not here."""
        row = self.req_id_to_row.pop(req_id, None)
        if row is None:
            return False
        self._version += 1  # an id gone, maybe a row moved (adding changes no existing id's row)
        last = self.num_reqs  # index of the last occupied row before removal
        self.sampling.remove_request(row)
        self.num_prompt_logprob_reqs -= _wants_prompt_logprobs(self.params[row])
        self.req_ids[row] = None
        self.params[row] = None
        self.pending_pos[row] = -1
        self.pending_idx[row] = -1
        if row != last:
            self._move_row(last, row)
        return True

    def _move_row(self, src: int, dst: int) -> None:
        """Condensing: the request in row src moves to the empty row dst, sampling state included."""
        moved_id = self.req_ids[src]
        assert moved_id is not None
        self.req_ids[dst], self.req_ids[src] = moved_id, None
        self.req_id_to_row[moved_id] = dst
        self.params[dst], self.params[src] = self.params[src], None
        n = int(self.num_tokens[src])
        self.token_ids[dst, :n] = self.token_ids[src, :n]
        nb = int(self.num_blocks[src])
        self.block_table[dst, :nb] = self.block_table[src, :nb]
        for name in _ROW_SCALARS:
            arr = getattr(self, name)
            arr[dst] = arr[src]
        self.pending_pos[dst] = self.pending_pos[src]
        self.pending_pos[src] = -1
        self.pending_idx[dst] = self.pending_idx[src]
        self.pending_idx[src] = -1
        self.sampling.move_row(src, dst)

    # ------------------------------------------------------------------ per step
    def rows_of(self, req_ids: list[str]) -> np.ndarray:
        """int64 rows of the given requests, in the given order (a new array: the caller may keep or change it).

        A step looks up the same requests twice (the scheduler's diff, then the step's inputs) and the steady
        decode step the same list as the step before: while no request was removed since (condensing moves rows
        only then; an added one changes no row), the same list (compared by value, one C loop) gets the rows found
        last time instead of a dict lookup each."""
        c = self._rows_cache
        is_list = type(req_ids) is list
        if is_list and c is not None and c[0] == self._version and c[1] == req_ids:
            return c[2].copy()
        rows = np.fromiter(map(self.req_id_to_row.__getitem__, req_ids), dtype=np.int64, count=len(req_ids))
        if is_list:
            self._rows_cache = (self._version, list(req_ids), rows.copy())
        return rows

    def sampling_metadata(self, rows: np.ndarray) -> SamplingMetadata:
        """The sampler's batched inputs for these rows, in this order (row i -> logits row i)."""
        return self.sampling.make_metadata(rows)

    def record_sampled(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        """Append one sampled token per (distinct) row, to the token rows and to the sampling state."""
        rows = np.asarray(rows, dtype=np.int64)
        token_ids = np.asarray(token_ids, dtype=np.int64)
        pos = self.num_tokens[rows]
        if len(pos) and pos.max() < self.max_model_len:  # every row has room (always, but at max_model_len)
            self.token_ids[rows, pos] = token_ids  # a few numpy calls: each is ~10-30 us cold after a CPU forward
            self.num_tokens[rows] = pos + 1
        else:
            ok = pos < self.max_model_len
            self.token_ids[rows[ok], pos[ok]] = token_ids[ok]
            self.num_tokens[rows[ok]] += 1
        self.sampling.append_token_ids(rows, token_ids)

    # ------------------------------------------------------------------ async scheduling
    def note_sampled(self, rows: np.ndarray, step_id: int) -> None:
        """A launched step samples one token per row whose value is not on the host yet: hold its position with
        PLACEHOLDER_TOKEN (no forward reads it: the next step takes it from the device), count it (min_tokens
        needs only the count) and remember where it goes. Row i's token is entry i of the step's sampled tensor
        (rows distinct)."""
        rows = np.asarray(rows, dtype=np.int64)
        n = len(rows)
        if not n:
            return
        col = step_id % PENDING_STEPS
        if self.pending_pos[:, col][rows].max() >= 0:  # a column view, then a 1-D gather: faster than [rows, col]
            raise RuntimeError(f"step {step_id}: rows {rows.tolist()} still wait for a token of step {step_id - 2}")
        pos = self.num_tokens[rows]
        if pos.max() < self.max_model_len:  # every row has room (always, but for a request at max_model_len)
            self.token_ids[rows, pos] = PLACEHOLDER_TOKEN
            self.num_tokens[rows] = pos + 1
            self.pending_pos[rows, col] = pos
            self.pending_idx[rows, col] = self._arange[:n]
        else:
            ok = pos < self.max_model_len
            self.token_ids[rows[ok], pos[ok]] = PLACEHOLDER_TOKEN
            self.num_tokens[rows[ok]] += 1
            self.pending_pos[rows, col] = np.where(ok, pos, -1)
            self.pending_idx[rows, col] = np.where(ok, self._arange[:n], -1)
        self.sampling.count_sampled(rows)

    def pending_sources(self, rows: np.ndarray, step_id: int) -> np.ndarray:
        """Where the listed rows' tokens pending from `step_id` sit in that step's sampled tensor (-1: none)."""
        return self.pending_idx[:, step_id % PENDING_STEPS][np.asarray(rows, dtype=np.int64)]

    def fill_pending(self, token_ids: np.ndarray, step_id: int) -> None:
        """Step `step_id`'s sampled tokens (its whole sampled tensor, on the host) reached the host: each row still
        waiting for one of them takes its value (fill_sampled's effect, found by row instead of by request id:
        rows that moved took their pending entries along, removed and re-added ones hold none)."""
        col = step_id % PENDING_STEPS
        n = self.num_reqs
        pos = self.pending_pos[:n, col]
        rows = (pos >= 0).nonzero()[0]
        if not len(rows):
            return
        pos = pos[rows]
        toks = np.asarray(token_ids, dtype=np.int64).reshape(-1)[self.pending_idx[rows, col]]
        self.token_ids[rows, pos] = toks
        self.pending_pos[rows, col] = -1
        self.pending_idx[rows, col] = -1
        if self.sampling.any_needs_token_values():
            self.sampling.record_values(rows, toks, pos - self.num_prompt_tokens[rows])
        else:  # no row keeps values (rows valid: found above): the ids' check alone
            self.sampling.check_token_ids(toks)

    def pending_rows(self, rows: np.ndarray, step_id: int) -> np.ndarray:
        """Positions (per row; -1: none) of the listed rows' tokens sampled by `step_id` and not yet on the host."""
        return self.pending_pos[:, step_id % PENDING_STEPS][np.asarray(rows, dtype=np.int64)]

    def fill_sampled(self, req_ids: list[str], token_ids: np.ndarray, step_id: int) -> None:
        """Step `step_id`'s tokens reached the host: write them where their placeholders are, by request id (rows
        move when the batch condenses). Requests removed since, or re-added with their tokens known, are skipped."""
        col = step_id % PENDING_STEPS
        toks = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        k = min(len(req_ids), len(toks))  # zip's length, as the one-at-a-time loop had it
        get = self.req_id_to_row.get
        rows = np.fromiter((get(rid, -1) for rid in req_ids[:k]), dtype=np.int64, count=k)
        live = rows >= 0
        rows, toks = rows[live], toks[:k][live]
        pos = self.pending_pos[rows, col]
        wait = pos >= 0
        if not wait.all():
            rows, toks, pos = rows[wait], toks[wait], pos[wait]
        if len(np.unique(rows)) != len(rows):  # a request listed twice: its first entry only, as the loop did
            _, first = np.unique(rows, return_index=True)
            keep = np.sort(first)
            rows, toks, pos = rows[keep], toks[keep], pos[keep]
        if len(rows):
            self.token_ids[rows, pos] = toks
            self.pending_pos[rows, col] = -1
            self.pending_idx[rows, col] = -1
            self.sampling.record_values(rows, toks, pos - self.num_prompt_tokens[rows])


def _wants_prompt_logprobs(params: Optional[SamplingParams]) -> int:
    return int(params is not None and params.prompt_logprobs is not None)
