"""The child side of the launcher: read the typed arguments, answer ready or failed, die with the parent.

A child entry module ends with ``run_child(ArgsType, main)`` (or calls ``child_startup`` and
uses the ``ChildChannel`` itself). The parent's death is noticed twice over: a daemon thread
reads the control pipe until EOF (the parent holds its end for our whole life), then removes
the paths the parent asked it to clean up and exits; where the parent started us from its
main thread, ``PR_SET_PDEATHSIG`` (SIGTERM) backs the pipe up (the kernel ties that signal to
the spawning *thread*, so it is not used from other threads).
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import shutil
import signal
import sys
import threading
import traceback
from typing import Any, Callable, NoReturn, Optional, TypeVar

import msgspec

from vllm_lite.launcher_protocol import Control, Envelope, StartupError, Status, read_frame, write_frame

logger = logging.getLogger("vllm_lite.launcher")

A = TypeVar("A", bound=msgspec.Struct)

_PR_SET_PDEATHSIG = 1

# This process's line to its parent, when the launcher started it (None otherwise).
_channel: Optional["ChildChannel"] = None


def remove_if_orphaned(path: str) -> None:
    """Have this process remove ``path`` (a temp dir it made) if it exits because its launcher parent died, an
    exit on which its own clean-up never runs. Nothing when the launcher did not start this process: then the
    caller's shutdown is the only exit that needs it."""
    if _channel is not None:
        _channel.add_cleanup_path(path)


class ChildChannel:
    """A child's line to its parent: say ready or failed (once), hear controls, clean up if orphaned."""

    def __init__(self, name: str, status_fd: int, control_fd: int, envelope: Envelope) -> None:
        self.name = name
        self.parent_pid = envelope.parent_pid
        self._status_fd = status_fd
        self._control_fd = control_fd
        self._cleanup_paths = list(envelope.cleanup_paths)
        self._control_handlers: list[Callable[[Control], None]] = []
        self.answered = False

    def ready(self, message: msgspec.Struct) -> None:
        """Tell the parent we serve; ``message`` is the struct type the parent waits for."""
        self._answer(Status(ready=msgspec.msgpack.encode(message)))

    def failed(self, exc: BaseException) -> None:
        """Tell the parent why start-up failed, with the traceback text."""
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        self._answer(Status(error=StartupError(type(exc).__name__, str(exc), text)))

    def _answer(self, status: Status) -> None:
        if self.answered:
            raise RuntimeError("a child answers its parent once")
        self.answered = True
        try:
            write_frame(self._status_fd, msgspec.msgpack.encode(status))
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
                frame = read_frame(self._control_fd)
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

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        """SIGTERM until the child installs a handler of its own. The kernel's parent-death SIGTERM
        arrives together with the pipe's EOF, and its default action would kill us before the watch
        thread removed the cleanup paths: clean up here too. Any other SIGTERM acts as the default."""
        if self._parent_exiting():
            self._parent_gone()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    def _parent_exiting(self) -> bool:
        """Whether our parent is gone or going. The kernel sends the parent-death signal as the thread that started
        us (the parent's main thread) exits, and first hands us to the parent's other threads if any still run
        (a SIGKILLed multi-threaded parent: they are exiting too), so getppid() may still name the parent when
        the handler runs; its main thread is a zombie by then, which a live parent's never is."""
        if os.getppid() != self.parent_pid:
            return True
        try:
            with open(f"/proc/{self.parent_pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
        except (OSError, IndexError):
            return True

    def _parent_gone(self) -> NoReturn:
        # No logging or flushing here: our stderr may lead to the dead parent, and the main
        # thread may be anywhere. Remove what the parent asked us to, then go.
        for path in list(self._cleanup_paths):
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
    frame = read_frame(control_fd)
    if frame is None:  # the parent died before it told us anything
        _flush_and_exit(0)
    envelope = msgspec.msgpack.decode(frame, type=Envelope)
    channel = ChildChannel(ns.name, status_fd, control_fd, envelope)
    global _channel
    _channel = channel
    if envelope.death_signal:
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, channel._on_sigterm)
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
