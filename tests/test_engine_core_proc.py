"""EngineCoreProc: the socket protocol, routing, robustness and lifecycle of the core process.

Most tests run the busy loop in a thread of this process (no spawn cost) and
talk to it with raw ZMQ DEALER sockets, so they test the wire protocol itself.
`FakeEngineCore` (vllm_lite.testing.fake_core) has EngineCore's interface over a
deterministic token rule: these tests are about transport, not the model.
"""

from __future__ import annotations

import os
import signal
from typing import Any, Optional

import pytest
import torch
import zmq

from vllm_lite import launcher
from vllm_lite.config import encode_vllm_config
from vllm_lite.core.engine_core_proc import CoreProcOptions, set_core_thread_policy
from vllm_lite.core.messages import (
    PROTOCOL_VERSION,
    EngineCoreArgs,
    EngineCoreOutputType,
    EngineCoreReady,
    EngineCoreRequestType,
    FinishReason,
    UtilityRequest,
)
from vllm_lite.endpoints import CoreAddresses
from vllm_lite.serialization import MsgpackEncoder
from vllm_lite.testing.fake_core import (
    FAKE_CORE_MODULE,
    VOCAB,
    FakeEngineCoreProc,
    RawFrontend,
    ThreadedCore,
    fake_config,
    fake_token,
    make_addresses,
    request,
)
from vllm_lite.testing.waiting import wait_until

# Generous: a loaded 2-core machine only makes these tests slower, never wrong.
DEADLINE_S = 60.0


@pytest.fixture
def core():
    c = ThreadedCore()
    yield c
    c.stop()


# ---------------------------------------------------------------------------------------------------- protocol


def test_handshake_returns_model_facts_and_distinct_client_indexes(core):
    a = RawFrontend(core.ctx, core.addresses).hello()
    b = RawFrontend(core.ctx, core.addresses).hello()
    assert a.accepted and b.accepted
    assert {a.client_index, b.client_index} == {0, 1}
    assert a.model == "fake-model" and a.max_model_len == 256 and a.block_size == 16
    assert a.num_gpu_blocks == 256 and a.vocab_size == VOCAB and a.protocol_version == PROTOCOL_VERSION


def test_outputs_go_only_to_the_frontend_that_sent_the_request(core):
    a, b = core.frontend(), core.frontend()
    # Both claim client_index 0: the core must route by identity, not by the field.
    a.send(EngineCoreRequestType.ADD, request("ra", [1, 2, 3], max_tokens=5))
    b.send(EngineCoreRequestType.ADD, request("rb", [9, 9], max_tokens=3))
    got_a = a.collect({"ra"})
    got_b = b.collect({"rb"})
    assert set(got_a) == {"ra"} and set(got_b) == {"rb"}
    assert [o.new_token_ids[0] for o in got_a["ra"]] == [fake_token([1, 2, 3], n) for n in range(5)]
    assert [o.new_token_ids[0] for o in got_b["rb"]] == [fake_token([9, 9], n) for n in range(3)]
    assert got_a["ra"][-1].finish_reason == FinishReason.LENGTH
    with pytest.raises(TimeoutError):
        a.recv(timeout_s=0.3)


def test_logprob_tensors_cross_the_socket(core):
    a = core.frontend()
    a.send(EngineCoreRequestType.ADD, request("lp", [5, 6], max_tokens=2, logprobs=3))
    outs = a.collect({"lp"})["lp"]
    lp = outs[0].new_logprobs
    assert isinstance(lp.logprobs, torch.Tensor) and lp.logprobs.shape == (1, 4)
    assert lp.logprob_token_ids[0, 0].item() == fake_token([5, 6], 0)


def test_wrong_auth_token_is_refused_with_reason():
    c = ThreadedCore(auth_token="sesame")
    try:
        bad = RawFrontend(c.ctx, c.addresses).hello(token="nope")
        assert not bad.accepted and "wrong auth token" in bad.reason
        missing = RawFrontend(c.ctx, c.addresses).hello(token=None)
        assert not missing.accepted and "wrong auth token" in missing.reason
        good = RawFrontend(c.ctx, c.addresses).hello(token="sesame")
        assert good.accepted
    finally:
        c.stop()


