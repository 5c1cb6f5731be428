"""ClientRegistry: who may attach, who owns which request, and what dropping and taking back do."""

from __future__ import annotations

import logging

from vllm_lite.core.client_registry import ClientRegistry
from vllm_lite.core.messages import PROTOCOL_VERSION, HelloRequest
from vllm_lite.log_limiter import LogLimiter


def hello(token: str | None = None, version: int = PROTOCOL_VERSION, name: str = "fe") -> HelloRequest:
    return HelloRequest(protocol_version=version, auth_token=token, client_name=name)


def test_hello_with_the_right_token_attaches_with_a_fresh_index_and_regreeting_keeps_it():
    reg = ClientRegistry(auth_token="s3cret")
    a, why = reg.hello(b"a", hello("s3cret", name="first"))
    b, _ = reg.hello(b"b", hello("s3cret"))
    assert why is None and (a.index, b.index) == (0, 1) and a.name == "first"
    again, _ = reg.hello(b"a", hello("s3cret"))
    assert again is a and len(reg) == 2 and reg.by_index(1) is b


def test_wrong_token_wrong_version_and_shutdown_are_refused_with_a_reason():
    reg = ClientRegistry(auth_token="s3cret")
    assert reg.hello(b"x", hello("nope")) == (None, "wrong auth token")
    assert reg.hello(b"x", hello(None)) == (None, "wrong auth token")
    client, why = reg.hello(b"x", hello("s3cret", version=PROTOCOL_VERSION + 1))
    assert client is None and "protocol version mismatch" in why
    assert reg.hello(b"x", hello("s3cret"), accepting=False) == (None, "engine core is shutting down")
    assert len(reg) == 0 and not reg.touch(b"x")


def test_no_token_configured_accepts_any_frontend():
    client, why = ClientRegistry().hello(b"a", hello("whatever"))
    assert client is not None and why is None


def test_unknown_identity_is_not_looked_up_and_the_warning_is_rate_limited(caplog):
    reg = ClientRegistry(drop_log=LogLimiter(logging.getLogger("test-registry"), burst=2))
    with caplog.at_level(logging.WARNING, logger="test-registry"):
        assert all(reg.lookup(b"stranger", "ADD") is None for _ in range(5))
    assert len([r for r in caplog.records if "has not said HELLO" in r.message]) == 2


def test_ownership_is_per_frontend_and_release_frees_it():
    reg = ClientRegistry()
    a, _ = reg.hello(b"a", hello())
    b, _ = reg.hello(b"b", hello())
    reg.own(a, "r1")
    reg.own(a, "r2")
    assert reg.owner("r1") is a and reg.mine(b, ["r1", "r2"]) == [] and reg.mine(a, ["r2", "x"]) == ["r2"]
    reg.release("r1")
    assert reg.owner("r1") is None and a.request_ids == {"r2"}
    assert reg.list_frontends() == [
        {"client_index": 0, "name": "fe", "num_requests": 1},
        {"client_index": 1, "name": "fe", "num_requests": 0},
    ]


def test_dropped_for_silence_gives_back_its_requests_and_is_taken_back_when_it_speaks():
    reg = ClientRegistry()
    a, _ = reg.hello(b"a", hello(name="slow"))
    reg.own(a, "r2")
    reg.own(a, "r1")
    assert [c for c, _ in reg.silent(10.0, now=1e12)] == [a]
    assert reg.drop(a) == ["r1", "r2"]
    assert len(reg) == 0 and reg.owner("r1") is None and reg.was_dropped(b"a") and not reg.touch(b"a")
    back = reg.lookup(b"a", "ABORT")
    assert back is not None and back.name == "slow" and back.index == 1 and not reg.was_dropped(b"a")
    assert reg.touch(b"a") and reg.silent(10.0) == []


def test_goodbye_drop_is_forgotten_and_memory_of_dropped_frontends_is_bounded():
    reg = ClientRegistry(max_remembered_dropped=2)
    gone, _ = reg.hello(b"gone", hello())
    reg.drop(gone, may_return=False)
    assert reg.lookup(b"gone", "HEARTBEAT") is None
    for ident in (b"1", b"2", b"3"):
        reg.drop(reg.hello(ident, hello())[0])
    assert [reg.was_dropped(i) for i in (b"1", b"2", b"3")] == [False, True, True]


def test_release_all_hands_over_every_live_request_once():
    reg = ClientRegistry()
    a, _ = reg.hello(b"a", hello())
    b, _ = reg.hello(b"b", hello())
    reg.hello(b"idle", hello())
    reg.own(a, "y")
    reg.own(a, "x")
    reg.own(b, "z")
    assert [(c.identity, ids) for c, ids in reg.release_all()] == [(b"a", ["x", "y"]), (b"b", ["z"])]
    assert reg.release_all() == [] and reg.owner("x") is None


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_each_kind_of_refusal_has_its_own_budget_and_held_back_counts_are_reported(caplog):
    """A spray of one kind (malformed frames) must not silence another (wrong-token HELLOs); once the window
    ends, flush() reports how many of each were held back even if no further warning comes."""
    clock = _Clock()
    limiter = LogLimiter(logging.getLogger("test-limiter"), burst=2, window_s=60.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="test-limiter"):
        for i in range(10):
            limiter.warn("Dropped malformed message %d", i)
        for i in range(3):
            limiter.warn("Refused frontend %d", i)
        assert limiter.suppressed == 8 + 1
        clock.now = 30.0
        limiter.flush()  # window not over: nothing reported yet
        assert not [r for r in caplog.records if "suppressed" in r.message]
        clock.now = 61.0
        limiter.flush()
    messages = [r.getMessage() for r in caplog.records]
    assert [m for m in messages if m.startswith("Dropped")] == [
        "Dropped malformed message 0",
        "Dropped malformed message 1",
    ]
    assert [m for m in messages if m.startswith("Refused")] == ["Refused frontend 0", "Refused frontend 1"]
    summaries = sorted(m for m in messages if "suppressed" in m)
    assert summaries == [
        "(1 more like 'Refused frontend %d' suppressed in 60 s)",
        "(8 more like 'Dropped malformed message %d' suppressed in 60 s)",
    ]
    assert limiter.suppressed == 0
    with caplog.at_level(logging.WARNING, logger="test-limiter"):
        limiter.warn("Refused frontend %d", 99)  # a fresh window: logged again
    assert caplog.records[-1].getMessage() == "Refused frontend 99"
