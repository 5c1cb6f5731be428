"""ClientRegistry details the core's socket loop relies on: lookups of attached frontends, dropping twice,
the silence boundary, and the log lines an operator reads when frontends come back or were never known."""

from __future__ import annotations

import logging

from vllm_lite.core.client_registry import ClientRegistry
from vllm_lite.core.messages import PROTOCOL_VERSION, HelloRequest


def hello(name: str = "fe") -> HelloRequest:
    return HelloRequest(protocol_version=PROTOCOL_VERSION, auth_token=None, client_name=name)


def test_a_message_from_an_attached_frontend_finds_it() -> None:
    reg = ClientRegistry()
    a, _ = reg.hello(b"a", hello())
    b, _ = reg.hello(b"b", hello())
    assert reg.lookup(b"a", "ADD") is a and reg.lookup(b"b", "ABORT") is b
    assert reg.get(b"a") is a and reg.get(b"zz") is None


def test_dropping_a_frontend_twice_is_harmless_and_frees_its_index() -> None:
    reg = ClientRegistry()
    a, _ = reg.hello(b"a", hello())
    reg.own(a, "r1")
    assert reg.drop(a, may_return=False) == ["r1"]
    assert reg.by_index(a.index) is None and reg.get(b"a") is None and reg.owner("r1") is None
    assert reg.drop(a, may_return=False) == []  # e.g. its GOODBYE, then its socket closing
    assert reg.silent(0.0, now=1e12) == []


def test_a_frontend_silent_exactly_as_long_as_the_timeout_is_not_yet_silent() -> None:
    reg = ClientRegistry()
    a, _ = reg.hello(b"a", hello())
    seen = reg._last_seen[b"a"]
    # Expectations in the registry's own float arithmetic: (seen + 5.0) - seen need not be 5.0 on a clock
    # with fractional seconds (10.000000000000014 for 10.0 was seen), so the timeout is that exact silence.
    now = seen + 5.0
    assert reg.silent(now - seen, now=now) == []
    assert reg.silent(now - seen, now=seen + 5.5) == [(a, (seen + 5.5) - seen)]


def test_the_log_says_which_frontend_came_back_and_what_a_stranger_sent(caplog) -> None:
    reg = ClientRegistry()
    a, _ = reg.hello(b"a", hello("svc"))
    reg.drop(a)
    with caplog.at_level(logging.INFO, logger="vllm_lite.core.client_registry"):
        back = reg.lookup(b"a", "HEARTBEAT")
        assert reg.lookup(b"\x01\x02", "ADD") is None
    assert back is not None and back.index == 1
    messages = [r.getMessage() for r in caplog.records]
    assert "Frontend 'svc' came back; re-attached as client 1." in messages
    assert "Dropped ADD from frontend 0102 that has not said HELLO." in messages


def test_indices_keep_counting_and_a_returning_frontend_is_no_longer_remembered_as_dropped() -> None:
    reg = ClientRegistry()
    clients = [reg.hello(bytes([i]), hello())[0] for i in range(3)]
    assert [c.index for c in clients] == [0, 1, 2]
    reg.drop(clients[0])
    assert reg.was_dropped(b"\x00")
    again, _ = reg.hello(b"\x00", hello())
    assert again.index == 3 and not reg.was_dropped(b"\x00")


def test_a_frontend_taken_back_is_watched_for_silence_again() -> None:
    reg = ClientRegistry()
    a, _ = reg.hello(b"a", hello())
    reg.drop(a)
    back = reg.lookup(b"a", "HEARTBEAT")
    since = reg._last_seen[b"a"]
    now = since + 10.0
    assert reg.silent(5.0, now=now) == [(back, now - since)]  # the registry's float arithmetic, not exactly 10.0


def test_releasing_an_unknown_or_already_released_request_is_harmless() -> None:
    reg = ClientRegistry()
    a, _ = reg.hello(b"a", hello())
    reg.own(a, "r")
    reg.release("r")
    reg.release("r")
    reg.release("never")
    assert a.request_ids == set() and reg.owner("r") is None


def test_the_log_names_refused_and_attached_frontends(caplog) -> None:
    reg = ClientRegistry(auth_token="tok")
    long_name = "n" * 150
    with caplog.at_level(logging.INFO, logger="vllm_lite.core.client_registry"):
        reg.hello(b"\xab", HelloRequest(protocol_version=PROTOCOL_VERSION, auth_token="bad", client_name=long_name))
        reg.hello(b"\xcd", HelloRequest(protocol_version=PROTOCOL_VERSION, auth_token="tok", client_name="svc"))
    messages = [r.getMessage() for r in caplog.records]
    assert f"Refused frontend {'n' * 100!r} (ab): wrong auth token." in messages
    assert "Frontend 'svc' attached as client 0." in messages
