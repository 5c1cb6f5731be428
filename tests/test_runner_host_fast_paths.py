"""The runner's per-step host fast paths (issue #14) give exactly what the general code gives.

build_step_inputs: a decode step (one token a request) skips the repeats, and requests already in row order
skip the sort; both are checked against the general algorithm, kept here as the reference. InputBatch counts
the requests that want prompt logprobs (the runner skips that work at zero) through add, remove and condensing,
and update_requests equals update_request one at a time.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from vllm_lite.sampling_params import SamplingParams
from vllm_lite.worker.input_batch import InputBatch
from vllm_lite.worker.step import NewRequestData
from vllm_lite.worker.step_inputs import StepInputs, build_step_inputs

BLOCK = 16


def reference_step_inputs(batch: InputBatch, sched: dict[str, int], arange: np.ndarray) -> StepInputs:
    """The general algorithm (argsort, repeats), as build_step_inputs had it before its fast paths."""
    req_ids = list(sched)
    rows = batch.rows_of(req_ids)
    order = np.argsort(rows, kind="stable")
    rows = rows[order]
    req_ids = [req_ids[i] for i in order]
    num_sched = np.fromiter((sched[r] for r in req_ids), dtype=np.int64, count=len(req_ids))
    total = int(num_sched.sum())
    computed = batch.num_computed_tokens[rows]
    cu = np.zeros(len(req_ids) + 1, dtype=np.int64)
    np.cumsum(num_sched, out=cu[1:])
    req_of_tok = np.repeat(np.arange(len(req_ids)), num_sched)
    positions = computed[req_of_tok] + arange[:total] - np.repeat(cu[:-1], num_sched)
    tok_rows = rows[req_of_tok]
    block_idx = batch.block_table[tok_rows, positions // BLOCK].astype(np.int64)
    seq_lens = computed + num_sched
    max_blocks = int(-(-seq_lens.max() // BLOCK))
    return StepInputs(
        req_ids=req_ids,
        rows=rows,
        num_scheduled=num_sched,
        query_start_loc=cu,
        num_computed=computed,
        seq_lens=seq_lens,
        input_ids=batch.token_ids[tok_rows, positions],
        positions=positions,
        slot_mapping=block_idx * BLOCK + positions % BLOCK,
        block_table=batch.block_table[rows, :max_blocks],
        req_num_tokens=batch.num_tokens[rows],
    )


def assert_same(a: StepInputs, b: StepInputs) -> None:
    for f in dataclasses.fields(StepInputs):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y), f.name
        else:
            assert x == y, f.name


def make_batch(n: int, seed: int = 0, params: SamplingParams | None = None, spare: int = 0) -> InputBatch:
    rng = np.random.default_rng(seed)
    batch = InputBatch(n + spare, 256, 256 // BLOCK, 100, torch.device("cpu"))
    for i in range(n):
        plen = int(rng.integers(3, 60))
        batch.add_request(
            NewRequestData(
                req_id=f"r{i}",
                prompt_token_ids=rng.integers(0, 100, plen).tolist(),
                output_token_ids=rng.integers(0, 100, 2).tolist(),
                sampling_params=params or SamplingParams(temperature=0.0),
                block_ids=list(range(i * 16, i * 16 + (plen + 2) // BLOCK + 1)),
                num_computed_tokens=plen + 1,
            )
        )
    return batch


@pytest.mark.parametrize("order", ["rows", "shuffled", "reversed"])
def test_decode_step_inputs_equal_the_general_algorithm(order):
    batch = make_batch(12)
    batch.remove_request("r3")  # condensing moves the last row into the hole: rows no longer follow ids
    ids = [r for r in batch.req_ids if r is not None]
    if order == "shuffled":
        ids = [ids[i] for i in np.random.default_rng(1).permutation(len(ids))]
    elif order == "reversed":
        ids = ids[::-1]
    arange = np.arange(1024, dtype=np.int64)
    sched = {r: 1 for r in ids}
    assert_same(build_step_inputs(batch, sched, BLOCK, arange), reference_step_inputs(batch, sched, arange))


@pytest.mark.parametrize("counts", [[2, 1, 1, 1], [1, 1, 0, 2], [3, 0, 1, 0], [1], [5]])
def test_mixed_step_inputs_equal_the_general_algorithm(counts):
    batch = make_batch(len(counts), seed=2)
    for r in range(len(counts)):  # room for the scheduled tokens
        batch.num_computed_tokens[r] = min(batch.num_computed_tokens[r], batch.num_tokens[r] - max(counts[r], 1))
    ids = [r for r in batch.req_ids if r is not None]
    sched = {ids[::-1][i]: c for i, c in enumerate(counts)}
    arange = np.arange(1024, dtype=np.int64)
    assert_same(build_step_inputs(batch, sched, BLOCK, arange), reference_step_inputs(batch, sched, arange))


def test_prompt_logprob_request_count_follows_add_remove_and_condensing():
    batch = make_batch(4, spare=3)
    assert batch.num_prompt_logprob_reqs == 0
    lp = SamplingParams(temperature=0.0, prompt_logprobs=2)
    new = NewRequestData("p0", [1, 2, 3], [], lp, [100], 0)
    batch.add_request(new)
    batch.add_request(dataclasses.replace(new, req_id="p1", block_ids=[101]))
    assert batch.num_prompt_logprob_reqs == 2
    batch.remove_request("r0")  # p1 (the last row) moves into row 0
    assert batch.num_prompt_logprob_reqs == 2
    batch.remove_request("p1")
    assert batch.num_prompt_logprob_reqs == 1
    batch.remove_request("p0")
    batch.remove_request("p0")  # not there: no change
    assert batch.num_prompt_logprob_reqs == 0
    with pytest.raises(ValueError):  # a failed add leaves the count alone
        batch.add_request(dataclasses.replace(new, req_id="bad", prompt_token_ids=[1] * 300))
    assert batch.num_prompt_logprob_reqs == 0


def test_update_requests_equals_one_at_a_time():
    a, b = make_batch(6), make_batch(6)
    ids = ["r4", "r1", "r5", "r0"]
    blocks = [[200, 201], [], [202], []]
    computed = [7, 9, 11, 13]
    a.update_requests(ids, blocks, computed)
    for r, bl, c in zip(ids, blocks, computed):
        b.update_request(r, bl, c)
    for name in ("num_computed_tokens", "num_blocks", "block_table"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    with pytest.raises(KeyError):
        a.update_requests(["nope"], [[]], [1])


def reference_fill_sampled(batch: InputBatch, req_ids: list[str], token_ids: np.ndarray, step_id: int) -> None:
    """fill_sampled as a loop over requests (before it was vectorized)."""
    col = step_id % 2
    rows, toks, out_pos = [], [], []
    for rid, tok in zip(req_ids, np.asarray(token_ids, dtype=np.int64).tolist()):
        row = batch.req_id_to_row.get(rid)
        if row is None:
            continue
        pos = int(batch.pending_pos[row, col])
        if pos < 0:
            continue
        batch.token_ids[row, pos] = tok
        batch.pending_pos[row, col] = -1
        rows.append(row)
        toks.append(tok)
        out_pos.append(pos - int(batch.num_prompt_tokens[row]))
    if rows:
        batch.sampling.record_values(np.asarray(rows, np.int64), np.asarray(toks, np.int64), np.asarray(out_pos))


def test_fill_sampled_equals_the_loop():
    """Placeholders filled by request id: removed requests and rows with nothing pending skipped, a request listed
    twice filled once (its first entry), penalty histories recorded, as the per-request loop did."""
    params = SamplingParams(temperature=1.0, presence_penalty=0.5)
    batches = [make_batch(8, params=params) for _ in range(2)]
    ids = [f"r{i}" for i in range(8)]
    for b in batches:
        b.note_sampled(b.rows_of(ids[:6]), step_id=3)  # r6, r7: nothing pending
        b.remove_request("r2")  # condensing: r7 moves into r2's row
    listed = ["r5", "r2", "r0", "r7", "r1", "r0", "r3", "r6", "r4"]
    toks = np.arange(10, 10 + len(listed), dtype=np.int64)
    batches[0].fill_sampled(listed, toks, step_id=3)
    reference_fill_sampled(batches[1], listed, toks, step_id=3)
    a, b = batches
    for name in ("token_ids", "pending_pos", "num_tokens"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    assert a.sampling.seen is not None and b.sampling.seen is not None
    for name in ("tokens", "counts", "lens"):
        assert np.array_equal(getattr(a.sampling.seen, name), getattr(b.sampling.seen, name)), name


@pytest.mark.parametrize("seed", range(6))
def test_fill_pending_and_pending_sources_equal_the_request_id_path(seed):
    """Async scheduling: a step's tokens found by row (pending_idx, moved with condensing) land exactly where
    fill_sampled puts them by request id, and pending_sources gives each waiting row its entry of the step's
    sampled tensor (the old req_id -> index map), with two steps in flight, removals, condensing, re-adds and a
    row at max_model_len (no placeholder)."""
    rng = np.random.default_rng(seed)
    params = SamplingParams(temperature=1.0, presence_penalty=0.5)
    a, b = (make_batch(10, params=params, spare=4) for _ in range(2))
    full = NewRequestData("full", [1] * 256, [], params, list(range(300, 316)), 255)
    for batch in (a, b):
        batch.add_request(full)
    live = [f"r{i}" for i in range(10)] + ["full"]
    noted: dict[int, list[str]] = {}
    for step_id in (3, 4):  # each step samples a random subset, in row order (as the runner notes them)
        pick = [r for r in live if rng.random() < 0.8]
        for batch in (a, b):
            rows = np.sort(batch.rows_of(pick))
            batch.note_sampled(rows, step_id)
        noted[step_id] = [a.req_ids[r] for r in np.sort(a.rows_of(pick)).tolist()]
    for victim in rng.permutation(live)[:3].tolist():  # condensing moves rows (and their pending entries)
        for batch in (a, b):
            batch.remove_request(victim)
    readd = NewRequestData(noted[3][0], [5, 6, 7], [8], params, [400], 3)  # back with its tokens known
    for batch in (a, b):
        batch.remove_request(readd.req_id)
        batch.add_request(readd)
    for step_id in (3, 4):
        index_of = {rid: j for j, rid in enumerate(noted[step_id])}
        rows = np.arange(a.num_reqs)
        waiting = a.pending_rows(rows, step_id) >= 0
        expect = [index_of[a.req_ids[r]] for r in rows[waiting].tolist()]
        assert a.pending_sources(rows[waiting], step_id).tolist() == expect
        assert (a.pending_sources(rows[~waiting], step_id) == -1).all()
        toks = rng.integers(0, 100, len(noted[step_id]))
        a.fill_pending(toks, step_id)
        b.fill_sampled(noted[step_id], toks, step_id)
        for name in ("token_ids", "pending_pos", "num_tokens"):
            assert np.array_equal(getattr(a, name), getattr(b, name)), name
        assert (a.pending_idx[:, step_id % 2] == -1).all()
        for name in ("tokens", "counts", "lens"):
            assert np.array_equal(getattr(a.sampling.seen, name), getattr(b.sampling.seen, name)), name


class _FixStub:
    """The parts of GPUModelRunner that _fix_on_device uses (CPU: no staging)."""

    def __init__(self, n: int) -> None:
        self.device = torch.device("cpu")
        self._arange = np.arange(n + 1, dtype=np.int64)
        self._dev_arange = None
        self._dev_arange_k = None
        self._staging = None

    from vllm_lite.worker.model_runner import GPUModelRunner as _R

    _fix_on_device = _R._fix_on_device
    _device_arange = _R._device_arange
    _h2d = _R._h2d
    _stage = _R._stage


@pytest.mark.parametrize("seed", range(8))
def test_fix_on_device_equals_copy_and_gather(seed):
    """Async scheduling: the (token index, token id) pairs the next step writes over its input ids are the same
    whether the identity ranges take the slice-and-view path (steady decode) or the copy-and-gather one: index
    ranges 0..k-1, shifted ones (a prefill chunk in a lower row), permuted sources (condensing), subsets."""
    rng = np.random.default_rng(seed)
    stub = _FixStub(600)
    sampled = torch.from_numpy(rng.integers(0, 1000, 300))
    for k in (0, 1, 5, 256, 300):
        cases = [(np.arange(k), np.arange(k))]
        if k:
            cases += [
                (np.arange(k) + 7, np.arange(k)),  # tokens after another request's chunk
                (np.arange(k), rng.permutation(k)),  # rows moved since the launch
                (np.sort(rng.choice(600, k, replace=False)), np.sort(rng.choice(300, k, replace=False))),
            ]
        for dst, src in cases:
            got_dst, got_tok = stub._fix_on_device(dst.astype(np.int64), src.astype(np.int64), sampled)
            assert got_dst.tolist() == dst.tolist()
            assert got_tok.tolist() == sampled[torch.from_numpy(src.astype(np.int64))].tolist()


@pytest.mark.parametrize("seed", range(6))
def test_rows_of_reuse_equals_the_dict_lookups(seed):
    """InputBatch.rows_of hands back its last rows for the same request list while no request was added, removed
    or moved (condensing); every answer equals a lookup of each id, and changing a returned array changes none
    of the later ones."""
    rng = np.random.default_rng(seed)
    batch = make_batch(6, seed=seed, spare=10)
    live = [r for r in batch.req_ids if r is not None]
    next_id = 0
    last: list[str] = list(live)
    hits = 0
    for _ in range(120):
        r = rng.random()
        if r < 0.08 and len(live) < batch.max_num_reqs:
            rid = f"n{next_id}"
            next_id += 1
            batch.add_request(NewRequestData(rid, [1, 2, 3], [], SamplingParams(), [500 + next_id], 3))
            live.append(rid)
        elif r < 0.16 and len(live) > 1:
            gone = live.pop(int(rng.integers(0, len(live))))
            batch.remove_request(gone)  # condensing moves the last row into its hole
        if rng.random() < 0.3:  # another order or subset now and then; the same list (a new list object) mostly
            last = [live[i] for i in rng.permutation(len(live))[: int(rng.integers(1, len(live) + 1))]]
        ids = list(last) if all(x in batch.req_id_to_row for x in last) else list(live)
        last = ids
        before = batch._rows_cache
        got = batch.rows_of(ids)
        hits += before is not None and before[1] == ids and before[0] == batch._version
        expect = np.array([batch.req_id_to_row[x] for x in ids], dtype=np.int64)
        assert got.dtype == np.int64 and np.array_equal(got, expect)
        got[:] = -7  # the caller's array is its own
    assert hits > 30


def test_rows_of_refuses_a_removed_request_after_reuse():
    """A list naming a request that left is a KeyError, as without reuse (the last row leaves: nothing moves)."""
    batch = make_batch(4)
    ids = [r for r in batch.req_ids if r is not None]
    batch.rows_of(ids)
    assert np.array_equal(batch.rows_of(list(ids)), np.arange(4))
    batch.remove_request(ids[-1])
    with pytest.raises(KeyError):
        batch.rows_of(list(ids))
