"""Async scheduling, the runner's side (issue #14): `execute_model(so, non_block=True)` launches a step and returns
before its tokens are on the host; the next step's input ids for those tokens come from the previous step's
sampled tensor on the device, while the host batch holds PLACEHOLDER_TOKEN (-1) there until get_output().

A small stand-in core (`_Core`) drives a real CPU runner (the tiny float32 llama) with SchedulerOutputs that follow
the contract the engine core keeps: at most two steps in flight, step N+1 launched before get_output(N), a
request whose last token is a placeholder sent as a cached request with one token at the placeholder's position,
requests finished at update(N) still in step N+1's batch, preemption while a step is in flight, re-admission with
every token known. Each scenario runs the same plan synchronously and asynchronously: the tokens (and logprobs)
must be identical, and the host token ids at pending positions must be -1 whenever the forward runs (the embedding
would fail on -1, and the forward's input ids equal the synchronous run's).
"""

from __future__ import annotations

import contextlib
import runpy
import sys
from pathlib import Path
from typing import Callable, Iterator, Optional

import numpy as np
import pytest
import torch

from vllm_lite.sampling_params import SamplingParams
from vllm_lite.testing.cpu_runner import cpu_runner
from vllm_lite.testing.device_ops import DeviceOpCounter, install_stand_in_graphs
from vllm_lite.testing.stand_in_core import StandInCore
from vllm_lite.worker import sampler as sampler_mod
from vllm_lite.worker.host_staging import PinnedRing, SampledRing
from vllm_lite.worker.input_batch import PLACEHOLDER_TOKEN
from vllm_lite.worker.step import AsyncModelRunnerOutput, CachedRequestData, SchedulerOutput

BLOCK_SIZE = 16
BLOCKS_PER_REQ = 4  # max_model_len 64
PROMPTS = [[1, 5, 9, 20, 33], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [7, 8], [40, 41, 42], [9], [60, 61, 62, 63]]


def _runner(async_scheduling: bool, **kwargs):
    return cpu_runner(BLOCK_SIZE, BLOCKS_PER_REQ, "float32", 8, async_scheduling=async_scheduling, **kwargs)


class _Core(StandInCore):
    def add(self, i: int, params: SamplingParams, **kw) -> None:  # type: ignore[override]
        super().add(i, PROMPTS[i], params, **kw)


def _run(
    async_: bool,
    setup: Callable[[_Core], None],
    steps: int,
    events: Optional[dict[int, Callable[[_Core], None]]] = None,
    graphs: Optional[list[int]] = None,
    checks: Optional[Callable[[_Core], list]] = None,
) -> _Core:
    runner = _runner(async_)
    replays: list = []
    if graphs:
        install_stand_in_graphs(runner, [(b, 1) for b in graphs], replays=replays)
    core = _Core(runner, async_)
    core.replays = replays  # type: ignore[attr-defined]
    setup(core)
    if checks is not None:
        core.checks = checks(core)
    for i in range(steps):
        if events and i in events:
            events[i](core)
        core.step()
    core.drain()
    return core


def _tokens(core: _Core) -> dict[str, list[int]]:
    return {rid: r.out for rid, r in core.reqs.items()}


