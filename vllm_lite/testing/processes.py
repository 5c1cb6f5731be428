"""Finding the tensor-parallel rank processes a process started, for tests that kill one."""

from __future__ import annotations

import os


def is_rank_process(pid: int) -> bool:
    """A spawned multiprocessing child (not multiprocessing's resource tracker)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read()
    except OSError:
        return False
    return b"spawn_main" in cmd and b"resource_tracker" not in cmd


def rank_children(pid: int) -> list[int]:
    """Tensor-parallel rank processes started by process `pid`, oldest first."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z" and is_rank_process(int(entry)):
                out.append(int(entry))
    return sorted(out)
