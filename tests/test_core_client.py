"""Engine core clients: in-process, sync over a private core process, asyncio over one.

The clients are the real ones; their core serves `FakeEngineCore` (vllm_lite.testing.fake_core),
started by the launcher exactly as a real private core is. Starting a core costs seconds
here, so the process tests share one core where they can and keep the rest few.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from vllm_lite.client.core_client import AsyncMPClient, SyncMPClient, make_client
from vllm_lite.client.exceptions import EngineDeadError, EngineStartupError
from vllm_lite.core.messages import EngineCoreOutput, EngineCoreOutputType, FinishReason
from vllm_lite.launcher import ChildStartupError
from vllm_lite.testing.fake_core import (
    VOCAB,
    FakeAsyncMPClient,
    FakeInprocClient,
    FakeSyncMPClient,
    ThreadedCore,
    fake_config,
    fake_token,
    request,
)
from vllm_lite.testing.processes import process_gone
from vllm_lite.testing.waiting import async_wait_until, wait_until

# Generous: a loaded 2-core machine only makes these tests slower, never wrong.
DEADLINE_S = 60.0


def drain_sync(client, ids: set[str], timeout_s: float = 20.0) -> dict[str, list[EngineCoreOutput]]:
    got: dict[str, list[EngineCoreOutput]] = {}
    pending = set(ids)
    deadline = time.monotonic() + timeout_s
    while pending:
        outs = client.get_output(timeout=max(0.1, deadline - time.monotonic()))
        for o in outs.outputs:
            got.setdefault(o.request_id, []).append(o)
            if o.finished:
                pending.discard(o.request_id)
    return got


def tokens(outs: list[EngineCoreOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


# ---------------------------------------------------------------------------------------------------- in-process


def abort_and_drain(client, request_id: str) -> None:
    """Abort a running request, wait until its blocks are freed (all 256 free), then drain what the core sent
    before the abort, so the module's later tests start clean."""
    client.abort_requests([request_id])
    wait_until(
        lambda: client.call_utility("get_num_free_blocks") == 256,
        DEADLINE_S,
        "the aborted request's blocks are freed",
    )
    while True:
        try:
            client.get_output(timeout=0.3)
        except TimeoutError:
            break


def test_make_client_rejects_asyncio_without_multiprocess():
    with pytest.raises(ValueError, match="asyncio_mode=True requires multiprocess=True"):
        make_client(fake_config(), multiprocess=False, asyncio_mode=True)


def test_inproc_client_runs_steps_and_reports_bad_requests_as_outputs():
    client = FakeInprocClient(fake_config())
    assert client.model_facts["vocab_size"] == VOCAB
    client.add_request(request("a", [1, 2], max_tokens=3))
    client.add_request(request("a", [5], max_tokens=3))
    got: dict[str, list[EngineCoreOutput]] = {}
    for _ in range(10):
        for o in client.get_output().outputs:
            got.setdefault(o.request_id, []).append(o)
    assert got["a"][0].finish_reason == FinishReason.ERROR and "duplicate" in got["a"][0].error
    assert tokens(got["a"][1:]) == [fake_token([1, 2], n) for n in range(3)]
    assert client.call_utility("echo", 4) == [4]
    with pytest.raises(ValueError, match="unknown utility"):
        client.call_utility("nope")
    client.shutdown()


# ---------------------------------------------------------------------------------------------------- sync, shared core


@pytest.fixture(scope="module")
def sync_client():
    # A small step delay keeps long requests running while a test pokes at them.
    client = FakeSyncMPClient(fake_config(fake_step_delay=0.005))
    yield client
    client.shutdown()


def test_sync_client_handshake_gives_model_facts(sync_client):
    assert sync_client.model_facts == {
        "model": "fake-model",
        "max_model_len": 256,
        "block_size": 16,
        "num_gpu_blocks": 256,
        "vocab_size": VOCAB,
        "max_logprobs": 20,
        "generation_config": "auto",  # the core's request rules (defaults of the fake)
        "runner_type": "generate",
        "pooler_config": None,
        "convert_type": "auto",  # --convert: the fake core reports none, so the frontend resolves it itself
        "lora_config": None,  # LoRA off in the fake core
    }
    assert sync_client.client_index == 0


def test_sync_client_generates_many_requests_correctly(sync_client):
    prompts = {f"r{i}": [i + 1, 2 * i + 3, 7] for i in range(20)}
    for rid, p in prompts.items():
        sync_client.add_request(request(rid, p, max_tokens=5 + int(rid[1:]) % 4))
    got = drain_sync(sync_client, set(prompts))
    for rid, p in prompts.items():
        assert tokens(got[rid]) == [fake_token(p, n) for n in range(5 + int(rid[1:]) % 4)]
        assert got[rid][-1].finish_reason == FinishReason.LENGTH


