"""A ZMQ fuzzer against a real engine-core process (`vllm-lite serve`), beside an honest tenant.

Random bytes, truncated and bit-flipped frames, unknown and wrong-typed messages, oversized
messages, replays, refused and never-HELLO peers, and well-formed ADDs with every field at
and beyond its limit (over the wire, not in process: tests/reliability/test_core_request_fuzz.py
explores the values themselves). After each batch the core answers a real client, holds no
request and has every block free. Run with -s for the counts.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from vllm_lite.core.core_sockets import max_input_message_bytes
from vllm_lite.testing.target_daemon import MAX_MODEL_LEN, TargetDaemon, rss_mb
from vllm_lite.testing.zmq_fuzz import ZmqFuzzer


@pytest.fixture(scope="module")
def fuzzer(target: TargetDaemon) -> Iterator[ZmqFuzzer]:
    f = ZmqFuzzer(target.addresses, target.token, seed=21)
    f.max_message_bytes = max_input_message_bytes(MAX_MODEL_LEN, f.vocab)
    yield f
    f.close()


@pytest.fixture(autouse=True)
def fresh_problems(fuzzer: ZmqFuzzer) -> None:
    """Counts add up over the module; problems belong to the test that found them."""
    fuzzer.report.problems.clear()


def _after(target: TargetDaemon, fuzzer: ZmqFuzzer, name: str) -> None:
    fuzzer.check_clean()
    target.assert_serves()
    target.wait_clean()
    print("\n" + fuzzer.report.line(f"zmq {name}") + f"\n  core RSS {rss_mb(target.core_pid):.0f} MB")
    assert not fuzzer.report.problems, fuzzer.report.problems
    assert target.proc.poll() is None


def test_malformed_frames_from_attached_and_unknown_peers_are_dropped(target, fuzzer) -> None:
    fuzzer.malformed(150)
    _after(target, fuzzer, "malformed")
    assert fuzzer.report.tried.total() >= 150


def test_refused_and_never_hello_peers_get_nothing_and_run_nothing(target, fuzzer) -> None:
    fuzzer.unauthenticated(8)
    before = rss_mb(target.core_pid)
    fuzzer.never_hello(4, 1 << 20)  # four 1 MB ADDs that must not be decoded
    _after(target, fuzzer, "unauthenticated + never-HELLO")
    print(f"  core RSS before/after the never-HELLO ADDs: {before:.0f} -> {rss_mb(target.core_pid):.0f} MB")


def test_replayed_adds_run_once_at_a_time_and_only_for_their_sender(target, fuzzer) -> None:
    fuzzer.replayed(3)
    _after(target, fuzzer, "replayed")


def test_another_tenant_s_abort_never_cancels_or_silences_my_request(target, fuzzer) -> None:
    fuzzer.foreign_aborts(10)  # the ABORT must land in the same input batch as the ADD: try often
    _after(target, fuzzer, "foreign aborts")


def test_every_sampling_field_at_and_beyond_its_limit_over_the_wire(target, fuzzer) -> None:
    fuzzer.hostile()
    _after(target, fuzzer, "hostile ADDs")
    assert fuzzer.report.outcomes["at->ran"] > 0 and fuzzer.report.outcomes["beyond->ran"] == 0


def test_oversized_messages_drop_only_their_connection(target, fuzzer) -> None:
    assert fuzzer.max_message_bytes is not None
    fuzzer.oversized(2, fuzzer.max_message_bytes + 1024)
    _after(target, fuzzer, "oversized")