def _greedy(max_tokens: int = 12, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


# ---------------------------------------------------------------------------------------------- token identity
def _three_greedy(core: _Core) -> None:
    for i in range(3):
        core.add(i, _greedy())


def test_pipelined_decode_gives_the_sync_tokens_and_the_forward_never_reads_a_placeholder() -> None:
    sync = _run(False, _three_greedy, steps=12)  # 12 tokens each; the finished ones still in the batch after
    asyn = _run(True, _three_greedy, steps=12)
    assert _tokens(asyn) == _tokens(sync)
    assert all(len(t) == 12 for t in _tokens(sync).values())
    # Same forward inputs step by step: the previous step's tokens came from the device, none was -1.
    assert asyn.step_inputs == sync.step_inputs
    assert all(PLACEHOLDER_TOKEN not in ids for ids in asyn.step_inputs)
    batch = asyn.runner.input_batch  # backfilled once read: the host batch ends with the real tokens
    for rid, r in asyn.reqs.items():
        row = batch.req_id_to_row[rid]
        n = len(r.prompt) + len(r.out)
        assert batch.token_ids[row, len(r.prompt) : n].tolist() == r.out


def test_a_request_finished_between_steps_and_condensing_rows_keep_their_tokens() -> None:
    """r1 stops at update(N) while step N+1 already holds it (its extra token is discarded); removing it moves the
    last row into its hole while that row's token is still pending: placeholders follow the request, not the row."""

    def setup(core: _Core) -> None:
        for i in range(4):
            core.add(i, _greedy(), eos_at=3 if i == 1 else None)

    sync = _run(False, setup, steps=14)
    asyn = _run(True, setup, steps=14)
    assert _tokens(asyn) == _tokens(sync)
    assert len(sync.reqs["r1"].out) == 3 and len(sync.reqs["r3"].out) == 12
    # Async: r1 ran once more than sync (launched before its stop was known).
    runs = lambda core: sum(len(ids) for ids in core.step_inputs)  # noqa: E731
    assert runs(asyn) == runs(sync) + 1


def test_preempted_while_in_flight_then_readded_gives_the_sync_tokens() -> None:
    """r0 is preempted while its token is still in flight (the core still takes that token), r2 is added mid-run,
    r0 comes back with every token known (a recompute prefill of prompt + outputs)."""

    def setup(core: _Core) -> None:
        core.add(0, _greedy())
        core.add(1, _greedy())

    events = {
        4: lambda core: core.preempt("r0"),
        5: lambda core: core.add(2, _greedy()),
        7: lambda core: core.resume("r0"),
    }
    sync = _run(False, setup, steps=18, events=events)
    asyn = _run(True, setup, steps=18, events=events)
    assert _tokens(asyn) == _tokens(sync)
    assert all(len(t) == 12 for t in _tokens(sync).values())


def test_seeded_random_rows_give_the_sync_tokens() -> None:
    def setup(core: _Core) -> None:
        core.add(0, SamplingParams(temperature=1.0, seed=7, max_tokens=10, ignore_eos=True))
        core.add(1, _greedy(10))  # mixed batch: random rows come from the metadata, not greedy_mask
        core.add(2, SamplingParams(temperature=0.8, seed=11, max_tokens=10, ignore_eos=True))

    sync = _run(False, setup, steps=12)
    asyn = _run(True, setup, steps=12)
    assert _tokens(asyn) == _tokens(sync)
    assert len(set(map(tuple, _tokens(sync).values()))) == 3


def test_min_tokens_needs_only_the_count_and_gives_the_sync_tokens() -> None:
    """The stop id is the token greedy would pick first: min_tokens holds it back for 4 tokens (counted at launch,
    no wait for values), then it may come."""
    first = _run(False, lambda core: core.add(0, _greedy(1)), steps=2).reqs["r0"].out[0]

    def setup(core: _Core) -> None:
        core.add(0, SamplingParams(temperature=0.0, max_tokens=8, min_tokens=4), eos_token_id=first)
        core.add(1, _greedy(8))

    def no_wait(core: _Core) -> list:
        return [lambda: core.assert_placeholders()]

    sync = _run(False, setup, steps=10)
    asyn = _run(True, setup, steps=10, checks=no_wait)
    assert _tokens(asyn) == _tokens(sync)
    assert first not in sync.reqs["r0"].out[:4]


def test_penalties_wait_for_the_previous_tokens_and_give_the_sync_tokens() -> None:
    """A penalized row reads its output tokens' values: the runner waits for the previous step's tokens before
    building the sampling metadata (so right after launching step N+1 the host holds step N's tokens), and
    the tokens equal the sync run's."""

    def setup(core: _Core) -> None:
        core.add(0, _greedy(10, repetition_penalty=1.5, frequency_penalty=0.7))
        core.add(1, _greedy(10))

    def resolved_at_launch(core: _Core) -> list:
        def check() -> None:
            if core.reqs["r0"].ph < 2:  # r0 in both steps in flight
                return
            seen.append(1)
            batch = core.runner.input_batch
            for rid in ("r0", "r1"):  # one wait fills the whole previous step
                r, row = core.reqs[rid], batch.req_id_to_row[rid]
                known = len(r.prompt) + len(r.out)
                assert batch.token_ids[row, known] != PLACEHOLDER_TOKEN, rid  # step N's token is already here
                assert batch.token_ids[row, known + 1] == PLACEHOLDER_TOKEN  # step N+1's is not

        return [check]

    seen: list = []
    sync = _run(False, setup, steps=12)
    asyn = _run(True, setup, steps=12, checks=resolved_at_launch)
    assert _tokens(asyn) == _tokens(sync)
    assert len(seen) == 9
    plain = _run(False, lambda core: core.add(0, _greedy(10)), steps=12)
    assert _tokens(sync)["r0"] != plain.reqs["r0"].out  # the penalties did change the tokens


def test_multi_token_bad_words_wait_for_the_previous_tokens_and_give_the_sync_tokens() -> None:
    """A two-token bad word is matched against the output so far (its values): such a row waits like penalties."""
    plain = _run(False, lambda core: core.add(0, _greedy(10)), steps=10).reqs["r0"].out
    a, b = plain[3], plain[4]

    def setup(core: _Core) -> None:
        params = _greedy(10)
        params._bad_words_token_ids = [[a, b]]  # as the frontend sets it from bad_words
        core.add(0, params)
        core.add(1, _greedy(10))

    sync = _run(False, setup, steps=11)
    asyn = _run(True, setup, steps=11)
    assert _tokens(asyn) == _tokens(sync)
    assert sync.reqs["r0"].out[:4] == plain[:4] and sync.reqs["r0"].out[4] != b  # the word was banned


def test_unpenalized_batches_do_not_wait() -> None:
    """Without penalties both steps in flight stay unread at the second launch: their tokens are both -1 on the
    host (the second launch took the first's token from the device)."""
    seen = []

    def check_pending(core: _Core) -> list:
        def check() -> None:
            r = core.reqs["r0"]
            if r.ph == 2:
                row = core.runner.input_batch.req_id_to_row["r0"]
                known = len(r.prompt) + len(r.out)
                assert (core.runner.input_batch.token_ids[row, known : known + 2] == PLACEHOLDER_TOKEN).all()
                seen.append(known)

        return [check]

    _run(True, lambda core: core.add(0, _greedy(6)), steps=8, checks=check_pending)
    assert len(seen) == 5  # every launch after the first decode's


def test_logprobs_and_prompt_logprobs_equal_the_sync_run() -> None:
    def setup(core: _Core) -> None:
        core.add(0, _greedy(6, logprobs=3, prompt_logprobs=2))
        core.add(1, SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True, logprobs=0))
        core.add(2, _greedy(6))

    sync = _run(False, setup, steps=8)
    asyn = _run(True, setup, steps=8)
    assert _tokens(asyn) == _tokens(sync)
    for rid in ("r0", "r1"):
        a, s = asyn.reqs[rid], sync.reqs[rid]
        assert len(a.logprobs) == len(s.logprobs) == 6
        for x, y in zip(a.logprobs, s.logprobs):
            assert all(torch.equal(u, v) for u, v in zip(x, y))
    pa, ps = asyn.reqs["r0"].prompt_logprobs, sync.reqs["r0"].prompt_logprobs
    assert len(pa) == len(ps) == 1 and all(torch.equal(u, v) for u, v in zip(pa[0], ps[0]))


