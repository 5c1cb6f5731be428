"""Watching a process that is not our child, by pid, when it runs on this host.

An attached frontend learns its engine core's pid from the handshake. A pid alone is not
enough to watch: the core may run on another host, or in another pid namespace on this one
(where the same number names some other process). So the core also sends this host's boot id
and its own start time (clock ticks since boot, from ``/proc``); the frontend watches the pid
only when both match what it sees itself. Then death is seen at once: a pidfd becomes readable
when the process exits (Linux >= 5.3, Python >= 3.9), else ``os.kill(pid, 0)`` is polled.
"""

from __future__ import annotations

import os
import socket
from typing import Optional

_BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"


def host_id() -> str:
    """This host (and boot): the kernel's boot id, else the hostname; "" when neither is known."""
    try:
        with open(_BOOT_ID_PATH) as f:
            return "boot:" + f.read().strip()
    except OSError:
        pass
    try:
        return "host:" + socket.gethostname()
    except OSError:
        return ""


def start_ticks(pid: int) -> int:
    """When ``pid`` started (clock ticks since boot, /proc/PID/stat field 22); 0 when unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return 0


class ProcessWatch:
    """A live process on this host: ``fd`` (a pidfd, readable once it exits) or None, and ``gone()``."""

    def __init__(self, pid: int, fd: Optional[int]) -> None:
        self.pid = pid
        self.fd = fd

    def gone(self) -> bool:
        """Has it exited? (Polls; with a pidfd, prefer waiting for ``fd`` to become readable.)"""
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # alive, someone else's
            return False
        # A zombie (exited, not yet reaped by its parent) still answers kill(0).
        state = _state(self.pid)
        return state in ("Z", "X", "")

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def watch_local_process(pid: int, host: str, started: int) -> Optional[ProcessWatch]:
    """A watch on ``pid`` if it is that very process on this host (same boot id, same start time),
    else None: another host, another pid namespace, our own process, or already gone."""
    if pid <= 0 or not host or host != host_id() or pid == os.getpid():
        return None
    if started <= 0 or start_ticks(pid) != started:
        return None
    fd: Optional[int] = None
    pidfd_open = getattr(os, "pidfd_open", None)
    if pidfd_open is not None:
        try:
            fd = pidfd_open(pid)
        except OSError:
            fd = None
    watch = ProcessWatch(pid, fd)
    # Opened a pidfd for a pid that was reused between the checks? The start time says.
    if start_ticks(pid) != started:
        watch.close()
        return None
    return watch


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "" if os.path.isdir("/proc") else "?"  # no /proc (not Linux): kill(0) said alive
