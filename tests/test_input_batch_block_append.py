"""InputBatch.update_requests appends one new block each for many requests in one numpy write (issue #14): the
batch must equal update_request one request at a time, including the cases that fall back to the loop (a request
listed twice, a request at its block limit, several blocks for one request, fewer requests than the threshold)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_lite.sampling_params import SamplingParams
from vllm_lite.worker.input_batch import InputBatch
from vllm_lite.worker.step import NewRequestData

BLOCK, MAX_BLOCKS, N = 16, 4, 12


def _batch() -> InputBatch:
    batch = InputBatch(N, BLOCK * MAX_BLOCKS, MAX_BLOCKS, 100, torch.device("cpu"))
    for i in range(N):
        nb = 1 + i % 3  # 1..3 blocks held; rows 2, 5, 8, 11 have room for one more only
        batch.add_request(
            NewRequestData(f"r{i}", [1, 2, 3], [], SamplingParams(temperature=0.0), list(range(10 * i, 10 * i + nb)), 3)
        )
    batch.remove_request("r4")  # condensing: rows no longer follow the ids
    return batch


def _one_at_a_time(batch: InputBatch, ids: list[str], blocks: list[list[int]], computed: list[int]) -> None:
    for r, bl, c in zip(ids, blocks, computed):
        batch.update_request(r, bl, c)


def _two_for_one(batch: InputBatch, ids: list[str]) -> list[list[int]]:
    """One block each, and two for the first request that holds one (room for both)."""
    k = next(j for j, r in enumerate(ids) if batch.num_blocks[batch.req_id_to_row[r]] == 1)
    return [[500 + j] if j != k else [600, 601] for j in range(len(ids))]


CASES = {
    "many_single": lambda batch, ids: [[500 + j] for j in range(len(ids))],
    "some_single": lambda batch, ids: [[500 + j] if j % 2 else [] for j in range(len(ids))],
    "few_single": lambda batch, ids: [[500 + j] if j < 3 else [] for j in range(len(ids))],
    "one_has_two": _two_for_one,
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("order", ["rows", "reversed"])
def test_update_requests_equals_one_at_a_time(case: str, order: str) -> None:
    a, b = _batch(), _batch()
    ids = [r for r in a.req_ids if r is not None]
    if order == "reversed":
        ids = ids[::-1]
    blocks = CASES[case](a, ids)  # every request holds 1-3 of 4 blocks: room for one more
    computed = list(range(20, 20 + len(ids)))
    a.update_requests(ids, blocks, computed)
    _one_at_a_time(b, ids, blocks, computed)
    for name in ("num_computed_tokens", "num_blocks", "block_table"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name


def test_a_request_at_its_block_limit_raises_as_the_loop() -> None:
    a, b = _batch(), _batch()
    ids = [r for r in a.req_ids if r is not None]
    full = [r for r in ids if int(a.num_blocks[a.req_id_to_row[r]]) == MAX_BLOCKS - 1]
    for batch in (a, b):  # fill one request to its limit
        batch.update_request(full[0], [900], 3)
    blocks = [[500 + j] for j in range(len(ids))]
    computed = [30] * len(ids)
    with pytest.raises(RuntimeError, match="blocks > max"):
        a.update_requests(ids, blocks, computed)
    with pytest.raises(RuntimeError, match="blocks > max"):
        _one_at_a_time(b, ids, blocks, computed)
    for name in ("num_blocks", "block_table"):  # the same rows appended before the error
        assert np.array_equal(getattr(a, name), getattr(b, name)), name


def test_a_request_listed_twice_appends_twice_as_the_loop() -> None:
    a, b = _batch(), _batch()
    ids = [r for r in a.req_ids if r is not None][:6]
    ids = ids + [ids[0]]  # listed twice (the scheduler never does; the loop's result is kept)
    blocks = [[500 + j] for j in range(len(ids))]
    computed = [40] * len(ids)
    row0 = a.req_id_to_row[ids[0]]
    a.update_requests(ids, blocks, computed)
    _one_at_a_time(b, ids, blocks, computed)
    for name in ("num_blocks", "block_table"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    assert a.block_table[row0, a.num_blocks[row0] - 2 : a.num_blocks[row0]].tolist() == [500, 506]