def test_the_graph_replay_path_writes_the_previous_tokens_into_the_persistent_buffer() -> None:
    """With (stand-in) decode graphs the previous step's tokens go into the graphs' persistent input ids."""
    sync = _run(False, _three_greedy, steps=14)
    asyn = _run(True, _three_greedy, steps=14, graphs=[1, 2, 4])
    assert _tokens(asyn) == _tokens(sync)
    assert asyn.replays == [(4, 1)] * 11  # every decode step replayed (bucket 4), the prefill ran eager


# ---------------------------------------------------------------------------------------------- contract
def test_a_third_step_in_flight_is_refused() -> None:
    runner = _runner(True)
    core = _Core(runner, True)
    core.add(0, _greedy())
    runner.execute_model(core.schedule(), non_block=True)
    runner.execute_model(core.schedule(), non_block=True)
    with pytest.raises(RuntimeError, match="at most two steps"):
        runner.execute_model(core.schedule(), non_block=True)


def test_a_launch_that_fails_after_sampling_holds_no_ring_slot(monkeypatch) -> None:
    """The engine recovers a failed launch with blocking steps and then launches again: the failed launch must not
    keep a slot of the sampled-ids ring (two more launches in flight still fit)."""
    runner = _runner(True)
    core = _Core(runner, True)
    core.add(0, _greedy())
    batch = runner.input_batch
    real = batch.note_sampled

    def boom(rows, step_id):
        raise RuntimeError("injected")

    monkeypatch.setattr(batch, "note_sampled", boom)
    with pytest.raises(RuntimeError, match="injected"):
        runner.execute_model(core.schedule(), non_block=True)
    monkeypatch.setattr(batch, "note_sampled", real)
    runner.input_batch.remove_request("r0")
    core = _Core(runner, True, record_inputs=False)
    core.add(0, _greedy())
    first = runner.execute_model(core.schedule(), non_block=True)
    second = runner.execute_model(core.schedule(), non_block=True)
    assert len(first.get_output().sampled_token_ids[0]) == len(second.get_output().sampled_token_ids[0]) == 1


