"""`vllm-lite serve`: long-lived engine core(s) that frontends attach to, optionally with HTTP frontends.

Process tree (the ``serve`` process itself never loads the model; it supervises)::

    vllm-lite serve (supervisor)
      |- engine core rank 0..D-1   EngineCoreProc, bound at dp_core_addresses(address, D)
      |- HTTP frontend 0..N-1      `serve_frontend`, AsyncLLM attached to every core

* Each core and each HTTP frontend runs in its own process group, so a terminal
  Ctrl-C reaches only the supervisor, which then stops everything in order.
* Every child is started by ``vllm_lite.launcher`` (``python -m ...``, typed arguments over
  a pipe -- secrets included, never argv -- and a typed ready message or start-up error).
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
  pids and exit 1 at once when one dies. Every child exits when the supervisor
  is killed (the launcher's parent watch), so nothing is left behind.
* ``--port 0``: the supervisor binds free ports once and hands the bound sockets to the
  cores (``endpoints.resolve_port_zero``); nothing can take them in between.
* Security: the cores bind loopback unless told otherwise, and binding any other
  address requires an auth token (refused with ValueError otherwise).
"""

from __future__ import annotations

import ipaddress
import logging
import select
import signal
import socket
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, TextIO

from vllm_lite import launcher
from vllm_lite.endpoints import DEFAULT_ENGINE_PORT as DEFAULT_PORT
from vllm_lite.endpoints import (
    CoreAddresses,
    PortRun,
    bind_listening_socket,
    check_bind_address,
    dp_core_addresses,
    make_address,
    resolve_port_zero,
)

if TYPE_CHECKING:  # the heavy imports (torch) wait until serving starts: `vllm-lite --help` stays fast
    from vllm_lite.engine_args import EngineArgs

__all__ = ["DEFAULT_PORT", "ServeConfig", "ServeSupervisor", "make_address", "run_serve"]

logger = logging.getLogger("vllm_lite.serve")

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
    # vLLM's HTTP options for every frontend: FrontendArgs fields of the same names (chat_template, CORS, TLS, ...).
    http_options: dict[str, Any] = field(default_factory=dict)

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
        check_bind_allowed(self.address, self.auth_token)
        check_bind_address(self.address, self.data_parallel_size)  # the form and the port range


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
        host = address[len("tcp://") :].rpartition(":")[0]
        if not is_loopback_host(host) and not auth_token:
            raise ValueError(
                f"refusing to bind the engine core to {host!r} without an auth token: anyone who can reach it "
                f"could use the model. Pass --auth-token (or set ${AUTH_TOKEN_ENV}), or bind 127.0.0.1."
            )


def bind_http_socket(host: str, port: int) -> socket.socket:
    """The listening socket every HTTP frontend inherits and accepts on."""
    try:
        return bind_listening_socket(host, port)
    except ValueError as e:
        raise ValueError(f"{e} (for the HTTP API)") from None


# ---------------------------------------------------------------------------- the supervisor


@dataclass
class _Core:
    rank: int
    address: str
    proc: launcher.ChildProcess
    facts: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Frontend:
    index: int
    proc: launcher.ChildProcess


