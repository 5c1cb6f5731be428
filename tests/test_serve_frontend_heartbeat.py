"""A `serve` HTTP frontend keeps heartbeating its core while it builds its app.

The bug: the frontend said HELLO, then built its app on the event loop that also runs the client's heartbeat
task; on a loaded machine that took longer than the core's heartbeat timeout and the core dropped the frontend.
Here the app factory is slow on purpose (it returns only after the core's timeout has passed, or as soon as the
core dropped us), and the core runs in this process so the test can ask it whether it dropped the frontend.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import tempfile
import threading
import time
from typing import Any

import httpx
import pytest
import torch

from vllm_lite.core.engine_core_proc import CoreProcOptions, EngineCoreProc
from vllm_lite.endpoints import CoreAddresses
from vllm_lite.engine_args import EngineArgs
from vllm_lite.entrypoints.openai.api_server import build_app
from vllm_lite.entrypoints.serve_frontend import FrontendArgs, serve
from vllm_lite.testing.checkpoints import get_checkpoint
from vllm_lite.testing.waiting import wait_until

HEARTBEAT_TIMEOUT_S = 1.5
DEADLINE_S = 120.0


@pytest.fixture(scope="module")
def core():
    """A real tiny-Llama core with a short heartbeat timeout, its busy loop in a thread of this process."""
    tmpdir = tempfile.mkdtemp(prefix="vlt-hb-")
    base = f"ipc://{tmpdir}/core"
    config = EngineArgs(
        model=get_checkpoint("llama"),
        device="cpu",
        dtype="float32",
        max_model_len=128,
        block_size=8,
        kv_cache_memory_bytes=1 << 20,
        num_threads=torch.get_num_threads(),  # the core sets its process's threads: this process's, unchanged
    ).create_engine_config()
    proc = EngineCoreProc(
        config, CoreAddresses.from_base(base), CoreProcOptions(heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)
    )
    thread = threading.Thread(target=proc.run_busy_loop, daemon=True, name="heartbeat-test-core")
    thread.start()
    yield base, proc
    proc.request_shutdown()
    thread.join(30)
    shutil.rmtree(tmpdir, ignore_errors=True)
    assert not thread.is_alive()


def test_a_slow_app_build_does_not_get_the_frontend_dropped_for_silence(core):
    base, proc = core
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    args = FrontendArgs(engine=[base], listen_fd=listener.detach(), frontend_name="slow-builder")
    seen: dict[str, Any] = {}
    app_ready = threading.Event()

    def slow_app_factory(handle: Any, *a: Any, **kw: Any) -> Any:
        """Take longer than the core's heartbeat timeout (or return at once when the core dropped us)."""
        identity = handle.engine_core.identity
        started = time.monotonic()
        wait_until(
            lambda: proc.registry.was_dropped(identity) or time.monotonic() - started > 2 * HEARTBEAT_TIMEOUT_S,
            DEADLINE_S,
            "the core dropped the frontend, or two heartbeat timeouts passed",
        )
        seen["dropped"] = proc.registry.was_dropped(identity)
        seen["app"] = app = build_app(handle, *a, **kw)
        app_ready.set()
        return app

    result: dict[str, Any] = {}

    def run_frontend() -> None:
        try:
            result["exit"] = asyncio.run(serve(args, None, app_factory=slow_app_factory))
        except BaseException as e:  # noqa: BLE001 -- shown by the assertion below
            result["error"] = e

    frontend = threading.Thread(target=run_frontend, daemon=True)
    frontend.start()
    try:
        assert app_ready.wait(DEADLINE_S), result.get("error")
        assert seen["dropped"] is False, "the core dropped the frontend while it built its app"
        app = seen["app"]
        wait_until(lambda: getattr(app.state.server, "started", False), DEADLINE_S, "the frontend serving HTTP")
        # Attached and serving: a request goes through the core.
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"prompt": "The for statement", "max_tokens": 2, "temperature": 0},
            timeout=DEADLINE_S,
        )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 2
    finally:
        if "app" in seen:  # stop it: once uvicorn exists, ask it to exit
            state = seen["app"].state
            wait_until(lambda: state.server is not None or not frontend.is_alive(), DEADLINE_S, "uvicorn created")
            if state.server is not None:
                state.server.should_exit = True
        frontend.join(DEADLINE_S)
    assert not frontend.is_alive()
    assert result.get("exit") == 0, result