def test_non_block_needs_async_scheduling() -> None:
    runner = _runner(False)
    core = _Core(runner, True)
    core.add(0, _greedy())
    with pytest.raises(ValueError, match="async_scheduling"):
        runner.execute_model(core.schedule(), non_block=True)


def test_a_blocking_step_in_async_mode_reads_any_step_left_in_flight() -> None:
    """The sync fallback (a structured-output step) launched with a step left unread (the core never does this;
    the runner still must not race it): it reads that step first and feeds its token from the host."""
    runner = _runner(True)
    core = _Core(runner, True)
    core.add(0, _greedy())
    handle = runner.execute_model(core.schedule(), non_block=True)  # the prefill, sampling token n
    n = len(PROMPTS[0])
    so = SchedulerOutput([], CachedRequestData(["r0"], [[]], [n]), {"r0": 1}, 1, set())
    out = runner.execute_model(so)
    assert not isinstance(out, AsyncModelRunnerOutput) and len(out.sampled_token_ids[0]) == 1
    first = handle.get_output().sampled_token_ids[0]
    assert core.step_inputs[-1] == first  # the blocking step's input came from the host, already filled
    row = runner.input_batch.req_id_to_row["r0"]
    assert runner.input_batch.token_ids[row, n : n + 2].tolist() == first + out.sampled_token_ids[0]