def test_wrong_protocol_version_is_refused_with_reason(core):
    reply = RawFrontend(core.ctx, core.addresses).hello(version=PROTOCOL_VERSION + 41)
    assert not reply.accepted and "protocol version mismatch" in reply.reason


def test_garbage_and_wrong_type_frames_are_dropped_and_core_keeps_serving(core):
    a = core.frontend()
    enc = MsgpackEncoder()
    a.inp.send_multipart([b"\x99", b"whatever"])  # unknown type byte
    a.inp.send_multipart([EngineCoreRequestType.ADD.value, b"\xc1\xc1\xc1"])  # not msgpack
    a.inp.send_multipart([EngineCoreRequestType.ADD.value, *enc.encode(UtilityRequest(0, 1, "ping"))])  # wrong struct
    a.inp.send_multipart([EngineCoreRequestType.ADD.value])  # no payload
    a.inp.send(b"")  # empty type frame
    a.inp.send_multipart([EngineCoreRequestType.ABORT.value, *enc.encode({"not": "a list"})])
    a.inp.send_multipart([EngineCoreRequestType.ADD.value, *enc.encode(["r", [1], {"temperature": -5.0}, None, 0.0])])
    a.inp.send_multipart([EngineCoreRequestType.UTILITY.value, os.urandom(64)])
    # A stranger that never said HELLO is ignored.
    stranger = RawFrontend(core.ctx, core.addresses)
    stranger.send(EngineCoreRequestType.ADD, request("s", [1], max_tokens=2))
    a.send(EngineCoreRequestType.ADD, request("ok", [4, 4], max_tokens=2))
    got = a.collect({"ok"})
    assert set(got) == {"ok"} and len(got["ok"]) == 2
    with pytest.raises(TimeoutError):
        stranger.recv(timeout_s=0.3)
    assert a.utility("ping").result == "pong"
    assert core.thread.is_alive()


def test_duplicate_request_id_gets_error_without_disturbing_the_first(core):
    a = core.frontend()
    core.proc.engine_core.step_delay = 0.02
    a.send(EngineCoreRequestType.ADD, request("dup", [1, 2], max_tokens=6))
    a.send(EngineCoreRequestType.ADD, request("dup", [7, 7], max_tokens=6))
    got = a.collect({"dup"})["dup"]
    errors = [o for o in got if o.finish_reason == FinishReason.ERROR]
    assert len(errors) == 1 and "duplicate request id 'dup'" in errors[0].error
    tokens = [o.new_token_ids[0] for o in got if o.new_token_ids]
    # The first request keeps going to its normal end (collect stopped at the error; gather the rest).
    rest = a.collect({"dup"})["dup"] if got[-1].finish_reason == FinishReason.ERROR else []
    tokens += [o.new_token_ids[0] for o in rest]
    assert tokens == [fake_token([1, 2], n) for n in range(6)]
    assert (rest or got)[-1].finish_reason == FinishReason.LENGTH


def test_request_the_core_rejects_fails_alone(core):
    a = core.frontend()
    a.send(EngineCoreRequestType.ADD, request("empty", [], max_tokens=2))
    a.send(EngineCoreRequestType.ADD, request("fine", [3], max_tokens=2))
    got = a.collect({"empty", "fine"})
    assert got["empty"][0].finish_reason == FinishReason.ERROR
    assert "prompt_token_ids must not be empty" in got["empty"][0].error
    assert got["fine"][-1].finish_reason == FinishReason.LENGTH


