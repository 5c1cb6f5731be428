"""The worker's persistent batch: one row per live request, kept across steps.

Rows are updated in place from the scheduler's diff; removing a request moves
the last row into its hole so rows 0..num_reqs-1 stay dense. Token ids, block
tables and progress live in numpy arrays so building a step's inputs is a
handful of vectorised numpy ops and one copy to the device.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from vllm_lite.sampling_params import SamplingParams


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int) -> None:
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

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_row)

    def add_request(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        output_token_ids: list[int],
        params: SamplingParams,
        block_ids: list[int],
        num_computed_tokens: int,
    ) -> int:
        """Put a request in the first free row; returns the row."""
        if req_id in self.req_id_to_row:
            raise ValueError(f"request {req_id!r} is already in the batch")
        row = self.num_reqs
        if row >= self.max_num_reqs:
            raise RuntimeError(f"persistent batch is full ({self.max_num_reqs} rows)")
        n_prompt, n_out = len(prompt_token_ids), len(output_token_ids)
        self.req_ids[row] = req_id
        self.req_id_to_row[req_id] = row
        self.params[row] = params
        self.token_ids[row, :n_prompt] = prompt_token_ids
        self.token_ids[row, n_prompt : n_prompt + n_out] = output_token_ids
        self.num_prompt_tokens[row] = n_prompt
        self.num_tokens[row] = n_prompt + n_out
        self.num_computed_tokens[row] = num_computed_tokens
        self.num_blocks[row] = 0
        self.append_block_ids(row, block_ids)
        return row

    def append_block_ids(self, row: int, block_ids: list[int]) -> None:
        if not block_ids:
            return
        start = int(self.num_blocks[row])
        end = start + len(block_ids)
        if end > self.max_blocks_per_req:
            raise RuntimeError(f"row {row} would hold {end} blocks > max {self.max_blocks_per_req}")
        self.block_table[row, start:end] = block_ids
        self.num_blocks[row] = end

    def remove_request(self, req_id: str) -> Optional[tuple[int, int]]:
        """Drop a request; returns (moved_from_row, moved_to_row) if the last row filled the hole."""
        row = self.req_id_to_row.pop(req_id, None)
        if row is None:
            return None
        last = self.num_reqs  # index of the last occupied row before removal
        self.req_ids[row] = None
        self.params[row] = None
        if row == last:
            return None
        moved_id = self.req_ids[last]
        assert moved_id is not None
        self.req_ids[row] = moved_id
        self.req_id_to_row[moved_id] = row
        self.params[row] = self.params[last]
        n = int(self.num_tokens[last])
        self.token_ids[row, :n] = self.token_ids[last, :n]
        for arr in (self.num_tokens, self.num_prompt_tokens, self.num_computed_tokens, self.num_blocks):
            arr[row] = arr[last]
        nb = int(self.num_blocks[last])
        self.block_table[row, :nb] = self.block_table[last, :nb]
        self.req_ids[last] = None
        self.params[last] = None
        return last, row