def test_an_id_reused_while_its_old_row_is_in_flight_gets_its_own_tokens() -> None:
    """'x' ends at update(0) while step 1 (holding its row) is in flight; step 2 drops it and adds a new 'x'.
    Step 1's token for the old 'x' must not land in the new one's row, and the new 'x' decodes as it would alone."""
    from vllm_lite.worker.step import NewRequestData

    runner = _runner(True)
    blocks = lambda i: [1 + i * BLOCKS_PER_REQ + j for j in range(BLOCKS_PER_REQ)]  # noqa: E731
    new = lambda rid, prompt, i: NewRequestData(rid, prompt, [], _greedy(), blocks(i), 0)  # noqa: E731
    p_old, p_keep, p_new = PROMPTS[0], PROMPTS[1], PROMPTS[3]
    cached = lambda ids, computed: CachedRequestData(ids, [[] for _ in ids], computed)  # noqa: E731
    h0 = runner.execute_model(
        SchedulerOutput([new("x", p_old, 0), new("keep", p_keep, 1)], cached([], []), {"x": 5, "keep": 11}, 16, set()),
        non_block=True,
    )
    h1 = runner.execute_model(
        SchedulerOutput([], cached(["x", "keep"], [5, 11]), {"x": 1, "keep": 1}, 2, set()), non_block=True
    )
    h0.get_output()  # the core ends 'x' here; its row is still in step 1
    h2 = runner.execute_model(
        SchedulerOutput([new("x", p_new, 2)], cached(["keep"], [12]), {"x": 3, "keep": 1}, 4, {"x"}), non_block=True
    )
    old_x = h1.get_output().sampled_token_ids[0]
    row = runner.input_batch.req_id_to_row["x"]
    assert runner.input_batch.token_ids[row, :4].tolist() == p_new + [PLACEHOLDER_TOKEN]  # step 1 left it alone
    first = h2.get_output().sampled_token_ids[h2.get_output().req_id_to_index["x"]]
    assert runner.input_batch.token_ids[row, :4].tolist() == p_new + first  # not old_x
    h3 = runner.execute_model(SchedulerOutput([], cached(["x"], [3]), {"x": 1}, 1, set()), non_block=True)
    second = h3.get_output().sampled_token_ids[0]

    alone = _Core(_runner(False), False)
    alone.reqs.clear()
    alone.add(3, _greedy(2))
    alone.step()
    alone.step()
    assert first + second == alone.reqs["r3"].out
    assert len(old_x) == 1


# ---------------------------------------------------------------------------------------------- no host syncs
@contextlib.contextmanager
def _device_paths() -> Iterator[None]:
    """The sampler's CUDA code paths on CPU (no numpy fast paths), for counting host reads."""
    saved = sampler_mod.HOST_FAST_PATHS
    sampler_mod.HOST_FAST_PATHS = False
    try:
        yield
    finally:
        sampler_mod.HOST_FAST_PATHS = saved


@pytest.mark.parametrize(
    "params",
    [
        [_greedy(8)] * 3,
        [SamplingParams(temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)] * 3,  # seeded random
        [_greedy(8), SamplingParams(temperature=0.7, seed=9, max_tokens=8, ignore_eos=True), _greedy(8)],  # mixed
        [_greedy(8, logprobs=2)] * 2,
    ],
    ids=["greedy", "seeded", "mixed", "logprobs"],
)
def test_an_async_decode_launch_reads_nothing_back_from_the_device(params: list[SamplingParams]) -> None:
    """Counted on CPU like tests/test_step_op_budget.py (the model forward excluded): an async decode launch,
    the previous step still unread, makes no host read of a device tensor; the same step run synchronously reads
    the sampled ids back (the one sync the async path removes)."""
    for async_ in (True, False):
        runner = _runner(async_)
        core = _Core(runner, async_, record_inputs=False)
        for i, p in enumerate(params):
            core.add(i, p)
        core.step()  # prefill
        core.step()  # first decode (async: step 1 still unread)
        so = core.schedule()
        with _device_paths(), DeviceOpCounter(where=True) as c:
            with _paused_forward(runner, c):
                out = runner.execute_model(so, non_block=async_)
        if async_:
            assert c.syncs == [], c.syncs
            core.in_flight.append(out)
            core.drain()
        else:
            assert len(c.syncs) >= 1


@contextlib.contextmanager
def _paused_forward(runner, counter: DeviceOpCounter) -> Iterator[None]:
    model = runner.model
    orig = model.forward

    def forward(*args, **kwargs):
        with counter.paused():
            return orig(*args, **kwargs)

    model.forward = forward
    try:
        yield
    finally:
        del model.forward