def test_abort_stops_outputs_and_frees_blocks_only_for_the_owner(core):
    a, b = core.frontend(), core.frontend()
    free0 = a.utility("get_num_free_blocks").result
    core.proc.engine_core.step_delay = 0.05
    a.send(EngineCoreRequestType.ADD, request("long", [1, 2, 3], max_tokens=200))
    kind, outs = a.recv()
    assert outs.outputs[0].request_id == "long"
    b.send(EngineCoreRequestType.ABORT, ["long"])  # not b's request: ignored
    assert b.utility("ping").result == "pong"  # b's messages are handled in order: its ABORT has been applied
    assert "long" in core.proc.engine_core.reqs
    a.send(EngineCoreRequestType.ABORT, ["long"])
    # Drain until the abort has applied: outputs stop coming.
    while True:
        try:
            a.recv(timeout_s=0.5)
        except TimeoutError:
            break
    assert a.utility("get_num_free_blocks", call_id=2).result == free0
    assert not core.proc.engine_core.has_unfinished_requests()


def test_add_followed_by_abort_in_one_batch_never_runs():
    c = ThreadedCore()
    try:
        a = c.frontend()
        # Hold the busy loop in a step so that ADD and ABORT land in the same drained batch.
        c.proc.engine_core.step_delay = 0.5
        a.send(EngineCoreRequestType.ADD, request("blocker", [1], max_tokens=2))
        a.recv()  # blocker is running: the loop is inside step() for 0.5 s now
        a.send(EngineCoreRequestType.ADD, request("ghost", [2], max_tokens=5))
        a.send(EngineCoreRequestType.ABORT, ["ghost"])
        got = a.collect({"blocker"})
        assert a.utility("ping").result == "pong"  # the loop has drained everything sent before
        assert "ghost" not in got and "ghost" not in c.proc.engine_core.reqs
        assert c.proc.engine_core.free_blocks == c.proc.engine_core.num_blocks
    finally:
        c.stop()


def test_utility_calls_return_results_and_failures(core):
    a = core.frontend()
    assert a.utility("echo", 1, "x", [2.5]).result == [1, "x", [2.5]]
    bad = a.utility("no_such_method", call_id=7)
    assert bad.failure_type == "ValueError" and "unknown utility method 'no_such_method'" in bad.failure_message
    unsendable = a.utility("unencodable", call_id=8)
    assert "cannot be sent" in unsendable.failure_message
    assert a.utility("ping", call_id=9).result == "pong"


def test_heartbeat_is_answered(core):
    a = core.frontend()
    a.inp.send(EngineCoreRequestType.HEARTBEAT.value)
    kind, _ = a.recv()
    assert kind is EngineCoreOutputType.HEARTBEAT


def test_silent_frontend_is_dropped_and_its_requests_aborted():
    c = ThreadedCore(heartbeat_timeout_s=0.6)
    try:
        c.proc.engine_core.step_delay = 0.05
        quiet, chatty = c.frontend(), c.frontend()
        quiet.send(EngineCoreRequestType.ADD, request("q", [1], max_tokens=1000))
        chatty.send(EngineCoreRequestType.ADD, request("c", [2], max_tokens=1000))
        kind, outs = quiet.recv()  # "q" runs (receiving is not speaking: quiet stays silent)
        assert kind is EngineCoreOutputType.OUTPUTS and outs.outputs[0].request_id == "q"

        def quiet_dropped() -> bool:
            chatty.inp.send(EngineCoreRequestType.HEARTBEAT.value)  # one heartbeat per poll keeps chatty alive
            return "q" not in c.proc.engine_core.reqs

        wait_until(quiet_dropped, DEADLINE_S, "the silent frontend's request is aborted", interval_s=0.1)
        assert "c" in c.proc.engine_core.reqs  # the live frontend keeps its request
        assert len(c.proc.registry) == 1
        # Had the quiet one been alive after all, it learns why its request ended...
        got = quiet.collect({"q"})
        assert got["q"][-1].finish_reason == FinishReason.ABORT and "was dropped" in got["q"][-1].error
        # ...and speaking again takes it back (it proved its token at HELLO).
        assert quiet.utility("ping").result == "pong"
        assert len(c.proc.registry) == 2
    finally:
        c.stop()


