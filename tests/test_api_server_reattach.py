"""`vllm-lite api-server --engine ADDRESS` survives its core as `serve`'s frontends do: when the core is killed the
HTTP server stays up with /health 503, and when a core answers at the same address again it re-attaches and
serves (before, the process exited after --engine-dead-grace)."""

from __future__ import annotations

import os
import signal

import httpx

from vllm_lite.endpoints import CoreAddresses
from vllm_lite.testing.core_at_address import start_core_at
from vllm_lite.testing.openai_server import ServerProcess
from vllm_lite.testing.waiting import wait_until

DEADLINE_S = 120.0
TOKEN = "reattach-token"


def _health(url: str) -> int:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code
    except httpx.TransportError:
        return 0  # not listening any more


def test_attached_api_server_stays_up_with_503_and_reattaches(tmp_path) -> None:
    base = f"ipc://{tmp_path}/core"
    addresses = CoreAddresses.from_base(base)
    core = start_core_at(addresses, auth_token=TOKEN)
    srv = None
    try:
        srv = ServerProcess(["--engine", base, "--auth-token", TOKEN, "--uvicorn-log-level", "warning"])
        url = srv.base_url
        os.kill(core.pid, signal.SIGKILL)
        core.wait(DEADLINE_S)
        wait_until(lambda: _health(url) == 503, DEADLINE_S, "/health says 503 after the core died", interval_s=0.2)
        body = {"prompt": "The for statement", "max_tokens": 3, "temperature": 0.0}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=DEADLINE_S).status_code == 503
        assert srv.proc.poll() is None  # still up
        core = start_core_at(addresses, auth_token=TOKEN)  # a core at the same address: the server says HELLO again
        wait_until(lambda: _health(url) == 200, DEADLINE_S, "/health says 200 again", interval_s=0.2)
        assert srv.proc.poll() is None  # it stayed up the whole time, well past --engine-dead-grace (1 s)
        again = httpx.post(f"{url}/v1/completions", json=body, timeout=DEADLINE_S)
        assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 3
        assert srv.terminate() == 0  # attached again, a clean stop is exit code 0
    finally:
        if srv is not None:
            srv.kill()
        core.stop()