def test_sync_client_utility_calls_and_typed_failures(sync_client):
    assert sync_client.call_utility("ping") == "pong"
    assert sync_client.call_utility("echo", 1, "two", {"k": 3}) == [1, "two", {"k": 3}]
    with pytest.raises(ValueError, match="unknown utility method 'frobnicate'"):
        sync_client.call_utility("frobnicate")
    assert sync_client.call_utility("get_num_free_blocks") == 256


def test_sync_client_abort_frees_blocks(sync_client):
    sync_client.add_request(request("ab", [3, 3], max_tokens=2000))
    first = sync_client.get_output(timeout=10)
    assert first.outputs[0].request_id == "ab"
    abort_and_drain(sync_client, "ab")


def test_sync_client_duplicate_id_error_leaves_first_request_intact(sync_client):
    sync_client.add_request(request("dup", [4, 5], max_tokens=2000))
    outs = list(sync_client.get_output(timeout=10).outputs)  # the first "dup" is running now
    sync_client.add_request(request("dup", [9], max_tokens=30))
    while not any(o.finish_reason == FinishReason.ERROR for o in outs):
        outs += sync_client.get_output(timeout=10).outputs
    outs += sync_client.get_output(timeout=10).outputs  # the first keeps going after the error
    errors = [o for o in outs if o.finish_reason == FinishReason.ERROR]
    assert len(errors) == 1 and "duplicate request id 'dup'" in errors[0].error
    toks = tokens(outs)
    assert len(toks) >= 2 and toks == [fake_token([4, 5], n) for n in range(len(toks))]
    abort_and_drain(sync_client, "dup")


def test_sync_client_receives_logprob_tensors(sync_client):
    sync_client.add_request(request("lp", [8, 1], max_tokens=2, logprobs=2))
    got = drain_sync(sync_client, {"lp"})
    lp = got["lp"][0].new_logprobs
    assert lp.logprob_token_ids.shape == (1, 3) and lp.logprob_token_ids[0, 0].item() == fake_token([8, 1], 0)


# ---------------------------------------------------------------------------------------------------- sync, own core


def test_startup_failure_raises_original_message_and_the_core_traceback():
    with pytest.raises(EngineStartupError, match="FileNotFoundError: weights missing in /nowhere") as info:
        FakeSyncMPClient(fake_config(fake_fail_startup="weights missing in /nowhere"), startup_timeout_s=120)
    cause = info.value.__cause__
    assert isinstance(cause, ChildStartupError) and cause.exc_type == "FileNotFoundError"
    # The child's own traceback text, down to the function that raised.
    assert "Traceback (most recent call last)" in cause.traceback
    assert 'fake_core.py", line' in cause.traceback and "in __init__" in cause.traceback
    assert cause.traceback.rstrip().endswith("FileNotFoundError: weights missing in /nowhere")


def test_kill_9_fails_pending_get_output_and_utility_within_5s_and_shutdown_cleans_up():
    client = FakeSyncMPClient(fake_config(fake_step_delay=0.01))
    proc, tmpdir = client.proc, client.tmpdir
    assert os.path.isdir(tmpdir)
    client.add_request(request("k", [1], max_tokens=2000))
    client.get_output(timeout=10)
    os.kill(proc.pid, signal.SIGKILL)
    with pytest.raises(EngineDeadError, match="exit code -9"):  # not TimeoutError: within 5 s
        while True:
            client.get_output(timeout=5)
    with pytest.raises(EngineDeadError):
        client.call_utility("ping")
    with pytest.raises(EngineDeadError):
        client.add_request(request("after", [1]))
    client.shutdown()
    assert not os.path.exists(tmpdir)
    assert proc.exitcode == -9  # reaped: no zombie


def test_fatal_core_error_reaches_client_as_engine_dead():
    client = FakeSyncMPClient(fake_config())
    try:
        assert client.call_utility("crash_on_next_step") is True
        client.add_request(request("x", [1], max_tokens=3))
        with pytest.raises(EngineDeadError, match="fatal error"):
            client.get_output(timeout=10)
        assert client.proc.wait(10) == 1
    finally:
        client.shutdown()