def test_goodbye_detaches_for_good(core):
    a = core.frontend()
    a.send(EngineCoreRequestType.ADD, request("g", [1], max_tokens=1000))
    a.inp.send(EngineCoreRequestType.GOODBYE.value)
    wait_until(
        lambda: not core.proc.registry and not core.proc.engine_core.reqs,
        DEADLINE_S,
        "GOODBYE forgets the frontend and aborts its request",
    )
    # After GOODBYE the identity is a stranger: it must HELLO again.
    a.send(EngineCoreRequestType.UTILITY, UtilityRequest(0, 5, "ping"))
    while True:
        try:
            kind, outs = a.recv(timeout_s=0.5)
        except TimeoutError:
            break
        assert outs is None or outs.utility_output is None


def test_fatal_step_error_sends_engine_dead_to_every_frontend_and_exits_nonzero():
    c = ThreadedCore()
    try:
        a, b = c.frontend(), c.frontend()
        assert a.utility("crash_on_next_step").result is True
        a.send(EngineCoreRequestType.ADD, request("boom", [1], max_tokens=3))
        for fe in (a, b):
            while True:
                kind, outs = fe.recv()
                if kind is EngineCoreOutputType.OUTPUTS and outs.engine_dead:
                    break
        c.thread.join(5)
        assert c.exit_code == 1
    finally:
        c.stop()


def test_shutdown_drains_running_requests_within_the_bound():
    c = ThreadedCore(drain_timeout_s=5.0)
    a = c.frontend()
    c.proc.engine_core.step_delay = 0.01
    a.send(EngineCoreRequestType.ADD, request("d", [1, 2], max_tokens=30))
    first = a.recv()[1].outputs
    c.proc.request_shutdown()
    a.send(EngineCoreRequestType.ADD, request("late", [3], max_tokens=2))
    got = a.collect({"d", "late"})
    assert got["d"][-1].finish_reason == FinishReason.LENGTH
    assert sum(len(o.new_token_ids) for o in first + got["d"]) == 30
    assert got["late"][0].finish_reason == FinishReason.ERROR and "shutting down" in got["late"][0].error
    c.thread.join(5)
    assert c.exit_code == 0
    c.stop()


def test_drain_timeout_aborts_what_is_left_and_tells_the_frontend():
    c = ThreadedCore(drain_timeout_s=0.3)
    a = c.frontend()
    c.proc.engine_core.step_delay = 0.02
    a.send(EngineCoreRequestType.ADD, request("slow", [1], max_tokens=2000))
    a.recv()
    c.proc.request_shutdown()
    got = a.collect({"slow"})
    assert got["slow"][-1].finish_reason == FinishReason.ABORT
    assert "shut down before the request finished" in got["slow"][-1].error
    c.thread.join(5)
    assert c.exit_code == 0
    c.stop()


# ---------------------------------------------------------------------------------------------------- thread policy


def test_core_thread_policy_uses_configured_threads_or_all_cores_but_one_on_cpu():
    cfg = fake_config()
    try:
        cfg.device_config.num_threads = 1
        assert set_core_thread_policy(cfg) == (1, None) and torch.get_num_threads() == 1  # explicit: fixed
        cfg.device_config.num_threads = None
        n, adaptive = set_core_thread_policy(cfg)
        assert (
            n == max(1, len(os.sched_getaffinity(0)) - 1) and torch.get_num_threads() == n
        )  # one core left for frontends at start
        assert adaptive is not None and adaptive.current == n and adaptive.cores == len(os.sched_getaffinity(0))
        cfg.parallel_config.tensor_parallel_size = 2  # ranks in other processes: the count stays
        assert set_core_thread_policy(cfg)[1] is None
        cfg.parallel_config.tensor_parallel_size = 1
        cfg.device_config.num_threads = 0
        with pytest.raises(ValueError, match="num_threads"):
            set_core_thread_policy(cfg)
    finally:
        torch.set_num_threads(1)


