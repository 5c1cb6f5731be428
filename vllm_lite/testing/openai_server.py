"""Run the real HTTP server (uvicorn on 127.0.0.1) for tests, on a port nobody else can take.

`ServerThread` serves in a background thread with its own event loop, so a
test can reach the engine object (utility calls, core pid); it binds the
listening socket once and hands it to uvicorn. `ServerProcess` runs
`python -m vllm_lite.entrypoints.openai.api_server --port 0` as a child
process, for what only a process shows (its exit code): the kernel picks the
port at bind time and the server reports it in its start-up line, so there is
no bind-and-release race with other tests.
"""

from __future__ import annotations

import asyncio
import os
import re
import socket
import subprocess
import sys
import threading
from typing import Any, Callable, Optional

import httpx

from vllm_lite.entrypoints.openai.api_server import build_app, serve_app
from vllm_lite.testing.waiting import wait_until

# uvicorn's start-up line; with --port 0 it names the port the kernel chose.
_RUNNING_ON = re.compile(rb"Uvicorn running on http://[^:]+:(\d+)")


def wait_healthy(base_url: str, timeout_s: float, proc: Optional[subprocess.Popen] = None) -> None:
    """Poll /health until 200; fail at once if `proc` exits first."""
    last: list[Any] = [None]

    def healthy() -> bool:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited early with code {proc.returncode}")
        try:
            r = httpx.get(base_url + "/health", timeout=5)
        except httpx.HTTPError as e:
            last[0] = e
            return False
        last[0] = r.text
        return r.status_code == 200

    try:
        wait_until(healthy, timeout_s, f"server at {base_url} healthy", interval_s=0.1)
    except TimeoutError as e:
        raise TimeoutError(f"{e}: last answer {last[0]!r}") from None


class ServerThread:
    """uvicorn + build_app in a daemon thread; `engine_factory` runs inside the server's loop."""

    def __init__(self, engine_factory: Callable[[], Any], startup_timeout_s: float = 300.0, **app_kwargs: Any):
        self._factory = engine_factory
        self._app_kwargs = app_kwargs
        self._ready = threading.Event()
        self._error: Optional[BaseException] = None
        self.engine: Any = None
        self.app: Any = None
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.exit_code: Optional[int] = None
        self._thread = threading.Thread(target=self._main, daemon=True, name="openai-server")
        self._thread.start()
        if not self._ready.wait(startup_timeout_s):
            raise TimeoutError("server thread did not start")
        if self._error is not None:
            raise self._error
        wait_healthy(self.base_url, startup_timeout_s)

    def _main(self) -> None:
        async def main() -> int:
            self.loop = asyncio.get_running_loop()
            try:
                self.engine = self._factory()
                self.app = build_app(self.engine, **self._app_kwargs)
            except BaseException as e:
                self._error = e
                self._ready.set()
                raise
            self._ready.set()
            return await serve_app(self.app, sock=self.sock, log_level="warning")

        try:
            self.exit_code = asyncio.run(main())
        except BaseException as e:  # noqa: BLE001 - reported to the test through _error
            self._error = self._error or e
        finally:
            if self.engine is not None:
                try:
                    self.engine.shutdown()
                except Exception:
                    pass

    def call(self, coro_fn: Callable[[], Any], timeout_s: float = 30.0) -> Any:
        """Run `coro_fn()` on the server's loop (where the engine lives) and return its result."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro_fn(), self.loop).result(timeout_s)

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.app is not None and self.app.state.server is not None and self.loop is not None:
            server = self.app.state.server
            self.loop.call_soon_threadsafe(setattr, server, "should_exit", True)
        self._thread.join(timeout_s)


class ServerProcess:
    """`python -m vllm_lite.entrypoints.openai.api_server ARGS --port 0`; the port is read from its start-up line."""

    def __init__(self, args: list[str], startup_timeout_s: float = 300.0) -> None:
        env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "vllm_lite.entrypoints.openai.api_server",
                *args,
                "--port",
                "0",
                "--uvicorn-log-level",
                "info",
            ],
            env=env,
            stderr=subprocess.PIPE,
        )
        self._port: Optional[int] = None
        self._port_known = threading.Event()
        self._reader = threading.Thread(target=self._relay_stderr, daemon=True, name="server-stderr")
        self._reader.start()
        try:
            if not self._port_known.wait(startup_timeout_s) or self._port is None:
                raise RuntimeError(f"server did not report its port (exit code {self.proc.poll()})")
            self.port = self._port
            self.base_url = f"http://127.0.0.1:{self.port}"
            wait_healthy(self.base_url, startup_timeout_s, self.proc)
        except BaseException:
            self.kill()
            raise

    def _relay_stderr(self) -> None:
        """Copy the child's stderr to ours (pytest shows it on failure) and catch the port it reports."""
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            if self._port is None:
                m = _RUNNING_ON.search(line)
                if m:
                    self._port = int(m.group(1))
                    self._port_known.set()
            os.write(2, line)  # the fd, not sys.stderr: pytest may swap that object between tests
        self._port_known.set()  # EOF: the child is gone; the waiter sees no port

    def core_pids(self) -> list[int]:
        """Children of the server process except multiprocessing's resource tracker: the engine core."""
        pids: list[int] = []
        task_dir = f"/proc/{self.proc.pid}/task"
        for tid in os.listdir(task_dir):
            try:
                with open(f"{task_dir}/{tid}/children") as f:
                    pids += [int(p) for p in f.read().split()]
            except OSError:
                pass
        out = []
        for pid in pids:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if b"resource_tracker" not in f.read():
                        out.append(pid)
            except OSError:
                pass
        return out

    def terminate(self, timeout_s: float = 60.0) -> int:
        """SIGTERM (graceful shutdown); returns the exit code."""
        self.proc.terminate()
        return self.proc.wait(timeout_s)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