def test_clean_shutdown_stops_core_and_removes_temp_dir():
    client = FakeSyncMPClient(fake_config())
    proc, tmpdir = client.proc, client.tmpdir
    client.add_request(request("s", [1], max_tokens=1000))
    client.shutdown()
    assert not proc.is_alive() and proc.exitcode is not None
    assert not os.path.exists(tmpdir)
    with pytest.raises(EngineDeadError, match="shut down"):
        client.get_output(timeout=1)


# ---------------------------------------------------------------------------------------------------- asyncio


def test_async_client_generates_concurrently_and_dies_cleanly_on_kill_9():
    async def main() -> None:
        client = FakeAsyncMPClient(fake_config())
        try:
            assert await client.call_utility_async("ping") == "pong"
            with pytest.raises(ValueError, match="unknown utility"):
                await client.call_utility_async("bogus")
            prompts = {f"a{i}": [i, i + 1] for i in range(1, 11)}
            for rid, p in prompts.items():
                await client.add_request_async(request(rid, p, max_tokens=6))
            got: dict[str, list[int]] = {}
            finished: set[str] = set()
            while finished != set(prompts):
                outs = await asyncio.wait_for(client.get_output_async(), 10)
                for o in outs.outputs:
                    got.setdefault(o.request_id, []).extend(o.new_token_ids)
                    if o.finished:
                        finished.add(o.request_id)
            for rid, p in prompts.items():
                assert got[rid] == [fake_token(p, n) for n in range(6)]

            await client.add_request_async(request("long", [2], max_tokens=2000))
            await client.abort_requests_async(["long"])
            assert await client.call_utility_async("get_num_free_blocks") == 256

            waiter = asyncio.ensure_future(client.get_output_async())
            os.kill(client.proc.pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError):  # not TimeoutError: within 5 s
                while True:
                    await asyncio.wait_for(waiter, 5)
                    waiter = asyncio.ensure_future(client.get_output_async())
            with pytest.raises(EngineDeadError):
                await client.call_utility_async("ping")
        finally:
            tmpdir, proc = client.tmpdir, client.proc
            client.shutdown()
        assert not os.path.exists(tmpdir) and proc.exitcode is not None

    asyncio.run(main())


# ---------------------------------------------------------------------------------------------------- orphans


