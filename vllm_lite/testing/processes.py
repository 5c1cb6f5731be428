"""Finding the processes a process started, for tests that kill one or check that none is left."""

from __future__ import annotations

import os

# The child entry module of a tensor-parallel rank (see vllm_lite.worker.tp_worker_proc).
TP_RANK_MODULE = "vllm_lite.worker.tp_worker_proc"


def cmdline(pid: int) -> str:
    """The process's command line, space-separated ("" if it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def children(pid: int) -> list[int]:
    """Live (not zombie) child processes of ``pid``, oldest first."""
    kids: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids += [int(x) for x in f.read().split()]
        except OSError:
            continue
    return sorted(k for k in kids if not process_gone(k))


def process_gone(pid: int) -> bool:
    """Exited: no such process, or a zombie waiting for a reaper we don't control."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def launched_as(pid: int, module: str, name: str) -> bool:
    """Started by the launcher as `python -m module ... --name NAME...`, whose title, where setproctitle is
    installed (mutmut brings it), becomes `vllm-lite NAME...`: `name` is a prefix of the child's name."""
    line = cmdline(pid)
    return f"-m {module} " in line or line.startswith(f"vllm-lite {name}")


def is_rank_process(pid: int) -> bool:
    """A tensor-parallel rank started by the launcher."""
    return launched_as(pid, TP_RANK_MODULE, "tp-rank-")


def rank_children(pid: int) -> list[int]:
    """Tensor-parallel rank processes started by process ``pid``, oldest first."""
    return [k for k in children(pid) if is_rank_process(k)]
