"""The one place that starts and supervises child processes (engine cores, tensor-parallel ranks, HTTP frontends).

Why a launcher of our own: multiprocessing's "spawn" re-imports the user's ``__main__``
in every child, so a script without a main guard ran twice, ``python - <<EOF`` failed
on ``'<stdin>'`` and notebooks broke. Here every child is a fresh interpreter,
``python -m MODULE --launcher-fds C,S --log-level LEVEL --name NAME``, and nothing of
the parent's ``__main__`` is ever imported.

Two pipes per child:

* control (parent -> child): one frame with the child's arguments -- ONE typed msgspec
  struct, msgpack (never argv, which ``ps`` shows; never pickle) -- then any ``Control``
  frames. The parent keeps its end open for the child's whole life, so EOF means the
  parent is gone: a daemon thread in the child notices, removes the paths the parent
  asked it to clean up and exits. Where the parent started the child from its main
  thread, ``PR_SET_PDEATHSIG`` (SIGTERM) backs the pipe up (the kernel ties that signal
  to the spawning *thread*, so it is not used from other threads).
* status (child -> parent): one frame, the caller's ready struct or a ``StartupError``
  carrying the child's exception type, message and traceback text. The child keeps
  its end open until it exits, so once the frame is read EOF means "exited".

Children never inherit the secret variables of ``envs.SECRET_VARIABLES``; a secret a child
needs travels in its arguments struct or in ``env`` for that one child.

Parent side: ``start_child`` -> ``ChildProcess`` (``wait_ready``, ``fileno`` for
``zmq.Poller`` / ``select`` / ``loop.add_reader``, ``stop``), ``wait_ready`` for several at
once, ``stop_all``. Child side: ``run_child(ArgsType, main)`` or ``child_startup`` +
``ChildChannel``.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import selectors
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
import traceback
from typing import Any, Callable, Generic, NoReturn, Optional, Sequence, TypeVar

import msgspec

from vllm_lite import envs

logger = logging.getLogger("vllm_lite.launcher")

A = TypeVar("A", bound=msgspec.Struct)
R = TypeVar("R", bound=msgspec.Struct)

_HEADER = struct.Struct("<I")
_MAX_FRAME = 64 << 20
# How long stop() waits for a killed child to be reaped before giving up on it.
_REAP_S = 5.0
_PR_SET_PDEATHSIG = 1


# ---------------------------------------------------------------------------- wire types


class StartupError(msgspec.Struct):
    """What a child that failed before it was ready tells its parent."""

    exc_type: str
    message: str
    traceback: str


class Control(msgspec.Struct):
    """A message from a parent to its running child (e.g. ``kind="stop"``: what follows is on purpose)."""

    kind: str
    data: str = ""


class _Envelope(msgspec.Struct):
    """The first control frame: the caller's typed arguments plus what the launcher itself needs."""

    args: msgspec.Raw
    parent_pid: int
    death_signal: bool = False
    cleanup_paths: list[str] = []


class _Status(msgspec.Struct):
    """The status frame: ``ready`` (the caller's struct, msgpack-encoded) or ``error``."""

    ready: Optional[bytes] = None
    error: Optional[StartupError] = None


class ChildStartupError(RuntimeError):
    """A child failed before it was ready: its exception type, message and traceback text."""

    def __init__(self, name: str, exc_type: str, message: str, traceback_text: str = "",
                 exitcode: Optional[int] = None) -> None:
        super().__init__(f"{name}: {exc_type}: {message}")
        self.name = name
        self.exc_type = exc_type
        self.message = message
        self.traceback = traceback_text
        self.exitcode = exitcode


def _write_frame(fd: int, payload: bytes) -> None:
    data = memoryview(_HEADER.pack(len(payload)) + payload)
    while data:
        data = data[os.write(fd, data):]


def _read_exact(fd: int, n: int) -> Optional[bytes]:
    """``n`` bytes, or None at EOF (a peer that exited mid-frame counts as EOF)."""
    chunks: list[bytes] = []
    while n:
        chunk = os.read(fd, n)
        if not chunk:
            return None
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _read_frame(fd: int) -> Optional[bytes]:
    header = _read_exact(fd, _HEADER.size)
    if header is None:
        return None
    (size,) = _HEADER.unpack(header)
    if size > _MAX_FRAME:
        raise ValueError(f"launcher frame of {size} bytes is larger than {_MAX_FRAME}")
    return _read_exact(fd, size)


# ---------------------------------------------------------------------------- parent side


def open_pidfd(pid: int) -> Optional[int]:
    """A pidfd for ``pid`` (readable once it exits), or None where Linux/Python lack pidfds."""
    pidfd_open = getattr(os, "pidfd_open", None)
    if pidfd_open is None:
        return None
    try:
        return pidfd_open(pid)
    except OSError:
        return None


