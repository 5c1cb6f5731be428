"""`vllm-lite api-server --engine ADDRESS` survives its core as `serve`'s frontends do: when the core is killed the
HTTP server stays up with /health 503, and when a core answers at the same address again it re-attaches and
serves (before, the process exited after --engine-dead-grace)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import httpx

from vllm_lite.endpoints import CoreAddresses
from vllm_lite.testing.core_at_address import start_core_at
from vllm_lite.testing.waiting import wait_until

DEADLINE_S = 120.0


def _health(url: str) -> int:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code
    except httpx.TransportError:
        return 0  # not listening (yet, or any more)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_attached_api_server_stays_up_with_503_and_reattaches(tmp_path) -> None:
    base = f"ipc://{tmp_path}/core"
    addresses = CoreAddresses.from_base(base)
    core = start_core_at(addresses)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "vllm_lite.entrypoints.cli", "api-server", "--engine", base, "--port", str(port)]
    server = subprocess.Popen(
        cmd + ["--uvicorn-log-level", "warning"],
        env={k: v for k, v in os.environ.items() if k != "VLLM_LITE_AUTH_TOKEN"},
    )
    try:
        wait_until(
            lambda: server.poll() is not None or _health(url) == 200,
            DEADLINE_S,
            "the api-server serves",
            interval_s=0.2,
        )
        assert server.poll() is None
        os.kill(core.pid, signal.SIGKILL)
        core.wait(DEADLINE_S)
        wait_until(lambda: _health(url) == 503, DEADLINE_S, "/health says 503 after the core died", interval_s=0.2)
        body = {"prompt": "The for statement", "max_tokens": 3, "temperature": 0.0}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=DEADLINE_S).status_code == 503
        assert server.poll() is None  # still up, past --engine-dead-grace (1 s) by now
        core = start_core_at(addresses)  # a core at the same address: the server says HELLO again
        wait_until(lambda: _health(url) == 200, DEADLINE_S, "/health says 200 again", interval_s=0.2)
        again = httpx.post(f"{url}/v1/completions", json=body, timeout=DEADLINE_S)
        assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 3
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(DEADLINE_S)
        finally:
            if server.poll() is None:
                server.kill()
            core.stop()
