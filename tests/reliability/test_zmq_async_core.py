"""A core serving with async scheduling (the default on CUDA) answers a utility call after every output of the
steps before it, as a synchronous core does.

The call drains the steps in flight; their outputs used to wait for the next busy-loop step while the answer
went out at once, so a client that polled `get_num_unfinished_requests` down to 0 had not yet been sent the
last outputs (the zmq fuzzer's replay and foreign-abort attacks then saw requests finish never, or twice). On
CPU async scheduling is off unless asked for: this module asks, so CI covers the CUDA default's ordering.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from vllm_lite.testing.target_daemon import TargetDaemon
from vllm_lite.testing.zmq_fuzz import ZmqFuzzer, valid_add_frames


@pytest.fixture(scope="module")
def async_target() -> Iterator[TargetDaemon]:
    daemon = TargetDaemon(extra_args=["--async-scheduling"], headless=True)
    try:
        assert "async scheduling: on" in daemon.log(), daemon.log()[-2000:]
        yield daemon
    finally:
        daemon.stop()


@pytest.fixture(scope="module")
def fuzzer(async_target: TargetDaemon) -> Iterator[ZmqFuzzer]:
    f = ZmqFuzzer(async_target.addresses, async_target.token, seed=5)  # no oversized attack: no size limit
    yield f
    f.close()


def test_every_output_arrives_before_the_answer_that_says_nothing_is_unfinished(fuzzer: ZmqFuzzer) -> None:
    rids = [fuzzer.rid("ordered") for _ in range(4)]
    for n, rid in enumerate(rids):
        fuzzer.peer.send_frames(valid_add_frames(rid, [9, 8, 7 + n], max_tokens=5 + n))
    fuzzer.peer.settle()  # returns at the first answer of 0 unfinished
    for n, rid in enumerate(rids):
        outs = fuzzer.peer.outputs.pop(rid, [])
        finished = [str(o.finish_reason) for o in outs if o.finish_reason is not None]
        assert finished == ["length"], (rid, outs)
        assert sum(len(o.new_token_ids) for o in outs) == 5 + n


def test_replays_and_foreign_aborts_keep_their_outcomes_under_async_scheduling(fuzzer: ZmqFuzzer) -> None:
    fuzzer.replayed(2)
    fuzzer.foreign_aborts(4)
    fuzzer.check_clean()
    assert not fuzzer.report.problems, fuzzer.report.problems