def test_busy_loop_asks_the_thread_adapter_after_steps_and_keeps_its_count(core):
    class Recorder:
        calls = 0
        before = 0

        def before_step(self) -> None:
            Recorder.before += 1

        def maybe_update(self) -> int:
            Recorder.calls += 1
            return 3

    core.proc._adaptive_threads = Recorder()
    a = core.frontend()
    a.send(EngineCoreRequestType.ADD, request("t", [1, 2], max_tokens=4))
    assert len(a.collect({"t"})["t"]) == 4
    assert Recorder.calls >= 4 and core.proc.num_threads == 3  # once per step
    assert Recorder.before == Recorder.calls  # and told before each step (an idle spell ends there)


# ---------------------------------------------------------------------------------------------------- real process


def _spawn_core(
    tmpdir: str, hf_extra: Optional[dict] = None, **options: Any
) -> tuple[launcher.ChildProcess, CoreAddresses]:
    """A fake core process started by the launcher, as `vllm-lite serve` starts real ones."""
    addresses = make_addresses(tmpdir)
    args = EngineCoreArgs(
        vllm_config=encode_vllm_config(fake_config(**(hf_extra or {}))),
        input_address=addresses.input,
        output_address=addresses.output,
        **options,
    )
    proc = launcher.start_child(FAKE_CORE_MODULE, args, EngineCoreReady, name="fake-core")
    try:
        ready = proc.wait_ready(120)
    except BaseException:
        proc.stop()
        raise
    assert ready.model == "fake-model" and ready.num_gpu_blocks == 256 and ready.protocol_version == PROTOCOL_VERSION
    return proc, addresses


def test_sigterm_drains_running_requests_then_exits_zero(tmp_path):
    proc, addresses = _spawn_core(str(tmp_path), {"fake_step_delay": 0.02}, drain_timeout_s=10.0, handle_sigint=True)
    ctx = zmq.Context()
    try:
        a = RawFrontend(ctx, addresses)
        assert a.hello().accepted
        a.send(EngineCoreRequestType.UTILITY, UtilityRequest(0, 1, "ping"))
        a.recv()
        a.send(EngineCoreRequestType.ADD, request("t", [1, 2, 3], max_tokens=40))
        first = a.recv()[1].outputs
        os.kill(proc.pid, signal.SIGTERM)
        got = a.collect({"t"})
        assert sum(len(o.new_token_ids) for o in first + got["t"]) == 40
        assert got["t"][-1].finish_reason == FinishReason.LENGTH
        assert proc.wait(10) == 0
    finally:
        proc.stop()
        ctx.destroy(linger=0)


def test_busy_address_fails_fast_before_loading_the_model(tmp_path):
    addresses = make_addresses(str(tmp_path))
    ctx = zmq.Context()
    squatter = ctx.socket(zmq.ROUTER)
    squatter.bind("tcp://127.0.0.1:0")
    busy = squatter.getsockopt(zmq.LAST_ENDPOINT).decode()
    try:
        # The bind error, not the model-loading one: the sockets are bound before the model loads.
        with pytest.raises(RuntimeError, match="could not bind its sockets"):
            FakeEngineCoreProc(
                fake_config(fake_fail_startup="must not get this far"),
                CoreAddresses(input=busy, output=addresses.output),
                CoreProcOptions(),
            )
    finally:
        ctx.destroy(linger=0)


def test_engine_addresses_from_one_base_address():
    assert CoreAddresses.from_base("tcp://127.0.0.1:5555") == CoreAddresses(
        "tcp://127.0.0.1:5555", "tcp://127.0.0.1:5556"
    )
    assert CoreAddresses.from_base("ipc:///tmp/core") == CoreAddresses("ipc:///tmp/core.in", "ipc:///tmp/core.out")
    for bad in ("localhost:5555", "tcp://127.0.0.1", "tcp://:80", "tcp://h:65535", "ipc://"):
        with pytest.raises(ValueError, match="engine address"):
            CoreAddresses.from_base(bad)