class ChildProcess(Generic[R]):
    """A started child: its readiness, a watchable fd, and the one way to stop it."""

    def __init__(self, name: str, popen: subprocess.Popen, control_fd: int, status_fd: int,
                 ready_type: type[R]) -> None:
        self.name = name
        self.popen = popen
        self.pid = popen.pid
        self._control_fd: Optional[int] = control_fd
        self._status_fd: Optional[int] = status_fd
        self._ready_type = ready_type
        self._pidfd = open_pidfd(popen.pid)
        self.ready_message: Optional[R] = None
        self._lock = threading.Lock()

    # -------------------------------------------------------------- state
    @property
    def exitcode(self) -> Optional[int]:
        """None while running; the exit code, or minus the signal number that killed it."""
        return self.popen.poll()

    def poll(self) -> Optional[int]:
        return self.popen.poll()

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def fileno(self) -> int:
        """An fd that becomes readable when the child exits: its pidfd, else its status pipe (EOF)."""
        if self._pidfd is not None:
            return self._pidfd
        if self._status_fd is None:
            raise ValueError(f"{self.name} is stopped: nothing to watch.")
        return self._status_fd

    def wait(self, timeout: Optional[float] = None) -> Optional[int]:
        """The exit code once the child exited within ``timeout``, else None."""
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    # -------------------------------------------------------------- startup
    def wait_ready(self, timeout: Optional[float] = None, abort: Optional[Callable[[], None]] = None) -> R:
        """The child's ready struct; raises ChildStartupError if it fails, exits or times out first."""
        return wait_ready([self], timeout, abort)[0]

    def _read_status(self) -> R:
        """Read the status frame (the fd is readable); raise ChildStartupError unless it says ready."""
        assert self._status_fd is not None
        try:
            frame = _read_frame(self._status_fd)
            status = msgspec.msgpack.decode(frame, type=_Status) if frame is not None else None
        except (OSError, ValueError, msgspec.DecodeError) as e:
            raise ChildStartupError(self.name, type(e).__name__, f"unreadable start-up status: {e}") from None
        if status is None or (status.ready is None and status.error is None):
            code = self.wait(_REAP_S)
            raise ChildStartupError(self.name, "ChildExited",
                                    f"exited with code {code} before it was ready", exitcode=code)
        if status.error is not None:
            err = status.error
            raise ChildStartupError(self.name, err.exc_type, err.message, err.traceback, self.wait(_REAP_S))
        try:
            self.ready_message = msgspec.msgpack.decode(status.ready, type=self._ready_type)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise ChildStartupError(self.name, "ProtocolError", f"malformed ready message: {e}") from None
        return self.ready_message

    def startup_error(self) -> Optional[ChildStartupError]:
        """For a child that has exited: why it never became ready (None if it had)."""
        if self.ready_message is not None or self._status_fd is None:
            return None
        try:
            self._read_status()
        except ChildStartupError as e:
            return e
        return None

    # -------------------------------------------------------------- running
    def send_control(self, message: Control) -> bool:
        """Tell the running child something; False if it can no longer hear it."""
        with self._lock:
            if self._control_fd is None:
                return False
            try:
                _write_frame(self._control_fd, msgspec.msgpack.encode(message))
                return True
            except OSError:
                return False

    def terminate(self) -> None:
        """SIGTERM, unless it has already exited."""
        if self.popen.poll() is None:
            try:
                self.popen.terminate()
            except ProcessLookupError:
                pass

    def stop(self, grace_s: float = 5.0) -> Optional[int]:
        """Terminate, wait ``grace_s``, kill, reap, close our fds. Idempotent; returns the exit code."""
        stop_all([self], grace_s)
        return self.popen.returncode

    def close(self) -> None:
        """Close our pipe ends and pidfd (after the child exited; EOF on control means 'parent gone')."""
        with self._lock:
            for attr in ("_control_fd", "_status_fd", "_pidfd"):
                fd = getattr(self, attr)
                if fd is not None:
                    setattr(self, attr, None)
                    try:
                        os.close(fd)
                    except OSError:
                        pass

    def __repr__(self) -> str:
        return f"ChildProcess({self.name!r}, pid={self.pid}, exitcode={self.exitcode})"


def default_child_log_level() -> str:
    """Our "vllm_lite" logger's effective level; where this process never set up logging at all
    (no level, no root handler), $VLLM_LITE_LOG_LEVEL, as for any process we start."""
    ours = logging.getLogger("vllm_lite")
    if ours.level == logging.NOTSET and not logging.getLogger().handlers:
        return envs.VLLM_LITE_LOG_LEVEL
    return logging.getLevelName(ours.getEffectiveLevel())


