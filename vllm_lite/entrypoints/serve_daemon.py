"""`vllm-lite serve`: long-lived engine core(s) that frontends attach to, optionally with HTTP frontends.

Process tree (the ``serve`` process itself never loads the model; it supervises)::

    vllm-lite serve (supervisor)
      |- engine core rank 0..D-1   EngineCoreProc, bound at dp_core_addresses(address, D)
      |- HTTP frontend 0..N-1      `serve_frontend`, AsyncLLM attached to every core

* Each core and each HTTP frontend runs in its own process group, so a terminal
  Ctrl-C reaches only the supervisor, which then stops everything in order.
* The HTTP frontends share ONE listening socket: the supervisor binds
  ``--api-host:--api-port`` once (a busy port fails before the model loads) and
  every frontend inherits it and accepts on it; each new connection goes to
  whichever frontend's event loop gets to ``accept()`` first, so a frontend busy
  detokenizing takes fewer new connections. (Chosen over SO_REUSEPORT: one bind,
  no other process can join the port, and a frontend restart loses no backlog.)
* Stop (SIGTERM / SIGINT): the cores stop taking new requests and drain running
  ones for at most ``shutdown_timeout_s``; when they have exited, the HTTP
  frontends are stopped; exit 0.
* Failure: a core or an HTTP frontend that exits on its own stops everything
  and the supervisor exits non-zero. The HTTP frontends watch the cores'
  pids and exit 1 at once when one dies. Cores watch the supervisor's pid and
  exit if it is killed, so nothing is left behind.
* Security: the cores bind loopback unless told otherwise, and binding any other
  address requires an auth token (refused with ValueError otherwise).
"""

from __future__ import annotations

import ipaddress
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, TextIO

import msgspec

if TYPE_CHECKING:  # the heavy imports (torch) wait until serving starts: `vllm-lite --help` stays fast
    from vllm_lite.config import EngineArgs, VllmConfig

logger = logging.getLogger("vllm_lite.serve")

DEFAULT_PORT = 8100
DEFAULT_HEARTBEAT_TIMEOUT_S = 10.0
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
AUTH_TOKEN_ENV = "VLLM_LITE_AUTH_TOKEN"
# How often the supervisor looks at its children and signals.
_POLL_S = 0.1
# Grace for HTTP frontends to finish after the cores are gone, before SIGKILL.
_FRONTEND_STOP_S = 15.0
# After a core died: time the HTTP frontends get to notice and exit 1 themselves before SIGTERM.
_FRONTEND_SELF_EXIT_S = 5.0
# Extra time a core gets past its drain timeout (closing sockets, freeing the model) before SIGKILL.
_CORE_EXIT_GRACE_S = 15.0


