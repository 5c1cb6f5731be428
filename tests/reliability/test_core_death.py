"""Engine death reaches an attached frontend within seconds, however long its heartbeats are.

Before, an `LLM` attached to a core that was killed -9 raised `EngineDeadError` only after 30 s
("no message for 30 s"). Now a core on this host names its pid (with its boot id and start
time) in READY and the client watches the process; a core elsewhere is declared dead after
three missed one-second heartbeats. These tests set the silence timeout to 600 s, so only the
process watch can explain a prompt `EngineDeadError`.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from vllm_lite import launcher
from vllm_lite.client.async_mp_client import AsyncMPClient
from vllm_lite.client.exceptions import EngineDeadError
from vllm_lite.client.mp_client import DEFAULT_ENGINE_SILENCE_TIMEOUT_S
from vllm_lite.client.private_core import PrivateCore
from vllm_lite.client.sync_mp_client import SyncMPClient
from vllm_lite.config import encode_vllm_config
from vllm_lite.core.messages import EngineCoreArgs, EngineCoreReady
from vllm_lite.endpoints import CoreAddresses
from vllm_lite.engine_args import EngineArgs
from vllm_lite.entrypoints.serve_frontend import FRONTEND_MODULE, FrontendArgs, FrontendReady
from vllm_lite.testing.checkpoints import get_checkpoint
from vllm_lite.testing.fake_core import ThreadedCore, fake_config, request, spawn_fake_core
from vllm_lite.testing.waiting import wait_until

ENGINE_CORE_MODULE = "vllm_lite.core.engine_core_main"

DEADLINE_S = 60.0
HUGE_S = 600.0  # no heartbeat or silence timeout can fire within a test


@pytest.fixture
def core() -> Iterator[PrivateCore]:
    """A fake core process of our own, which tests attach to by address and then kill -9."""
    c = spawn_fake_core(fake_config(fake_step_delay=0.05))
    yield c
    c.proc.stop()
    shutil.rmtree(c.tmpdir, ignore_errors=True)


def test_a_sync_client_sees_a_killed_local_core_through_its_process(core: PrivateCore) -> None:
    client = SyncMPClient(addresses=core.addresses, auth_token=core.auth_token, engine_silence_timeout_s=HUGE_S)
    try:
        assert client.proc is None and client.core_watch is not None and client.core_watch.pid == core.proc.pid
        client.add_request(request("r", [1, 2], max_tokens=200))
        assert client.get_output(timeout=DEADLINE_S).outputs  # it runs
        os.kill(core.proc.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match=rf"process \(pid {core.proc.pid}\) exited"):
            while True:
                client.get_output(timeout=DEADLINE_S)
        with pytest.raises(EngineDeadError):
            client.call_utility("ping")  # and every later call
    finally:
        client.shutdown()


def test_an_async_client_sees_a_killed_local_core_through_its_process(core: PrivateCore) -> None:
    async def main() -> None:
        client = AsyncMPClient(addresses=core.addresses, auth_token=core.auth_token, engine_silence_timeout_s=HUGE_S)
        try:
            assert client.core_watch is not None
            await client.add_request_async(request("a", [3], max_tokens=200))
            assert (await asyncio.wait_for(client.get_output_async(), DEADLINE_S)).outputs
            os.kill(core.proc.pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError, match="exited"):
                while True:
                    await asyncio.wait_for(client.get_output_async(), DEADLINE_S)
            with pytest.raises(EngineDeadError):
                await client.call_utility_async("ping")
        finally:
            client.shutdown()

    asyncio.run(main())


def test_a_core_that_cannot_be_watched_gets_short_heartbeats() -> None:
    # In this very process: no other process to watch, as for a core on another host.
    c = ThreadedCore(heartbeat_timeout_s=HUGE_S)
    try:
        client = SyncMPClient(addresses=c.addresses)
    except BaseException:
        c.stop()
        raise
    try:
        assert client.core_watch is None
        assert client.engine_silence_timeout_s == DEFAULT_ENGINE_SILENCE_TIMEOUT_S <= 5.0
        assert client.heartbeat_interval_s is not None and client.heartbeat_interval_s <= 1.0
        assert client.call_utility("ping") == "pong"
    finally:
        c.stop()  # gone without a word: only the missed heartbeats tell
    try:
        with pytest.raises(EngineDeadError, match="no message for"):
            client.get_output(timeout=DEADLINE_S)
    finally:
        client.shutdown()


# ---------------------------------------------------------------------------------------------------- HTTP


def _start_core(addresses: CoreAddresses) -> launcher.ChildProcess:
    """A real engine core over the tiny Llama, at fixed addresses (so a second one can take its place)."""
    cfg = EngineArgs(
        model=get_checkpoint("llama"), device="cpu", max_model_len=1024, block_size=16, kv_cache_memory_bytes=16 << 20
    ).create_engine_config()
    args = EngineCoreArgs(
        vllm_config=encode_vllm_config(cfg),
        input_address=addresses.input,
        output_address=addresses.output,
        heartbeat_timeout_s=HUGE_S,
    )
    proc = launcher.start_child(ENGINE_CORE_MODULE, args, EngineCoreReady, name="test-core")
    try:
        proc.wait_ready(120)
    except BaseException:
        proc.stop()
        raise
    return proc


def _post(url: str, body: dict) -> httpx.Response:
    return httpx.post(url, json=body, timeout=DEADLINE_S)


def test_http_frontend_reports_core_death_stays_up_with_503_and_reattaches(tmp_path) -> None:
    base = f"ipc://{tmp_path}/core"
    addresses = CoreAddresses.from_base(base)
    core = _start_core(addresses)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    args = FrontendArgs(
        engine=[base],
        listen_fd=listener.fileno(),
        core_pids=[core.pid],
        frontend_name="http-t",
        reattach_interval_s=0.5,
    )
    frontend = launcher.start_child(
        FRONTEND_MODULE, args, FrontendReady, name="test-http", pass_fds=[listener.fileno()]
    )
    try:
        url = f"http://127.0.0.1:{frontend.wait_ready(120).port}"
        long = {"prompt": "The for statement", "max_tokens": 1000, "temperature": 0.0, "ignore_eos": True}
        with ThreadPoolExecutor(1) as pool:
            plain = pool.submit(_post, f"{url}/v1/completions", long)
            events: list[str] = []
            with httpx.stream("POST", f"{url}/v1/completions", json={**long, "stream": True}, timeout=DEADLINE_S) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if not line:
                        continue
                    events.append(line)
                    if len(events) == 2:  # streaming: now the core dies mid-stream
                        os.kill(core.pid, signal.SIGKILL)
            # The stream ended with an error event, then [DONE]; the plain request got a 503.
            assert events[-1] == "data: [DONE]"
            error = json.loads(events[-2][len("data: ") :])["error"]
            assert error["code"] == 503 and "engine" in error["message"].lower()
            answer = plain.result()
        assert answer.status_code == 503 and answer.json()["error"]["code"] == 503
        wait_until(lambda: httpx.get(f"{url}/health").status_code == 503, DEADLINE_S, "/health says 503")
        assert frontend.is_alive()  # the HTTP server stays up
        assert _post(f"{url}/v1/completions", {"prompt": "x", "max_tokens": 2}).status_code == 503
        core.wait(DEADLINE_S)
        core = _start_core(addresses)  # a core comes back at the same address: the frontend says HELLO again
        wait_until(lambda: httpx.get(f"{url}/health").status_code == 200, DEADLINE_S, "/health says 200 again")
        again = _post(f"{url}/v1/completions", {"prompt": "The for statement", "max_tokens": 3, "temperature": 0.0})
        assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 3
    finally:
        frontend.stop()
        core.stop()
        listener.close()