def start_child(
    module: str,
    args: msgspec.Struct,
    ready_type: type[R],
    *,
    name: str,
    log_level: Optional[str] = None,
    env: Optional[dict[str, str]] = None,
    pass_fds: Sequence[int] = (),
    new_session: bool = False,
    cleanup_paths: Sequence[str] = (),
    stdin: Any = subprocess.DEVNULL,
) -> ChildProcess[R]:
    """Start ``python -m module`` and hand it ``args``; returns at once (``wait_ready`` waits).

    ``log_level``: the child's level (default: ``default_child_log_level()``).
    ``env``: extra variables for this child only (on top of ours, minus our secrets).
    ``pass_fds``: fds the child inherits (e.g. a listening socket). ``new_session``: the child
    leads its own session and process group, so a terminal's Ctrl-C reaches only us.
    ``cleanup_paths``: removed by the child if it outlives us.
    """
    level = log_level or default_child_log_level()
    control_r, control_w = os.pipe()
    status_r, status_w = os.pipe()
    child_env = {k: v for k, v in os.environ.items() if k not in envs.SECRET_VARIABLES}
    child_env.update(env or {})
    # The child must import this very vllm_lite, even when we found it through a sys.path edit.
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = [p for p in child_env.get("PYTHONPATH", "").split(os.pathsep) if p and p != package_root]
    child_env["PYTHONPATH"] = os.pathsep.join([package_root, *paths])
    argv = [sys.executable, "-m", module, "--launcher-fds", f"{control_r},{status_w}",
            "--log-level", str(level), "--name", name]
    envelope = _Envelope(
        args=msgspec.Raw(msgspec.msgpack.encode(args)),
        parent_pid=os.getpid(),
        # PR_SET_PDEATHSIG fires when the spawning *thread* exits: only the main thread lives as long as we do.
        death_signal=threading.current_thread() is threading.main_thread(),
        cleanup_paths=list(cleanup_paths),
    )
    try:
        popen = subprocess.Popen(argv, env=child_env, pass_fds=(control_r, status_w, *pass_fds),
                                 start_new_session=new_session, stdin=stdin, close_fds=True)
    except BaseException:
        for fd in (control_r, control_w, status_r, status_w):
            os.close(fd)
        raise
    os.close(control_r)
    os.close(status_w)
    child = ChildProcess(name, popen, control_w, status_r, ready_type)
    try:
        _write_frame(control_w, msgspec.msgpack.encode(envelope))
    except BrokenPipeError:
        pass  # it died at once; wait_ready reports how
    logger.debug("started %s (pid %d): python -m %s", name, popen.pid, module)
    return child


def wait_ready(children: Sequence[ChildProcess], timeout: Optional[float] = None,
               abort: Optional[Callable[[], None]] = None, poll_s: float = 0.1) -> list[Any]:
    """Every child's ready struct, in order; raises ChildStartupError at the first failure.

    Children start in parallel; this returns when all are ready. ``abort`` is called every
    ``poll_s`` while waiting and may raise (e.g. on a stop signal). The caller stops the children.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    for c in children:
        if c.ready_message is None and c._status_fd is None:
            raise ChildStartupError(c.name, "ChildStopped", "was stopped before it was ready", exitcode=c.exitcode)
    pending = {c._status_fd: c for c in children if c.ready_message is None}
    with selectors.DefaultSelector() as sel:
        for fd in pending:
            sel.register(fd, selectors.EVENT_READ)
        while pending:
            if abort is not None:
                abort()
            wait_s = poll_s if deadline is None else min(poll_s, deadline - time.monotonic())
            if wait_s <= 0:
                late = ", ".join(c.name for c in pending.values())
                raise ChildStartupError(late, "TimeoutError", f"not ready within {timeout:.0f} s")
            for key, _ in sel.select(wait_s):
                child = pending.pop(key.fd)
                sel.unregister(key.fd)
                child._read_status()
    return [c.ready_message for c in children]


def wait_exited(children: Sequence[ChildProcess], timeout: float) -> bool:
    """Wait up to ``timeout`` for every child to exit on its own (no signal); True if all did."""
    deadline = time.monotonic() + timeout
    return all(c.wait(max(0.0, deadline - time.monotonic())) is not None for c in children)


def stop_all(children: Sequence[ChildProcess], grace_s: float = 5.0) -> None:
    """Signal every child first, then wait for them together; kill whoever outlives ``grace_s``; reap all."""
    for c in children:
        c.terminate()
    deadline = time.monotonic() + grace_s
    for c in children:
        if c.wait(max(0.0, deadline - time.monotonic())) is None:
            logger.warning("%s (pid %d) did not exit within %.1f s of SIGTERM: killing it.", c.name, c.pid, grace_s)
            try:
                c.popen.kill()
            except ProcessLookupError:
                pass
    for c in children:
        if c.wait(_REAP_S) is None:
            logger.error("%s (pid %d) survived SIGKILL for %.0f s.", c.name, c.pid, _REAP_S)
        c.close()


# ---------------------------------------------------------------------------- child side


class ChildChannel:
    """A child's line to its parent: say ready or failed (once), hear controls, clean up if orphaned."""

    def __init__(self, name: str, status_fd: int, control_fd: int, envelope: _Envelope) -> None:
        self.name = name
        self.parent_pid = envelope.parent_pid
        self._status_fd = status_fd
        self._control_fd = control_fd
        self._cleanup_paths = list(envelope.cleanup_paths)
        self._control_handlers: list[Callable[[Control], None]] = []
        self.answered = False

    def ready(self, message: msgspec.Struct) -> None:
        """Tell the parent we serve; ``message`` is the struct type the parent waits for."""
        self._answer(_Status(ready=msgspec.msgpack.encode(message)))

    def failed(self, exc: BaseException) -> None:
        """Tell the parent why start-up failed, with the traceback text."""
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        self._answer(_Status(error=StartupError(type(exc).__name__, str(exc), text)))

    def _answer(self, status: _Status) -> None:
        if self.answered:
            raise RuntimeError("a child answers its parent once")
        self.answered = True
        try:
            _write_frame(self._status_fd, msgspec.msgpack.encode(status))
        except OSError:
            pass  # the parent is gone; the control watch ends us

    def on_control(self, handler: Callable[[Control], None]) -> None:
        """Call ``handler`` (in the watch thread) for every Control the parent sends."""
        self._control_handlers.append(handler)

    def add_cleanup_path(self, path: str) -> None:
        """Remove ``path`` if the parent dies first."""
        self._cleanup_paths.append(path)

    def _watch_parent(self) -> None:
        """Daemon thread: read controls until EOF, which means the parent died: clean up, exit."""
        decoder = msgspec.msgpack.Decoder(Control)
        while True:
            try:
                frame = _read_frame(self._control_fd)
            except (OSError, ValueError):
                frame = None
            if frame is None:
                break
            try:
                message = decoder.decode(frame)
            except msgspec.DecodeError:
                continue
            for handler in self._control_handlers:
                handler(message)
        self._parent_gone()

    def _parent_gone(self) -> NoReturn:
        # No logging or flushing here: our stderr may lead to the dead parent, and the main
        # thread may be anywhere. Remove what the parent asked us to, then go.
        for path in self._cleanup_paths:
            shutil.rmtree(path, ignore_errors=True)
        os._exit(0)