@dataclass
class ServeConfig:
    """Everything `vllm-lite serve` was asked for."""

    engine_args: EngineArgs
    address: str = f"tcp://127.0.0.1:{DEFAULT_PORT}"
    auth_token: Optional[str] = None
    heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S
    shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S
    data_parallel_size: int = 1
    api_port: Optional[int] = None  # None: no HTTP frontends
    api_host: str = "127.0.0.1"
    api_servers: int = 1
    api_key: Optional[str] = None
    served_model_names: list[str] = field(default_factory=list)
    startup_timeout_s: float = 600.0
    uvicorn_log_level: str = "warning"

    def validate(self) -> None:
        for name in ("heartbeat_timeout_s", "shutdown_timeout_s", "startup_timeout_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise ValueError(f"{name} must be a non-negative number, got {v!r}.")
        if self.heartbeat_timeout_s <= 0:
            raise ValueError(f"heartbeat_timeout_s must be positive, got {self.heartbeat_timeout_s!r}.")
        if not isinstance(self.api_servers, int) or isinstance(self.api_servers, bool) or self.api_servers < 1:
            raise ValueError(f"api_servers must be a positive integer, got {self.api_servers!r}.")
        if self.api_port is not None and not 0 <= self.api_port < 65536:
            raise ValueError(f"api_port must be 0..65535, got {self.api_port!r}.")
        if self.auth_token is not None and (not isinstance(self.auth_token, str) or not self.auth_token):
            raise ValueError("auth_token must be a non-empty string or None.")
        from vllm_lite.client.dp_client import dp_core_addresses

        check_bind_allowed(self.address, self.auth_token)
        dp_core_addresses(self.address, self.data_parallel_size)  # validates the form and the port range


# ---------------------------------------------------------------------------- addresses


def is_loopback_host(host: str) -> bool:
    """True when ``host`` names only this machine (127.0.0.0/8, ::1, or a name resolving only to them)."""
    h = host.strip("[]")
    if h == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(h, None)
    except socket.gaierror:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def check_bind_allowed(address: str, auth_token: Optional[str]) -> None:
    """Refuse (ValueError) to bind a non-loopback TCP address without an auth token."""
    if address.startswith("tcp://"):
        host = address[len("tcp://"):].rpartition(":")[0]
        if not is_loopback_host(host) and not auth_token:
            raise ValueError(
                f"refusing to bind the engine core to {host!r} without an auth token: anyone who can reach it "
                f"could use the model. Pass --auth-token (or set ${AUTH_TOKEN_ENV}), or bind 127.0.0.1."
            )


def make_address(host: str, port: Optional[int], address: Optional[str]) -> str:
    """The base address from --address, or from --host/--port."""
    if address:
        return address
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{DEFAULT_PORT if port is None else port}"


def find_free_port_run(host: str, count: int, attempts: int = 100) -> int:
    """A port P such that P..P+count-1 are free on ``host`` right now (for --port 0)."""
    h = host.strip("[]")
    family = socket.AF_INET6 if ":" in h else socket.AF_INET
    for _ in range(attempts):
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((h, 0))
            first = s.getsockname()[1]
        if first + count > 65535:
            continue
        held: list[socket.socket] = []
        try:
            for p in range(first, first + count):
                s = socket.socket(family, socket.SOCK_STREAM)
                held.append(s)
                s.bind((h, p))
            return first
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise RuntimeError(f"could not find {count} consecutive free ports on {host}.")


def resolve_port_zero(address: str, data_parallel_size: int) -> str:
    """``tcp://HOST:0`` -> a free run of ports for every core's socket pair; others unchanged."""
    if not address.startswith("tcp://"):
        return address
    host, _, port = address[len("tcp://"):].rpartition(":")
    if port != "0":
        return address
    return f"tcp://{host}:{find_free_port_run(host, 2 * data_parallel_size)}"


def bind_http_socket(host: str, port: int) -> socket.socket:
    """The listening socket every HTTP frontend inherits and accepts on."""
    h = host.strip("[]")
    family = socket.AF_INET6 if ":" in h else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((h, port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port} for the HTTP API: {e}") from e
    sock.set_inheritable(True)
    return sock


def _core_process_main(config: VllmConfig, addresses: Any, options: Any, ready_pipe: Any) -> None:
    """Core process target: own process group (Ctrl-C goes to the supervisor), then serve."""
    from vllm_lite.core.engine_core_proc import EngineCoreProc

    try:
        os.setpgrp()
    except OSError:
        pass
    EngineCoreProc.run_engine_core(config, addresses, options, ready_pipe)


# ---------------------------------------------------------------------------- the supervisor


@dataclass
class _Core:
    rank: int
    address: str
    proc: Any  # multiprocessing Process
    facts: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Frontend:
    index: int
    proc: subprocess.Popen
    ready_fd: int


class ServeSupervisor:
    """Starts the cores (and HTTP frontends), prints where they listen, and watches them until stopped."""

    def __init__(self, cfg: ServeConfig, out: TextIO = sys.stdout) -> None:
        cfg.validate()
        self.cfg = cfg
        self.out = out
        self.cores: list[_Core] = []
        self.frontends: list[_Frontend] = []
        self.http_socket: Optional[socket.socket] = None
        self._stop_signal: Optional[int] = None
        self.address = cfg.address

    # -------------------------------------------------------------- signals
    def _on_signal(self, signum: int, frame: Any) -> None:
        if self._stop_signal is None:
            self._stop_signal = signum

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)

    def request_stop(self) -> None:
        """Same as SIGTERM (tests, embedding)."""
        self._on_signal(signal.SIGTERM, None)

    def _say(self, line: str) -> None:
        print(line, file=self.out, flush=True)

    # -------------------------------------------------------------- start
    def start(self) -> None:
        """Start everything and return once it all serves; raises (with everything stopped) on failure."""
        try:
            self._start()
        except BaseException:
            self._stop_all(failed=True)
            raise

    def _start(self) -> None:
        from vllm_lite.client.dp_client import dp_core_addresses
        from vllm_lite.client.exceptions import EngineStartupError
        from vllm_lite.core.engine_core_proc import CoreAddresses, CoreProcOptions

        cfg = self.cfg
        configs = cfg.engine_args.create_dp_engine_configs()  # validates before any process starts
        if cfg.api_port is not None:
            self.http_socket = bind_http_socket(cfg.api_host, cfg.api_port)
        self.address = resolve_port_zero(cfg.address, cfg.data_parallel_size)
        options = CoreProcOptions(
            auth_token=cfg.auth_token,
            heartbeat_timeout_s=cfg.heartbeat_timeout_s,
            drain_timeout_s=cfg.shutdown_timeout_s,
            parent_pid=os.getpid(),
            handle_sigint=True,
        )
        ctx = multiprocessing.get_context("spawn")
        readers = []
        for rank, (addr, config) in enumerate(zip(dp_core_addresses(self.address, cfg.data_parallel_size), configs)):
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_core_process_main,
                args=(config, CoreAddresses.from_base(addr), options, writer),
                name=f"VllmLiteEngineCore-{rank}",
            )
            proc.start()
            writer.close()
            self.cores.append(_Core(rank, addr, proc))
            readers.append(reader)
        # Cores load in parallel; wait for every one (or the first failure, or a stop signal).
        deadline = time.monotonic() + cfg.startup_timeout_s
        pending = dict(zip(readers, self.cores))
        while pending:
            if self._stop_signal is not None:
                raise KeyboardInterrupt("stopped during startup")
            if time.monotonic() > deadline:
                raise EngineStartupError(f"engine core did not become ready within {cfg.startup_timeout_s:.0f} s.")
            waitables = list(pending) + [c.proc.sentinel for c in pending.values()]
            ready = multiprocessing.connection.wait(waitables, timeout=_POLL_S)
            for reader, core in list(pending.items()):
                if reader not in ready and core.proc.sentinel not in ready:
                    continue
                del pending[reader]
                try:
                    message = msgspec.json.decode(reader.recv_bytes()) if reader.poll() else None
                except (EOFError, OSError):
                    message = None
                reader.close()
                if message is None:
                    core.proc.join(5.0)
                    message = {"status": "failed", "error": f"process exited with code {core.proc.exitcode}"}
                if message.get("status") != "ready":
                    raise EngineStartupError(f"engine core {core.rank} failed to start: {message.get('error')}")
                core.facts = dict(message.get("model_facts") or {})
        for core in self.cores:
            f = core.facts
            rank = f" {core.rank}/{len(self.cores)}" if len(self.cores) > 1 else ""
            self._say(
                f"vllm-lite engine core{rank} listening on {core.address} (model {f.get('model')}, "
                f"{f.get('num_gpu_blocks')} KV blocks of {f.get('block_size')} tokens, "
                f"max_model_len {f.get('max_model_len')}, pid {core.proc.pid})"
            )
        if self.http_socket is not None:
            self._start_frontends()
        if len(self.cores) > 1:
            self._say(f"vllm-lite data parallel: {len(self.cores)} engine cores; attach with "
                      f"engine_address={self.address!r}, data_parallel_size={len(self.cores)}")

    def _frontend_command(self, index: int, ready_fd: int) -> list[str]:
        cfg = self.cfg
        assert self.http_socket is not None
        cmd = [
            sys.executable, "-m", "vllm_lite.entrypoints.serve_frontend",
            "--engine", ",".join(c.address for c in self.cores),
            "--listen-fd", str(self.http_socket.fileno()),
            "--ready-fd", str(ready_fd),
            "--core-pids", ",".join(str(c.proc.pid) for c in self.cores),
            "--frontend-name", f"http-{index}",
            "--control-stdin",
            "--uvicorn-log-level", cfg.uvicorn_log_level,
        ]
        if cfg.served_model_names:
            cmd += ["--served-model-name", *cfg.served_model_names]
        return cmd

    def _start_frontends(self) -> None:
        cfg = self.cfg
        assert self.http_socket is not None
        env = dict(os.environ)
        # Secrets travel in the environment, not on the command line (which `ps` shows).
        env.pop(AUTH_TOKEN_ENV, None)
        env.pop("VLLM_LITE_API_KEY", None)
        if cfg.auth_token:
            env[AUTH_TOKEN_ENV] = cfg.auth_token
        if cfg.api_key:
            env["VLLM_LITE_API_KEY"] = cfg.api_key
        for i in range(cfg.api_servers):
            r, w = os.pipe()
            try:
                proc = subprocess.Popen(
                    self._frontend_command(i, w), env=env, pass_fds=(self.http_socket.fileno(), w),
                    start_new_session=True, stdin=subprocess.PIPE,
                )
            finally:
                os.close(w)
            self.frontends.append(_Frontend(i, proc, r))
        deadline = time.monotonic() + min(self.cfg.startup_timeout_s, 300.0)
        waiting = {f.ready_fd: f for f in self.frontends}
        while waiting:
            if self._stop_signal is not None:
                raise KeyboardInterrupt("stopped during startup")
            if time.monotonic() > deadline:
                raise RuntimeError("HTTP frontends did not start within the startup timeout.")
            for fd in multiprocessing.connection.wait(list(waiting), timeout=_POLL_S):
                fe = waiting.pop(fd)
                data = os.read(fd, 16)
                os.close(fd)
                fe.ready_fd = -1
                if not data:
                    fe.proc.wait(5.0)
                    raise RuntimeError(f"HTTP frontend {fe.index} exited with code {fe.proc.returncode} during startup.")
            for core in self.cores:
                if not core.proc.is_alive():
                    raise RuntimeError(f"engine core {core.rank} exited with code {core.proc.exitcode} during startup.")
        host = self.cfg.api_host if ":" not in self.cfg.api_host else f"[{self.cfg.api_host}]"
        port = self.http_socket.getsockname()[1]
        self._say(f"vllm-lite OpenAI API on http://{host}:{port} ({len(self.frontends)} HTTP frontend"
                  f"{'s' if len(self.frontends) != 1 else ''} sharing the port)")

    # -------------------------------------------------------------- run
    def run(self) -> int:
        """Watch until a stop signal (-> drain, exit code 0) or a child's death (-> stop all, non-zero)."""
        while True:
            if self._stop_signal is not None:
                name = signal.Signals(self._stop_signal).name
                logger.info("%s received: draining requests for up to %.1f s.", name, self.cfg.shutdown_timeout_s)
                return self._stop_all(failed=False)
            for core in self.cores:
                if not core.proc.is_alive():
                    logger.error("Engine core %d exited unexpectedly with code %s: stopping.",
                                 core.rank, core.proc.exitcode)
                    return self._stop_all(failed=True)
            for fe in self.frontends:
                if fe.proc.poll() is not None:
                    logger.error("HTTP frontend %d exited unexpectedly with code %s: stopping.",
                                 fe.index, fe.proc.returncode)
                    return self._stop_all(failed=True)
            time.sleep(_POLL_S)

    def _stop_all(self, failed: bool) -> int:
        """Cores first (they drain), then the HTTP frontends; returns the exit code."""
        if not failed:
            for fe in self.frontends:  # the cores' exit is about to be on purpose
                try:
                    assert fe.proc.stdin is not None
                    fe.proc.stdin.write(b"stop\n")
                    fe.proc.stdin.flush()
                except (OSError, ValueError):
                    pass
        for core in self.cores:
            if core.proc.is_alive():
                core.proc.terminate()
        deadline = time.monotonic() + self.cfg.shutdown_timeout_s + _CORE_EXIT_GRACE_S
        for core in self.cores:
            if core.proc.pid is None:
                continue
            core.proc.join(max(0.0, deadline - time.monotonic()))
            if core.proc.is_alive():
                logger.error("Engine core %d did not exit in time: killing it.", core.rank)
                core.proc.kill()
                core.proc.join(5.0)
        if failed and any(not c.proc.is_alive() for c in self.cores):
            # They watch the cores and exit 1 on their own (so their own supervisor, if any, sees the failure).
            deadline = time.monotonic() + _FRONTEND_SELF_EXIT_S
            while time.monotonic() < deadline and any(fe.proc.poll() is None for fe in self.frontends):
                time.sleep(_POLL_S)
        for fe in self.frontends:
            if fe.proc.poll() is None:
                fe.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + _FRONTEND_STOP_S
        for fe in self.frontends:
            try:
                fe.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.error("HTTP frontend %d did not exit in time: killing it.", fe.index)
                fe.proc.kill()
                fe.proc.wait(5.0)
            logger.info("HTTP frontend %d exited with code %s.", fe.index, fe.proc.returncode)
            if fe.ready_fd >= 0:
                os.close(fe.ready_fd)
                fe.ready_fd = -1
            if fe.proc.stdin is not None:
                try:
                    fe.proc.stdin.close()
                except OSError:
                    pass
        if self.http_socket is not None:
            self.http_socket.close()
            self.http_socket = None
        if failed:
            return 1
        bad = [c for c in self.cores if c.proc.exitcode not in (0, None)]
        for c in bad:
            logger.error("Engine core %d exited with code %s.", c.rank, c.proc.exitcode)
        return 1 if bad else 0


def run_serve(cfg: ServeConfig, out: TextIO = sys.stdout) -> int:
    """`vllm-lite serve` in the foreground: start, print where it listens, serve until stopped."""
    if not logging.getLogger().handlers:
        from vllm_lite.logging_utils import configure_process_logging

        configure_process_logging("serve")
    sup = ServeSupervisor(cfg, out)
    sup.install_signal_handlers()
    try:
        sup.start()
    except KeyboardInterrupt:
        return 0
    return sup.run()
