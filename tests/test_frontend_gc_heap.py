"""The API server's process freezes its start-up heap before it serves, as the engine core's does (issue #14).

`serve_app(..., freeze_gc=True)` collects, freezes and raises the youngest generation's threshold right before
uvicorn serves (gc_heap.freeze_gc_heap); the processes that are the server's own ask for it (`run_server`, the
`api-server` CLI's main, and `serve`'s frontend processes, serve_frontend._main); the default (a server run in a
test's or a user's interpreter, ServerThread) leaves the collector alone. $VLLM_LITE_GC_FREEZE=0 turns it off.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

import pytest

from vllm_lite.testing.checkpoints import get_checkpoint

# A server process of its own: uvicorn's serve() is replaced by a report of the collector's state at the moment
# uvicorn would start serving, so the script exits at once (no socket, no waiting).
_SCRIPT = """
import gc
gc.unfreeze()  # the collector as CPython starts it, whatever the interpreter's start-up froze (the H100 image's did)
import asyncio, json, sys
import uvicorn
from vllm_lite.core.gc_heap import gc_state
from vllm_lite.entrypoints.openai.api_server import build_app, serve_app
from vllm_lite.testing.openai_fake_engine import FakeAsyncLLM

async def report(self, sockets=None):
    print("GC " + json.dumps(gc_state()), flush=True)

uvicorn.Server.serve = report
app = build_app(FakeAsyncLLM(sys.argv[1]))
kwargs = {} if sys.argv[2] == "default" else {"freeze_gc": sys.argv[2] == "1"}
sys.exit(asyncio.run(serve_app(app, port=0, log_level="warning", **kwargs)))
"""


def _served_gc_state(freeze: str, gc_env: str) -> dict[str, Any]:
    env = dict(os.environ, VLLM_LITE_GC_FREEZE=gc_env, VLLM_LITE_GC_GEN0_THRESHOLD="12345", HF_HUB_OFFLINE="1")
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT, get_checkpoint("llama"), freeze],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    (line,) = [ln for ln in out.stdout.splitlines() if ln.startswith("GC ")]
    return json.loads(line[3:])


def test_a_server_process_freezes_its_heap_before_it_serves():
    state = _served_gc_state("1", "1")
    assert state["enabled"]
    assert state["freeze_count"] > 1000  # tokenizer, FastAPI, pydantic, torch: thousands of objects
    assert state["threshold"][0] == 12345


@pytest.mark.parametrize(("freeze", "gc_env"), [("default", "1"), ("0", "1"), ("1", "0")])
def test_the_collector_is_left_alone_in_process_or_when_turned_off(freeze, gc_env):
    state = _served_gc_state(freeze, gc_env)
    assert state["freeze_count"] == 0
    assert state["threshold"][0] != 12345


def test_run_server_asks_serve_app_to_freeze(monkeypatch):
    """`vllm-lite api-server` / `python -m ...api_server`: run_server is the process's main."""
    from vllm_lite.entrypoints.openai import api_server
    from vllm_lite.entrypoints.openai.cli_args import make_arg_parser
    from vllm_lite.testing.openai_fake_engine import FakeAsyncLLM

    ckpt = get_checkpoint("llama")
    seen: dict[str, Any] = {}

    async def fake_serve_app(app: Any, **kwargs: Any) -> int:
        seen.update(kwargs)
        return 0

    class Engine(FakeAsyncLLM):
        async def call_utility_async(self, method: str, *args: Any) -> Any:
            return None if method == "ping" else await super().call_utility_async(method, *args)

    monkeypatch.setattr(api_server, "build_engine", lambda args: Engine(ckpt))
    monkeypatch.setattr(api_server, "serve_app", fake_serve_app)
    args = make_arg_parser(argparse.ArgumentParser()).parse_args(["--model", ckpt])
    assert api_server.run_server(args) == 0
    assert seen.get("freeze_gc") is True


def test_serve_frontend_process_asks_serve_to_freeze(monkeypatch):
    """`vllm-lite serve`'s HTTP frontends: serve_frontend._main is their process's main (tests call serve())."""
    from vllm_lite.client import core_client
    from vllm_lite.entrypoints import serve_frontend

    seen: dict[str, Any] = {}

    async def fake_serve(args: Any, channel: Any = None, app_factory: Any = None, freeze_gc: bool = False) -> int:
        seen["freeze_gc"] = freeze_gc
        return 0

    monkeypatch.setattr(core_client, "set_frontend_thread_policy", lambda: None)  # this process's threads: as is
    monkeypatch.setattr(serve_frontend, "serve", fake_serve)
    assert serve_frontend._main(serve_frontend.FrontendArgs(engine=["ipc:///nowhere"], listen_fd=-1), None) == 0
    assert seen["freeze_gc"] is True
