"""ADD_BATCH on the wire: per-request validation, and the core holding its steps until a batch's last part.

The busy loop runs in a thread of this process against FakeEngineCore (vllm_lite.testing.fake_core), so
these tests are about the protocol, not the model.
"""

from __future__ import annotations

import pytest

from vllm_lite.core import engine_core_proc
from vllm_lite.core.messages import (
    EngineCoreOutputType,
    EngineCoreRequestBatch,
    EngineCoreRequestType,
    FinishReason,
    UtilityRequest,
)
from vllm_lite.testing.fake_core import RawFrontend, ThreadedCore, fake_token, request

DEADLINE_S = 60.0


@pytest.fixture
def core():
    c = ThreadedCore()
    yield c
    c.stop()


def _token_outputs_before_utility_reply(fe: RawFrontend, call_id: int) -> list[str]:
    """Ask the core a utility question; ids of every token output that reached us before its answer."""
    fe.send(EngineCoreRequestType.UTILITY, UtilityRequest(0, call_id, "ping", []))
    seen: list[str] = []
    while True:
        kind, outs = fe.recv(DEADLINE_S)
        if kind is not EngineCoreOutputType.OUTPUTS:
            continue
        seen += [o.request_id for o in outs.outputs if o.new_token_ids]
        if outs.utility_output is not None and outs.utility_output.call_id == call_id:
            return seen


def test_a_batch_is_validated_per_request(core):
    fe = core.frontend()
    good = [request("a", [1, 2, 3], max_tokens=3), request("b", [4, 5], max_tokens=2)]
    bad = request("bad", [], max_tokens=2)  # an empty prompt: the core refuses it
    fe.send(EngineCoreRequestType.ADD_BATCH, EngineCoreRequestBatch([good[0], bad, good[1]]))
    got = fe.collect({"a", "b", "bad"}, timeout_s=DEADLINE_S)
    assert got["bad"][-1].finish_reason == FinishReason.ERROR
    assert [o.new_token_ids[0] for o in got["a"]] == [fake_token([1, 2, 3], n) for n in range(3)]
    assert [o.new_token_ids[0] for o in got["b"]] == [fake_token([4, 5], n) for n in range(2)]


def test_the_core_holds_its_steps_until_the_last_part(core):
    fe = core.frontend()
    fe.send(EngineCoreRequestType.ADD_BATCH, EngineCoreRequestBatch([request("p1", [1, 2], max_tokens=2)], more=True))
    # Two utility round trips: the loop has gone round with p1 queued; without the hold it would have stepped,
    # and that step's outputs would have reached us before the second answer (one ordered output socket).
    assert _token_outputs_before_utility_reply(fe, 1) == []
    assert _token_outputs_before_utility_reply(fe, 2) == []
    fe.send(EngineCoreRequestType.ADD_BATCH, EngineCoreRequestBatch([request("p2", [3], max_tokens=2)]))
    got = fe.collect({"p1", "p2"}, timeout_s=DEADLINE_S)
    first_step = {rid for rid, outs in got.items() if outs[0].new_token_ids}
    assert first_step == {"p1", "p2"}
    assert all(len(outs) == 2 for outs in got.values())


def test_a_batch_whose_last_part_never_comes_runs_after_the_hold(core, monkeypatch):
    monkeypatch.setattr(engine_core_proc, "BATCH_HOLD_S", 0.5)
    fe = core.frontend()
    fe.send(EngineCoreRequestType.ADD_BATCH, EngineCoreRequestBatch([request("lone", [1], max_tokens=2)], more=True))
    got = fe.collect({"lone"}, timeout_s=DEADLINE_S)
    assert got["lone"][-1].finish_reason == FinishReason.LENGTH