def test_fill_sampled_goes_by_request_id_and_skips_removed_and_readded_requests() -> None:
    from vllm_lite.worker.input_batch import InputBatch
    from vllm_lite.worker.step import NewRequestData

    batch = InputBatch(4, 16, 1, 100, torch.device("cpu"))

    def add(rid: str, prompt: list[int], out: Optional[list[int]] = None) -> None:
        batch.add_request(NewRequestData(rid, prompt, out or [], _greedy(8), [1], 0))

    for rid in ("a", "b", "c"):
        add(rid, [1, 2])
    batch.note_sampled(batch.rows_of(["a", "b", "c"]), step_id=7)
    assert (
        batch.token_ids[:3, 2].tolist() == [PLACEHOLDER_TOKEN] * 3 and batch.sampling.num_output[:3].tolist() == [1] * 3
    )
    batch.remove_request("a")  # c moves into row 0, its placeholder with it
    batch.remove_request("b")
    add("b", [1, 2], [5])  # re-added with its token known: nothing pending
    batch.fill_sampled(["a", "b", "c"], np.array([11, 12, 13]), step_id=7)
    assert batch.req_id_to_row["c"] == 0 and batch.token_ids[0, :3].tolist() == [1, 2, 13]
    assert batch.token_ids[batch.req_id_to_row["b"], :3].tolist() == [1, 2, 5]
    assert (batch.pending_pos == -1).all()
    batch.fill_sampled(["c"], np.array([99]), step_id=7)  # a second fill changes nothing
    assert batch.token_ids[0, 2] == 13


def test_fix_on_device_maps_token_indices_and_sampled_entries() -> None:
    """_fix_on_device's shortcuts (a device arange for dst 0..k-1, `sampled` itself for src 0..S-1) and its copies
    for anything else: dst after a request with every token known, src out of order or a prefix of `sampled`."""
    runner = _runner(True)
    sampled = torch.tensor([70, 71, 72])
    cases = [
        ([0, 1, 2], [0, 1, 2], [0, 1, 2], [70, 71, 72]),
        ([0, 1], [0, 1], [0, 1], [70, 71]),
        ([4, 5], [0, 1], [4, 5], [70, 71]),  # a prefill of 4 tokens runs first
        ([1, 2], [2, 0], [1, 2], [72, 70]),
        ([3], [1], [3], [71]),
    ]
    for dst, src, want_dst, want_ids in cases:
        d, ids = runner._fix_on_device(np.array(dst), np.array(src), sampled)
        assert (d.tolist(), ids.tolist()) == (want_dst, want_ids), (dst, src)
    d, ids = runner._fix_on_device(np.array([0, 1, 2]), np.array([0, 1, 2]), sampled)
    assert ids is sampled  # the steady decode step: no view, no gather


