"""Engine death reaches an attached frontend within seconds, however long its heartbeats are.

Before, an `LLM` attached to a core that was killed -9 raised `EngineDeadError` only after 30 s
("no message for 30 s"). Now a core on this host names its pid (with its boot id and start
time) in READY and the client watches the process; a core elsewhere is declared dead after
three missed one-second heartbeats. These tests set the silence timeout to 600 s, so only the
process watch can explain a prompt `EngineDeadError`.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
from collections.abc import Iterator

import pytest

from vllm_lite.client.async_mp_client import AsyncMPClient
from vllm_lite.client.exceptions import EngineDeadError
from vllm_lite.client.mp_client import DEFAULT_ENGINE_SILENCE_TIMEOUT_S
from vllm_lite.client.private_core import PrivateCore
from vllm_lite.client.sync_mp_client import SyncMPClient
from vllm_lite.testing.fake_core import ThreadedCore, fake_config, request, spawn_fake_core

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
