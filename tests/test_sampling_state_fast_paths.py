"""SamplingState's per-step fast paths (issue #14): whether any row reads its tokens' values is cached until a row is
added, removed or moved, and the row and token checks are one max over a uint64 view. The cached answer must follow
every such change (a penalty or bad-word row added after the cache was filled must get its tokens recorded), and the
checks must still refuse negative and too-large ids when no row records values."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_lite.sampling_params import SamplingParams
from vllm_lite.worker.sampling_state import SamplingState

V, R, L = 50, 4, 32


def _state() -> SamplingState:
    return SamplingState(R, V, L, torch.device("cpu"))


def _plain() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=8)


def _seen(s: SamplingState, row: int) -> dict[int, int]:
    assert s.seen is not None
    tokens, counts = s.seen.gather(np.array([row], np.int64))
    return {int(t): int(c) for t, c in zip(tokens.reshape(-1), counts.reshape(-1)) if c > 0}


def test_values_flag_follows_add_remove_move_and_tokens_are_recorded() -> None:
    s = _state()
    s.add_request(0, _plain(), [1, 2], [], None)
    assert not s.any_needs_token_values()  # cached: False
    s.record_values(np.array([0]), np.array([5]), np.array([0]))
    s.count_sampled(np.array([0]))

    s.add_request(1, SamplingParams(temperature=0.0, max_tokens=8, repetition_penalty=1.3), [3], [], None)
    assert s.any_needs_token_values()  # the add must drop the cached False
    assert s.needs_token_values(np.array([1])) and not s.needs_token_values(np.array([0]))
    s.record_values(np.array([0, 1]), np.array([6, 7]), np.array([1, 0]))
    assert _seen(s, 1) == {7: 1}
    s.append_token_ids(np.array([0, 1]), np.array([8, 7]))  # the synchronous path takes the same answer
    assert _seen(s, 1) == {7: 2}
    assert s.num_output[:2].tolist() == [2, 1]  # row 0: count_sampled + append; row 1: append

    s.remove_request(1)
    assert not s.any_needs_token_values()

    words = SamplingParams(temperature=0.0, max_tokens=8, _bad_words_token_ids=[[4, 9]])
    s.add_request(2, words, [1], [], None)
    assert s.any_needs_token_values()
    s.record_values(np.array([2]), np.array([4]), np.array([0]))
    assert s.history is not None and s.history[2, 0] == 4
    s.move_row(2, 1)  # moved: the cache is rebuilt and still answers True
    assert s.any_needs_token_values() and s.tracks_history[1]
    s.record_values(np.array([1]), np.array([11]), np.array([1]))
    assert s.history[1, :2].tolist() == [4, 11]
    s.remove_request(1)
    assert not s.any_needs_token_values()


def test_values_flag_answer_equals_a_fresh_scan() -> None:
    """Random adds, removes and moves: the cached answer always equals scanning the rows."""
    rng = np.random.default_rng(0)
    s = _state()
    for _ in range(200):
        op = rng.integers(3)
        row = int(rng.integers(R))
        if op == 0:
            pen = bool(rng.integers(2))
            params = SamplingParams(temperature=0.0, max_tokens=8, presence_penalty=0.5 if pen else 0.0)
            s.add_request(row, params, [1], [], None)
        elif op == 1:
            s.remove_request(row)
        else:
            s.move_row(row, int(rng.integers(R)))
        assert s.any_needs_token_values() == bool((s.penalized | s.tracks_history).any())


@pytest.mark.parametrize("bad", [-1, V, 2**40, -(2**40)])
def test_token_checks_without_value_rows(bad: int) -> None:
    s = _state()
    s.add_request(0, _plain(), [1], [], None)
    assert not s.any_needs_token_values()
    with pytest.raises(ValueError, match="token_ids must be in"):
        s.record_values(np.array([0]), np.array([bad]), np.array([0]))
    with pytest.raises(ValueError, match="token_ids must be in"):
        s.append_token_ids(np.array([0]), np.array([bad]))
    with pytest.raises(ValueError, match="token_ids must be in"):
        s.check_token_ids(np.array([3, bad]))  # InputBatch.fill_pending's check when no row keeps values
    s.check_token_ids(np.array([0, V - 1]))
    s.check_token_ids(np.zeros(0, np.int64))
    assert s.num_output[0] == 0  # nothing counted by a refused call


@pytest.mark.parametrize("bad", [-1, R, -(2**40)])
def test_row_checks(bad: int) -> None:
    s = _state()
    s.add_request(0, _plain(), [1], [], None)
    for call in (
        lambda: s.count_sampled(np.array([0, bad])),
        lambda: s.record_values(np.array([bad]), np.array([1]), np.array([0])),
        lambda: s.append_token_ids(np.array([bad]), np.array([1])),
    ):
        with pytest.raises(ValueError, match="rows must be in"):
            call()
    assert s.num_output.tolist() == [0] * R


def test_metadata_cache_misses_on_reordered_rows() -> None:
    """The cached metadata is keyed by the rows' bytes: the same rows in another order build anew."""
    s = _state()
    s.add_request(0, SamplingParams(temperature=0.5, max_tokens=8), [1], [], None)
    s.add_request(1, SamplingParams(temperature=0.9, max_tokens=8), [1], [], None)
    a = s.make_metadata(np.array([0, 1]))
    assert s.make_metadata(np.array([0, 1])) is a
    b = s.make_metadata(np.array([1, 0]))
    assert b is not a and b.temperature is not None
    assert b.temperature.tolist() == pytest.approx([0.9, 0.5])
    c = s.make_metadata(np.array([1]))
    assert c.num_rows == 1 and c.temperature is not None and c.temperature.tolist() == pytest.approx([0.9])


@pytest.mark.parametrize("penalized", [False, True])
@pytest.mark.parametrize("bad", [-1, V])
def test_fill_pending_refuses_ids_outside_the_vocabulary(penalized: bool, bad: int) -> None:
    """InputBatch.fill_pending checks the ids whether or not a row keeps their values (record_values or the check
    alone)."""
    from vllm_lite.worker.input_batch import InputBatch
    from vllm_lite.worker.step import NewRequestData

    batch = InputBatch(2, L, 2, V, torch.device("cpu"))
    params = SamplingParams(temperature=0.0, max_tokens=8, repetition_penalty=1.2 if penalized else 1.0)
    batch.add_request(NewRequestData("a", [1, 2], [], params, [1], 1))
    batch.note_sampled(np.array([0]), 1)
    with pytest.raises(ValueError, match="token_ids must be in"):
        batch.fill_pending(np.array([bad]), 1)
    batch.note_sampled(np.array([0]), 2)
    batch.fill_pending(np.array([7]), 2)  # a valid id goes through
    assert batch.token_ids[0, 3] == 7