class ServeSupervisor:
    """Starts the cores (and HTTP frontends), prints where they listen, and watches them until stopped."""

    def __init__(self, cfg: ServeConfig, out: TextIO = sys.stdout) -> None:
        cfg.validate()
        self.cfg = cfg
        self.out = out
        self.cores: list[_Core] = []
        self.frontends: list[_Frontend] = []
        self.http_socket: Optional[socket.socket] = None
        self.metrics_dir: Optional[str] = None
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

    def _check_stop(self) -> None:
        if self._stop_signal is not None:
            raise KeyboardInterrupt("stopped during startup")

    def _start(self) -> None:
        from vllm_lite.client.core_client import ENGINE_CORE_MODULE
        from vllm_lite.client.exceptions import EngineStartupError
        from vllm_lite.config import encode_vllm_config
        from vllm_lite.core.messages import EngineCoreArgs, EngineCoreReady

        cfg = self.cfg
        configs = cfg.engine_args.create_dp_engine_configs()  # validates before any process starts
        if cfg.api_port is not None:
            self.http_socket = bind_http_socket(cfg.api_host, cfg.api_port)
        self.address, reserved = resolve_port_zero(cfg.address, cfg.data_parallel_size)
        try:
            for rank, (addr, config) in enumerate(
                zip(dp_core_addresses(self.address, cfg.data_parallel_size), configs, strict=True)
            ):
                addresses = CoreAddresses.from_base(addr)
                fds = _reserved_fds(reserved, rank)
                args = EngineCoreArgs(
                    vllm_config=encode_vllm_config(config),
                    input_address=addresses.input,
                    output_address=addresses.output,
                    input_fd=fds[0],
                    output_fd=fds[1],
                    auth_token=cfg.auth_token,
                    heartbeat_timeout_s=cfg.heartbeat_timeout_s,
                    drain_timeout_s=cfg.shutdown_timeout_s,
                    handle_sigint=True,
                )
                # Own session: a terminal's Ctrl-C reaches only the supervisor, which stops everything in order.
                proc = launcher.start_child(
                    ENGINE_CORE_MODULE,
                    args,
                    EngineCoreReady,
                    name=f"engine-core-{rank}",
                    new_session=True,
                    pass_fds=[fd for fd in fds if fd is not None],
                )
                self.cores.append(_Core(rank, addr, proc))
        finally:
            if reserved is not None:
                reserved.close()  # the cores hold the sockets now
        # Cores load in parallel; wait for every one (or the first failure, or a stop signal).
        try:
            readies = launcher.wait_ready([c.proc for c in self.cores], cfg.startup_timeout_s, self._check_stop)
        except launcher.ChildStartupError as e:
            raise EngineStartupError(f"engine core failed to start: {e}") from e
        for core, ready in zip(self.cores, readies, strict=True):
            core.facts = ready.model_facts()
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
            self._say(
                f"vllm-lite data parallel: {len(self.cores)} engine cores; attach with "
                f"engine_address={self.address!r}, data_parallel_size={len(self.cores)}"
            )

    def _start_frontends(self) -> None:
        from vllm_lite.entrypoints.serve_frontend import FRONTEND_MODULE, FrontendArgs, FrontendReady

        cfg = self.cfg
        assert self.http_socket is not None
        listen_fd = self.http_socket.fileno()
        # One metrics directory for all frontends (prometheus-client multiprocess mode): a scrape of any
        # one of them sums every frontend's counters. Removed when they are stopped, or, if this process is
        # killed first, by the frontends that outlive it (the launcher's cleanup paths).
        import tempfile

        self.metrics_dir = tempfile.mkdtemp(prefix="vllm-lite-metrics-")
        for i in range(cfg.api_servers):
            args = FrontendArgs(
                engine=[c.address for c in self.cores],
                listen_fd=listen_fd,
                core_pids=[c.proc.pid for c in self.cores],
                frontend_name=f"http-{i}",
                auth_token=cfg.auth_token,
                api_key=cfg.api_key,  # in the typed args, never on the command line
                served_model_names=list(cfg.served_model_names),
                uvicorn_log_level=cfg.uvicorn_log_level,
                **cfg.http_options,
            )
            proc = launcher.start_child(
                FRONTEND_MODULE,
                args,
                FrontendReady,
                name=f"http-{i}",
                pass_fds=[listen_fd],
                new_session=True,
                env={"PROMETHEUS_MULTIPROC_DIR": self.metrics_dir},
                cleanup_paths=[self.metrics_dir],
            )
            self.frontends.append(_Frontend(i, proc))

        def check() -> None:
            self._check_stop()
            for core in self.cores:
                if not core.proc.is_alive():
                    raise RuntimeError(f"engine core {core.rank} exited with code {core.proc.exitcode} during startup.")

        try:
            launcher.wait_ready([f.proc for f in self.frontends], min(cfg.startup_timeout_s, 300.0), check)
        except launcher.ChildStartupError as e:
            raise RuntimeError(f"HTTP frontend failed to start: {e}") from e
        host = cfg.api_host if ":" not in cfg.api_host else f"[{cfg.api_host}]"
        port = self.http_socket.getsockname()[1]
        scheme = "https" if cfg.http_options.get("ssl_certfile") else "http"
        loopback = " (loopback only: --host 0.0.0.0 serves other machines)" if is_loopback_host(cfg.api_host) else ""
        self._say(
            f"vllm-lite OpenAI API on {scheme}://{host}:{port}{cfg.http_options.get('root_path', '')} "
            f"({len(self.frontends)} HTTP frontend{'s' if len(self.frontends) != 1 else ''} sharing the port)"
            f"{loopback}"
        )

    # -------------------------------------------------------------- run
    def run(self) -> int:
        """Watch until a stop signal (-> drain, exit code 0) or a child's death (-> stop all, non-zero)."""
        watched = [c.proc.fileno() for c in self.cores] + [f.proc.fileno() for f in self.frontends]
        while True:
            if self._stop_signal is not None:
                name = signal.Signals(self._stop_signal).name
                logger.info("%s received: draining requests for up to %.1f s.", name, self.cfg.shutdown_timeout_s)
                return self._stop_all(failed=False)
            for core in self.cores:
                if not core.proc.is_alive():
                    logger.error(
                        "Engine core %d exited unexpectedly with code %s: stopping.", core.rank, core.proc.exitcode
                    )
                    return self._stop_all(failed=True)
            for fe in self.frontends:
                if not fe.proc.is_alive():
                    logger.error(
                        "HTTP frontend %d exited unexpectedly with code %s: stopping.", fe.index, fe.proc.exitcode
                    )
                    return self._stop_all(failed=True)
            select.select(watched, [], [], _POLL_S)  # wakes on a child's exit; signals are seen within _POLL_S

    def _stop_all(self, failed: bool) -> int:
        """Cores first (they drain), then the HTTP frontends; returns the exit code."""
        if not failed:
            for fe in self.frontends:  # the cores' exit is about to be on purpose
                fe.proc.send_control(launcher.Control("stop"))
        launcher.stop_all([c.proc for c in self.cores], self.cfg.shutdown_timeout_s + _CORE_EXIT_GRACE_S)
        if failed and self.frontends and any(c.proc.exitcode not in (0, None) for c in self.cores):
            # They watch the cores and exit 1 on their own (so their own supervisor, if any, sees the failure).
            launcher.wait_exited([f.proc for f in self.frontends], _FRONTEND_SELF_EXIT_S)
        launcher.stop_all([f.proc for f in self.frontends], _FRONTEND_STOP_S)
        for fe in self.frontends:
            logger.info("HTTP frontend %d exited with code %s.", fe.index, fe.proc.exitcode)
        if self.http_socket is not None:
            self.http_socket.close()
            self.http_socket = None
        if self.metrics_dir is not None:
            import shutil

            shutil.rmtree(self.metrics_dir, ignore_errors=True)
            self.metrics_dir = None
        if failed:
            return 1
        bad = [c for c in self.cores if c.proc.exitcode not in (0, None)]
        for c in bad:
            logger.error("Engine core %d exited with code %s.", c.rank, c.proc.exitcode)
        return 1 if bad else 0


def _reserved_fds(reserved: Optional[PortRun], rank: int) -> tuple[Optional[int], Optional[int]]:
    """Core ``rank``'s (input, output) sockets from a port reservation, or (None, None) to bind itself."""
    if reserved is None:
        return None, None
    fds = reserved.fds()
    return fds[2 * rank], fds[2 * rank + 1]


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