# ---------------------------------------------------------------------------------------------- host staging
class _HostRing(PinnedRing):
    """The CUDA ring's bookkeeping on CPU: ordinary (not pinned) buffers, no device copy, no events."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))
        self.passthrough = False

    def record(self) -> None:
        pass


def test_pinned_ring_stages_arrays_by_value_and_grows_without_moving_earlier_ones(monkeypatch) -> None:
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: real_empty(*a, **k))
    ring = _HostRing()
    ring.begin_step()
    a = np.arange(5, dtype=np.int64)
    b = np.array([1.5, 2.5], dtype=np.float32)
    ta, tb = ring.host(a), ring.host(b)
    a[:] = -7  # the staged copy does not alias the array
    assert ta.tolist() == [0, 1, 2, 3, 4] and tb.tolist() == [1.5, 2.5] and tb.dtype == torch.float32
    assert ta.data_ptr() % 64 == 0 and tb.data_ptr() % 64 == 0
    big = np.ones((600, 300), dtype=np.int64)  # past the first buffer: a new one; the old stays alive
    tbig = ring.host(big)
    assert tbig.shape == (600, 300) and int(tbig.sum()) == 180000 and ta.tolist() == [0, 1, 2, 3, 4]
    tc = ring.host(np.array([7, 8, 9], dtype=np.int64))  # same dtype, in the new buffer: its own typed view
    assert tc.tolist() == [7, 8, 9] and int(tbig.sum()) == 180000 and tb.tolist() == [1.5, 2.5]
    assert ring.host(np.array([[1, 2], [3, 4]], dtype=np.int32)).tolist() == [[1, 2], [3, 4]]
    slot = ring.slot
    ring.begin_step()
    assert ring.slot != slot  # two slots: the next step never writes over this one's arrays
    ring.begin_step()
    assert ring.slot == slot and ring._retired[slot] == []
    assert ring.host(np.array([True, False])).tolist() == [True, False]


def test_a_cpu_ring_is_a_passthrough() -> None:
    ring = PinnedRing(torch.device("cpu"))
    arr = np.arange(3)
    assert ring.stage(arr).data_ptr() == torch.from_numpy(arr).data_ptr()
    sampled = SampledRing(torch.device("cpu"), 4)
    assert sampled.events == [None, None] and sampled.acquire() == 0 and sampled.acquire() == 1
    with pytest.raises(RuntimeError):
        sampled.acquire()
    sampled.release(0)
    assert sampled.acquire() == 0
    head = sampled.head(1, 3)  # a slot's copy destination: kept while the length stays, the slot's memory
    assert sampled.head(1, 3) is head and len(sampled.head(1, 2)) == 2 and sampled.head(0, 2) is not head
    sampled.head(1, 2).copy_(torch.tensor([4, 5]))
    assert sampled.host_views[1][:2].tolist() == [4, 5]


# ---------------------------------------------------------------------------------------------- GPU script
def test_gpu_check_script_smoke_runs_on_cpu(capsys, monkeypatch) -> None:
    script = Path(__file__).resolve().parents[1] / "scripts" / "async_gpu_check.py"
    monkeypatch.setattr(sys, "argv", [str(script), "--device", "cpu", "--smoke"])
    runpy.run_path(str(script), run_name="__main__")
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    import json

    res = json.loads(lines[-1])
    assert res["device"] == "cpu" and res["tokens_identical"] is True, res


def _load_script():
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "scripts" / "async_gpu_check.py"
    spec = importlib.util.spec_from_file_location("async_gpu_check", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_gpu_check_script_reports_every_sync_site_when_a_launch_syncs(monkeypatch) -> None:
    """The script's sync check, with set_sync_debug_mode stood in: a launch that syncs raises under 'error'; the
    script then runs the drive again under 'warn', lists the sites, and still returns the drive's tokens."""
    import warnings

    from vllm_lite.testing.checkpoints import get_checkpoint

    mod = _load_script()
    monkeypatch.setattr(mod, "CHECK_OFF_CUDA", True)
    mode = ["default"]
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda m: mode.__setitem__(0, m))
    runner, bpr = mod._build_runner(get_checkpoint("llama"), torch.device("cpu"), "float32", True, 2, 24)
    orig = runner.execute_model

    def execute_model(so, non_block=False):
        if mode[0] == "error":
            raise RuntimeError("called a synchronizing CUDA operation\nmore")
        if mode[0] == "warn":
            warnings.warn("called a synchronizing CUDA operation", stacklevel=1)
        return orig(so, non_block=non_block)

    monkeypatch.setattr(runner, "execute_model", execute_model)
    prompts = [[5, 6, 7], [8, 9]]
    params = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)] * 2
    out = mod._checked_drive(runner, bpr, True, prompts, params, False)
    check = out["sync_check"]
    assert check["error"] == "called a synchronizing CUDA operation" and len(check["all_syncs"]) == 1
    assert "synchronizing" in check["all_syncs"][0]
    plain, _ = mod._build_runner(get_checkpoint("llama"), torch.device("cpu"), "float32", False, 2, 24)
    assert out["tokens"] == mod._drive(plain, bpr, False, prompts, params, False)["tokens"]
    control = mod._drive(plain, bpr, False, prompts, params, False, sync_check_at=3, sync_mode="warn")
    assert control["tokens"] == out["tokens"] and control["sync_check"] == []  # (CPU: nothing warns)
    monkeypatch.setattr(runner, "execute_model", orig)  # a clean launch passes
    assert mod._checked_drive(runner, bpr, True, prompts, params, False)["sync_check"] == "ok"
