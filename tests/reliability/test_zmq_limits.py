"""The core's sockets parse nothing for strangers and cap what anyone may send.

Before, a peer that never said HELLO could send 40 MB ADDs that the core decoded before it
looked at the sender (core RSS 485 -> 1662 MB, a real client 3 s -> 10 s), and a wrong-token
HELLO spray wrote unthrottled warnings. Here a ThreadedCore (the real socket loop over a fake
engine, in this process) is probed with raw DEALER sockets, and its counters say what it decoded.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from vllm_lite.core.core_sockets import MAX_HELLO_BYTES, max_input_message_bytes
from vllm_lite.core.messages import PROTOCOL_VERSION, EngineCoreRequestType, FinishReason, HelloRequest
from vllm_lite.testing.fake_core import RawFrontend, ThreadedCore, fake_token, request
from vllm_lite.testing.waiting import wait_until

DEADLINE_S = 60.0
# Small enough that the test's oversized message is cheap, big enough for every normal request.
LIMIT = 256 * 1024


@pytest.fixture(scope="module")
def core() -> Iterator[ThreadedCore]:
    c = ThreadedCore(heartbeat_timeout_s=600.0, max_message_bytes=LIMIT)
    yield c
    c.stop()


def _big_add(rid: str, n_tokens: int) -> object:
    return request(rid, [1] * n_tokens, max_tokens=2)


def test_a_stranger_s_large_add_is_never_decoded_and_a_real_client_is_served(core: ThreadedCore) -> None:
    real = core.frontend()
    stranger = RawFrontend(core.ctx, core.addresses)  # never says HELLO
    sockets = core.proc.sockets
    decoded, refused = sockets.decoded_messages, sockets.undecoded_refusals
    # ~200 KB of valid msgpack under the size limit, five times: only the socket type byte is read.
    for i in range(5):
        stranger.send(EngineCoreRequestType.ADD, _big_add(f"stranger-{i}", 40_000))
    stranger.inp.send(EngineCoreRequestType.HEARTBEAT.value)
    wait_until(lambda: sockets.undecoded_refusals == refused + 6, DEADLINE_S, "6 stranger messages refused")
    assert sockets.decoded_messages == decoded  # not one of them decoded
    assert not core.proc.engine_core.reqs  # and none reached the engine
    real.send(EngineCoreRequestType.ADD, request("real", [3, 4], max_tokens=3))
    got = real.collect({"real"}, timeout_s=DEADLINE_S)
    assert [t for o in got["real"] for t in o.new_token_ids] == [fake_token([3, 4], n) for n in range(3)]
    assert got["real"][-1].finish_reason == FinishReason.LENGTH


def test_an_oversized_hello_is_refused_without_decoding(core: ThreadedCore) -> None:
    sockets = core.proc.sockets
    refused = sockets.undecoded_refusals
    stranger = RawFrontend(core.ctx, core.addresses)
    stranger.send(EngineCoreRequestType.HELLO, HelloRequest(PROTOCOL_VERSION, "x" * (2 * MAX_HELLO_BYTES), "big"))
    wait_until(lambda: sockets.undecoded_refusals > refused, DEADLINE_S, "the big HELLO is refused")
    with pytest.raises(TimeoutError):
        stranger.recv(timeout_s=0.3)  # no READY, no REFUSED: it was never parsed


def test_a_message_over_the_size_limit_drops_that_connection_not_the_core(core: ThreadedCore) -> None:
    big = core.frontend()
    other = core.frontend()
    core.proc.engine_core.step_delay = 0.05  # "kept" runs for ~10 s unless aborted
    big.send(EngineCoreRequestType.ADD, request("kept", [5], max_tokens=200))
    other.send(EngineCoreRequestType.ADD, request("other", [6], max_tokens=2))
    assert other.collect({"other"}, timeout_s=DEADLINE_S)["other"][-1].finish_reason == FinishReason.LENGTH
    wait_until(lambda: "kept" in core.proc.engine_core.reqs, DEADLINE_S, "the first request runs")
    disconnects = core.proc.sockets.disconnects
    # More than LIMIT bytes: libzmq closes this connection before any of it is queued.
    big.send(EngineCoreRequestType.ADD, _big_add("huge", LIMIT))
    wait_until(lambda: core.proc.sockets.disconnects > disconnects, DEADLINE_S, "the connection is dropped")
    # Its frontend counts as gone (its request aborted); the core and the other frontend carry on.
    wait_until(lambda: "kept" not in core.proc.engine_core.reqs, DEADLINE_S, "the dropped frontend's request ends")
    assert "huge" not in core.proc.engine_core.reqs
    assert other.utility("ping").result == "pong"
    assert core.thread.is_alive()
    core.proc.engine_core.step_delay = 0.0


def test_wrong_token_hellos_are_refused_with_rate_limited_warnings(caplog: pytest.LogCaptureFixture) -> None:
    c = ThreadedCore(auth_token="right")
    try:
        burst = c.proc.registry.drop_log.burst
        with caplog.at_level(logging.WARNING, logger="vllm_lite.core"):
            fe = RawFrontend(c.ctx, c.addresses)
            for i in range(burst + 30):
                reply = fe.hello(token=f"wrong-{i}")
                assert not reply.accepted and reply.reason == "wrong auth token"
        refusals = [r for r in caplog.records if "Refused frontend" in r.getMessage()]
        assert len(refusals) == burst  # the rest are counted, reported once per window
    finally:
        c.stop()


def test_the_default_limit_fits_the_largest_legitimate_request() -> None:
    # A max_model_len prompt plus allowed_token_ids and a logit_bias over the whole vocabulary.
    max_model_len, vocab = 32_768, 152_064
    worst = 9 * max_model_len + 9 * vocab + 18 * vocab
    assert max_input_message_bytes(max_model_len, vocab) > worst + (8 << 20)
    assert max_input_message_bytes(max_model_len, vocab) < 64 << 20  # the 100 MB frames are refused