def test_private_core_exits_and_cleans_up_when_its_parent_is_killed(tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(  # no main guard: the launcher never re-imports it
        "import sys, time\n"
        "import torch; torch.set_num_threads(1)\n"
        "from vllm_lite.testing.fake_core import FakeSyncMPClient, fake_config\n"
        "c = FakeSyncMPClient(fake_config())\n"
        "print(c.proc.pid, c.tmpdir, flush=True)\n"
        "sys.stdin.read()\n"
    )
    parent = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        core_pid, tmpdir = parent.stdout.readline().split()
        core_pid = int(core_pid)
        assert os.path.isdir(tmpdir) and not process_gone(core_pid)
    finally:
        parent.kill()
        parent.wait()
    wait_until(lambda: process_gone(core_pid), DEADLINE_S, "the private core exits after its parent died")
    assert not os.path.exists(tmpdir)


# ---------------------------------------------------------------------------------------------------- attach


def test_attached_client_keeps_a_long_stream_alive_past_the_heartbeat_timeout():
    core = ThreadedCore(heartbeat_timeout_s=0.6)
    core.proc.engine_core.step_delay = 0.01
    client = SyncMPClient(addresses=core.addresses, engine_silence_timeout_s=3.0)
    try:
        assert client.proc is None and client.heartbeat_timeout_s == 0.6
        client.add_request(request("long", [1, 2], max_tokens=200))  # ~2 s of streaming, sending nothing
        got = drain_sync(client, {"long"})
        assert tokens(got["long"]) == [fake_token([1, 2], n) for n in range(200)]
        assert len(core.proc.registry) == 1
    finally:
        client.shutdown()
        core.stop()


def test_attached_client_declares_a_silent_core_dead():
    core = ThreadedCore(heartbeat_timeout_s=5.0)
    client = SyncMPClient(addresses=core.addresses, engine_silence_timeout_s=1.0)
    try:
        assert client.call_utility("ping") == "pong"
        core.stop()  # the core goes away without a word
        # The silence watch (1 s) must fire: a plain get_output timeout would raise TimeoutError instead.
        with pytest.raises(EngineDeadError, match="no message for 1 s"):
            client.get_output(timeout=DEADLINE_S)
    finally:
        client.shutdown()


def test_async_client_attaches_to_a_running_core_and_detaches_on_shutdown():
    core = ThreadedCore(heartbeat_timeout_s=0.6)
    core.proc.engine_core.step_delay = 0.01

    async def main() -> None:
        client = AsyncMPClient(addresses=core.addresses, engine_silence_timeout_s=3.0)
        try:
            await client.add_request_async(request("a", [3], max_tokens=150))
            toks: list[int] = []
            while True:
                outs = await asyncio.wait_for(client.get_output_async(), 10)
                toks += [t for o in outs.outputs for t in o.new_token_ids]
                if any(o.finished for o in outs.outputs):
                    break
            assert toks == [fake_token([3], n) for n in range(150)]
        finally:
            client.shutdown()

    try:
        asyncio.run(main())
        # the async client said GOODBYE on shutdown
        wait_until(lambda: not core.proc.registry, DEADLINE_S, "the core forgets a detached async frontend")
    finally:
        core.stop()


def test_async_client_works_across_successive_event_loops():
    core = ThreadedCore()
    client = AsyncMPClient(addresses=core.addresses)

    async def one_request(rid: str) -> list[int]:
        await client.add_request_async(request(rid, [5, 6], max_tokens=4))
        toks: list[int] = []
        while True:
            outs = await asyncio.wait_for(client.get_output_async(), 10)
            toks += [t for o in outs.outputs for t in o.new_token_ids]
            if any(o.finished for o in outs.outputs):
                return toks

    try:
        assert asyncio.run(one_request("first")) == [fake_token([5, 6], n) for n in range(4)]
        assert asyncio.run(one_request("second")) == [fake_token([5, 6], n) for n in range(4)]
        assert asyncio.run(client.call_utility_async("ping")) == "pong"
    finally:
        client.shutdown()
        core.stop()


def test_attached_client_goodbye_aborts_its_requests_at_once():
    core = ThreadedCore(heartbeat_timeout_s=60.0)
    core.proc.engine_core.step_delay = 0.01
    stays = SyncMPClient(addresses=core.addresses, client_name="stays")
    leaves = SyncMPClient(addresses=core.addresses, client_name="leaves")
    try:
        names = sorted(f["name"] for f in stays.call_utility("list_frontends"))
        assert names == ["leaves", "stays"]
        leaves.add_request(request("orphan", [1], max_tokens=2000))
        leaves.get_output(timeout=10)
        leaves.shutdown()
        wait_until(
            lambda: "orphan" not in core.proc.engine_core.reqs, DEADLINE_S, "a detached frontend's request is aborted"
        )
        assert [f["name"] for f in stays.call_utility("list_frontends")] == ["stays"]
    finally:
        stays.shutdown()
        core.stop()


def test_async_client_that_starts_its_loop_late_is_not_lost():
    # Attach (sync handshake), then no event loop for longer than both timeouts: as when a server
    # attaches first and starts serving seconds later.
    core = ThreadedCore(heartbeat_timeout_s=0.5)
    client = AsyncMPClient(addresses=core.addresses, engine_silence_timeout_s=1.0)
    # Heartbeat acks the client receives: the core answers only a frontend it counts as attached.
    acks = [0]
    decode = client._decode_message

    def counting_decode(frames: list) -> object:
        if frames[0].bytes == EngineCoreOutputType.HEARTBEAT.value:
            acks[0] += 1
        return decode(frames)

    client._decode_message = counting_decode  # type: ignore[method-assign]
    try:
        wait_until(lambda: not core.proc.registry, DEADLINE_S, "the core drops a silent frontend")

        async def main() -> list[int]:
            assert await asyncio.wait_for(client.call_utility_async("ping"), 5) == "pong"
            await client.add_request_async(request("late", [2, 2], max_tokens=3))
            toks: list[int] = []
            while len(toks) < 3:
                outs = await asyncio.wait_for(client.get_output_async(), 5)
                toks += [t for o in outs.outputs for t in o.new_token_ids]
            (back,) = core.proc.registry.clients()
            # Nothing but heartbeats now, for three of the core's timeouts: the client beats every
            # timeout/4, so 12 answered beats span at least 11 intervals (2.75 timeouts) of its own waiting.
            interval = client.heartbeat_interval_s
            assert interval is not None and interval <= 0.5 / 4
            acks[0] = 0
            await async_wait_until(lambda: acks[0] >= 12, DEADLINE_S, "12 heartbeats answered by the core")
            # Still the same attachment (a drop and return would give a new client index).
            assert [c.index for c in core.proc.registry.clients()] == [back.index]
            assert await asyncio.wait_for(client.call_utility_async("ping"), 5) == "pong"
            return toks

        assert asyncio.run(main()) == [fake_token([2, 2], n) for n in range(3)]
        assert len(core.proc.registry) == 1
    finally:
        client.shutdown()
        core.stop()