def _flush_and_exit(code: int) -> NoReturn:
    """Exit now: skip interpreter teardown (seconds with torch loaded; threads of gloo/uvicorn)."""
    try:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _set_death_signal(parent_pid: int) -> None:
    """SIGTERM when the parent dies (Linux); if it died before this line, exit now."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:
        _flush_and_exit(0)


def _set_process_title(name: str) -> None:
    try:
        import setproctitle  # optional: not a dependency
    except ImportError:
        return
    setproctitle.setproctitle(f"vllm-lite {name}")


def child_startup(args_type: type[A]) -> tuple[A, ChildChannel]:
    """In a child's ``main()``: set up logging, read the typed arguments, start the parent watch."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--launcher-fds", required=True)
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--name", default="child")
    ns, _ = parser.parse_known_args()
    control_fd, status_fd = (int(x) for x in ns.launcher_fds.split(","))
    for fd in (control_fd, status_fd):
        os.set_inheritable(fd, False)  # our own children get pipes of their own
    from vllm_lite.logging_utils import configure_process_logging

    configure_process_logging(ns.name, ns.log_level)
    _set_process_title(ns.name)
    frame = _read_frame(control_fd)
    if frame is None:  # the parent died before it told us anything
        _flush_and_exit(0)
    envelope = msgspec.msgpack.decode(frame, type=_Envelope)
    channel = ChildChannel(ns.name, status_fd, control_fd, envelope)
    if envelope.death_signal:
        _set_death_signal(envelope.parent_pid)
    threading.Thread(target=channel._watch_parent, name="launcher-parent-watch", daemon=True).start()
    try:
        args = msgspec.msgpack.decode(envelope.args, type=args_type)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        channel.failed(e)
        _flush_and_exit(1)
    return args, channel


def run_child(args_type: type[A], main: Callable[[A, ChildChannel], Optional[int]]) -> NoReturn:
    """A child entry module's whole ``main()``: start-up, ``main(args, channel)``, exit with its code.

    An exception before ``channel.ready()`` reaches the parent as a StartupError with its traceback.
    """
    args, channel = child_startup(args_type)
    code = 1
    try:
        result = main(args, channel)
        code = 0 if result is None else int(result)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException as e:  # noqa: BLE001 -- reported to the parent, logged, exit 1
        if not channel.answered:
            channel.failed(e)
        logger.error("%s failed:\n%s", channel.name, traceback.format_exc())
    _flush_and_exit(code)

