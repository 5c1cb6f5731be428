"""The one place that starts and supervises child processes (engine cores, tensor-parallel ranks, HTTP frontends).

Why a launcher of our own: multiprocessing's "spawn" re-imports the user's ``__main__``
in every child, so a script without a main guard ran twice, ``python - <<EOF`` failed
on ``'<stdin>'`` and notebooks broke. Here every child is a fresh interpreter,
``python -m MODULE --launcher-fds C,S --log-level LEVEL --name NAME``, and nothing of
the parent's ``__main__`` is ever imported.

This module is the parent side: ``start_child`` -> ``ChildProcess`` (``wait_ready``,
``fileno`` for ``zmq.Poller`` / ``select`` / ``loop.add_reader``, ``send_control``, ``stop``),
``wait_ready`` for several at once, ``wait_exited``, ``stop_all`` (the one shutdown path:
terminate, wait, kill, reap). The frames on the two pipes are ``vllm_lite.launcher_protocol``;
the child's half (``run_child``, ``ChildChannel``, the parent-death watch) is
``vllm_lite.launcher_child``.

Children never inherit the secret variables of ``envs.SECRET_VARIABLES``; a secret a child
needs travels in its arguments struct or in ``env`` for that one child.
"""

from __future__ import annotations

import logging
import os
import selectors
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Generic, Optional, Sequence, TypeVar

import msgspec

from vllm_lite import envs
from vllm_lite.launcher_protocol import Control, Envelope, Status, read_frame, write_frame

logger = logging.getLogger("vllm_lite.launcher")

R = TypeVar("R", bound=msgspec.Struct)

# How long stop() waits for a killed child to be reaped before giving up on it.
_REAP_S = 5.0

__all__ = [
    "ChildProcess",
    "ChildStartupError",
    "Control",
    "default_child_log_level",
    "open_pidfd",
    "start_child",
    "stop_all",
    "wait_exited",
    "wait_ready",
]


class ChildStartupError(RuntimeError):
    """A child failed before it was ready: its exception type, message and traceback text."""

    def __init__(
        self, name: str, exc_type: str, message: str, traceback_text: str = "", exitcode: Optional[int] = None
    ) -> None:
        super().__init__(f"{name}: {exc_type}: {message}")
        self.name = name
        self.exc_type = exc_type
        self.message = message
        self.traceback = traceback_text
        self.exitcode = exitcode


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

    def __init__(
        self, name: str, popen: subprocess.Popen, control_fd: int, status_fd: int, ready_type: type[R]
    ) -> None:
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
            frame = read_frame(self._status_fd)
            status = msgspec.msgpack.decode(frame, type=Status) if frame is not None else None
        except (OSError, ValueError, msgspec.DecodeError) as e:
            raise ChildStartupError(self.name, type(e).__name__, f"unreadable start-up status: {e}") from None
        if status is None or (status.ready is None and status.error is None):
            code = self.wait(_REAP_S)
            raise ChildStartupError(
                self.name, "ChildExited", f"exited with code {code} before it was ready", exitcode=code
            )
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
                write_frame(self._control_fd, msgspec.msgpack.encode(message))
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
    argv = [
        sys.executable,
        "-m",
        module,
        "--launcher-fds",
        f"{control_r},{status_w}",
        "--log-level",
        str(level),
        "--name",
        name,
    ]
    envelope = Envelope(
        args=msgspec.Raw(msgspec.msgpack.encode(args)),
        parent_pid=os.getpid(),
        # PR_SET_PDEATHSIG fires when the spawning *thread* exits: only the main thread lives as long as we do.
        death_signal=threading.current_thread() is threading.main_thread(),
        cleanup_paths=list(cleanup_paths),
    )
    try:
        popen = subprocess.Popen(
            argv,
            env=child_env,
            pass_fds=(control_r, status_w, *pass_fds),
            start_new_session=new_session,
            stdin=stdin,
            close_fds=True,
        )
    except BaseException:
        for fd in (control_r, control_w, status_r, status_w):
            os.close(fd)
        raise
    os.close(control_r)
    os.close(status_w)
    child = ChildProcess(name, popen, control_w, status_r, ready_type)
    try:
        write_frame(control_w, msgspec.msgpack.encode(envelope))
    except BrokenPipeError:
        pass  # it died at once; wait_ready reports how
    logger.debug("started %s (pid %d): python -m %s", name, popen.pid, module)
    return child


def wait_ready(
    children: Sequence[ChildProcess],
    timeout: Optional[float] = None,
    abort: Optional[Callable[[], None]] = None,
    poll_s: float = 0.1,
) -> list[Any]:
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
