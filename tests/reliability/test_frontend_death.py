"""A frontend that dies has its requests aborted at once, not after the heartbeat timeout.

Before, after kill -9 of a frontend its requests kept running until the core's 10 s heartbeat
timeout. Now the core's socket monitor reports the closed connection and the core drops that
frontend. The heartbeat timeout here is 600 s, so only the disconnect can explain the abort.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest

from vllm_lite.core.messages import EngineCoreRequestType
from vllm_lite.testing.fake_core import RawFrontend, ThreadedCore, request
from vllm_lite.testing.waiting import wait_until

DEADLINE_S = 60.0

# A real attached client in its own process: adds a long request, says so once it runs, then waits.
_FRONTEND = """
import sys
from vllm_lite.client.sync_mp_client import SyncMPClient
from vllm_lite.core.messages import EngineCoreRequest
from vllm_lite.endpoints import CoreAddresses
from vllm_lite.sampling_params import SamplingParams

client = SyncMPClient(addresses=CoreAddresses(sys.argv[1], sys.argv[2]), client_name="doomed")
client.add_request(EngineCoreRequest("doomed-req", [1, 2], SamplingParams(max_tokens=200), None, 0.0))
client.get_output(timeout=120)
print("running", flush=True)
sys.stdin.read()
"""


@pytest.fixture(scope="module")
def core() -> Iterator[ThreadedCore]:
    c = ThreadedCore(heartbeat_timeout_s=600.0)
    c.proc.engine_core.step_delay = 0.05  # 200 tokens take ~10 s unless aborted
    yield c
    c.stop()


def test_a_killed_frontend_s_requests_are_aborted_by_the_disconnect(core: ThreadedCore) -> None:
    survivor = core.frontend()
    survivor.send(EngineCoreRequestType.ADD, request("survivor-req", [3], max_tokens=200))
    child = subprocess.Popen(
        [sys.executable, "-c", _FRONTEND, core.addresses.input, core.addresses.output],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "running"
        assert "doomed-req" in core.proc.engine_core.reqs and len(core.proc.registry) == 2
        disconnects = core.proc.sockets.disconnects
        os.kill(child.pid, signal.SIGKILL)  # no GOODBYE, and no heartbeat timeout for 600 s
        wait_until(
            lambda: "doomed-req" not in core.proc.engine_core.reqs,
            DEADLINE_S,
            "the dead frontend's request is aborted",
        )
        assert core.proc.sockets.disconnects > disconnects
        assert [c.name for c in core.proc.registry.clients()] == ["raw"]  # the survivor stays attached
        assert "survivor-req" in core.proc.engine_core.reqs  # and its request keeps running
    finally:
        child.kill()
        child.wait()


def test_a_disconnected_frontend_that_speaks_again_is_taken_back(core: ThreadedCore) -> None:
    # A network blip looks like a death to the core; a frontend that reconnects is served again.
    fe = core.frontend()
    identity = fe.identity
    fe.inp.close(linger=0)
    fe.out.close(linger=0)
    wait_until(lambda: core.proc.registry.get(identity) is None, DEADLINE_S, "the closed frontend is dropped")
    assert core.proc.registry.was_dropped(identity)
    back = RawFrontend(core.ctx, core.addresses, identity=identity)
    assert back.utility("ping").result == "pong"  # no new HELLO needed: it proved its token before
    assert core.proc.registry.get(identity) is not None
