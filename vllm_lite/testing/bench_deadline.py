"""A benchmark run's deadline and worker interpreters (benchmarks/gpu.py's machinery), one job: the run ends on
time and returns what it measured, however it ends.

- ``--time-limit``: a soft stop (SIGALRM raises TimeLimit, a BaseException no part swallows; parts end, engines
  shut down, the JSON is printed) and, ``_grace_s`` later, a hard wall: a watchdog thread that kills the worker and
  every process the run started, prints and saves the JSON it has and exits, whatever the main thread is stuck in.
  SIGTERM (what ``timeout`` sends) stops the run the same way, with a hard wall SIGTERM_GRACE_S later.
- Worker interpreters (``run_worker``: ``python SCRIPT --worker KIND SPEC``): their own process group, at most the
  time left before the soft stop, killed with their group at it, and dead with the run however it ends
  (``die_with_parent``: PR_SET_PDEATHSIG); what a worker measured so far (``write_worker_partial``) is kept.
- ``--out-json``: the result so far, rewritten atomically after every part (``save_partial``; ``partial: true``),
  so the last complete state survives a kill.

State lives in ``RUN`` (the script sets ``name``, ``t0``, ``result``, ``out_json``). Tested on CPU through
benchmarks/gpu.py (tests/test_gpu_bench_smoke.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Optional


class TimeLimit(BaseException):
    """--time-limit reached (or SIGTERM): not an Exception, so no part swallows it; the run stops and prints
    what it has. `partial`: what a worker interpreter had measured when it was stopped (or None)."""

    def __init__(self, reason: str, partial: Optional[dict[str, Any]] = None, worker_pid: Optional[int] = None):
        super().__init__(reason)
        self.partial = partial
        self.worker_pid = worker_pid


# The run's shared state: the result so far (printed and saved by whoever ends the run), --out-json, the
# deadlines, the worker interpreter running now (killed with its process group at a stop).
RUN: dict[str, Any] = {
    "name": "bench",  # the script's name in log lines
    "t0": time.perf_counter(),  # the script sets its start (before its heavy imports): --time-limit counts from it
    "result": None,
    "out_json": None,
    "soft_deadline": None,  # perf_counter time: parts stop here (TimeLimit), the JSON is printed
    "hard_deadline": None,  # perf_counter time: the watchdog prints what it has and exits, whatever hangs
    "worker": None,
    "stop_reason": None,
    "last_json": None,
    "finished": False,
}
END_LOCK = threading.Lock()
WORKER_MARGIN_S = 1.0  # a worker interpreter is stopped this long before the soft deadline


def _grace_s(limit: float) -> float:
    """Seconds between the soft stop (parts end, engines shut down) and the hard wall (the watchdog exits)."""
    return min(15.0, max(3.0, 0.08 * limit))


def time_left() -> Optional[float]:
    """Seconds to the soft deadline (None: no --time-limit)."""
    d = RUN["soft_deadline"]
    return None if d is None else d - time.perf_counter()


SIGTERM_GRACE_S = 8.0  # after SIGTERM (`timeout`'s signal) the run has this long to print what it has


def _on_stop_signal(signum, frame) -> None:
    alarm = signum == getattr(signal, "SIGALRM", None)
    if not alarm:
        _arm_hard_wall(time.perf_counter() + SIGTERM_GRACE_S)  # a stop asked from outside: a hard wall too
    if RUN["stop_reason"] is not None:
        return  # already stopping: the clean-up goes on, under the hard wall
    RUN["stop_reason"] = "--time-limit reached" if alarm else f"signal {signal.Signals(signum).name} received"
    raise TimeLimit(RUN["stop_reason"])


def stop_now(reason: str, partial: Optional[dict[str, Any]] = None, worker_pid: Optional[int] = None) -> TimeLimit:
    """The TimeLimit to raise where a part sees the deadline itself (a worker stopped at it): no alarm after it."""
    if hasattr(signal, "SIGALRM"):
        signal.setitimer(signal.ITIMER_REAL, 0)
    RUN["stop_reason"] = RUN["stop_reason"] or reason
    return TimeLimit(reason, partial, worker_pid)


def log(msg: str) -> None:
    print(f"[{RUN['name']} {time.perf_counter() - RUN['t0']:7.1f}s] {msg}", file=sys.stderr, flush=True)


def _dump(result: dict[str, Any]) -> str:
    """JSON of the result; the main thread may be changing it (the watchdog's call): a few tries."""
    for _ in range(5):
        try:
            return json.dumps(result)
        except RuntimeError:  # "dictionary changed size during iteration"
            time.sleep(0.01)
    return RUN["last_json"] or json.dumps({"benchmark": "gpu", "errors": ["the result could not be serialised"]})


def write_out_json(text: str) -> None:
    path = RUN["out_json"]
    if not path:
        return
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text + "\n")
    os.replace(tmp, path)


def save_partial(current: Optional[str] = None) -> None:
    """After each part: the result so far to --out-json (atomically; the last complete state survives a kill)."""
    result = RUN["result"]
    if result is None:
        return
    result["partial"] = True
    result["elapsed_s"] = round(time.perf_counter() - RUN["t0"], 1)
    if current is not None:
        result["current_part"] = current
    text = _dump(result)
    RUN["last_json"] = text
    try:
        write_out_json(text)
    except OSError as e:
        log(f"--out-json: {e}")


def _descendants(pid: int) -> list[int]:
    """Every live process below `pid` (from /proc; empty where there is none)."""
    from vllm_lite.testing.processes import children

    out, todo = [], [pid]
    while todo:
        for c in children(todo.pop()):
            out.append(c)
            todo.append(c)
    return out


def _kill_worker_group(proc: subprocess.Popen) -> None:
    """A worker interpreter leads its own process group (its engine core is in it): kill all of it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def _hard_stop() -> None:
    """The hard wall (watchdog thread): kill the worker and every process this run started, print and save the
    JSON it has, exit now, whatever the main thread is stuck in."""
    if not END_LOCK.acquire(blocking=False):
        return  # the main thread is printing the result now
    if RUN["finished"]:
        END_LOCK.release()
        return
    result = RUN["result"] or {"benchmark": "gpu", "errors": []}
    worker = RUN["worker"]
    killed = []
    if worker is not None:
        killed.append(worker.pid)
        try:
            os.killpg(worker.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for pid in _descendants(os.getpid()):
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except (ProcessLookupError, PermissionError):
            pass
    reason = RUN["stop_reason"] or "--time-limit reached"
    result["stopped"] = f"{reason}; hard wall: the run did not end in time and was cut off"
    result["killed_pids"] = sorted(set(killed))
    result["partial"] = True
    result["elapsed_s"] = round(time.perf_counter() - RUN["t0"], 1)
    text = _dump(result)
    log(f"hard wall at {result['elapsed_s']} s: killed {result['killed_pids']}, printing what the run has")
    try:
        write_out_json(text)
    except OSError:
        pass
    sys.stdout.write(text + "\n")
    sys.stdout.flush()
    os._exit(1)


_HARD_TIMER: list[threading.Timer] = []


def _arm_hard_wall(at: float) -> None:
    """(Re)arm the watchdog for perf_counter time `at` (only ever earlier)."""
    if RUN["hard_deadline"] is not None and RUN["hard_deadline"] <= at:
        return
    RUN["hard_deadline"] = at
    for t in _HARD_TIMER:
        t.cancel()
    timer = threading.Timer(max(0.0, at - time.perf_counter()), _hard_stop)
    timer.daemon = True
    timer.start()
    _HARD_TIMER[:] = [timer]


def arm_time_limit(limit: float) -> None:
    """--time-limit LIMIT seconds from the script's start (RUN['t0']): parts stop at LIMIT - grace (SIGALRM ->
    TimeLimit; worker interpreters get that much time at most), the watchdog exits at LIMIT. SIGTERM (as
    `timeout` sends) stops the run the same way."""
    if hasattr(signal, "SIGTERM"):
        signal.signal(signal.SIGTERM, _on_stop_signal)
    if limit <= 0:
        return
    hard = RUN["t0"] + limit
    soft = hard - _grace_s(limit)
    RUN["soft_deadline"] = soft
    _arm_hard_wall(hard)
    if hasattr(signal, "SIGALRM"):
        signal.signal(signal.SIGALRM, _on_stop_signal)
        left = soft - time.perf_counter()
        if left <= 0:
            RUN["stop_reason"] = "--time-limit reached"
            raise TimeLimit("--time-limit reached before the run started")
        signal.setitimer(signal.ITIMER_REAL, left)


def disarm() -> None:
    if hasattr(signal, "SIGALRM"):
        signal.setitimer(signal.ITIMER_REAL, 0)
    for t in _HARD_TIMER:
        t.cancel()


def run_worker(script: str, kind: str, spec: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """`python SCRIPT --worker KIND SPEC` in a fresh interpreter (torch at its default threads) leading its own
    process group; its last stdout line is the result. It gets --worker-timeout or the time left before the
    soft deadline, whichever is less: stopped at the deadline it raises TimeLimit carrying what the worker had
    written to its partial file (the profile worker writes one after each measurement)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        partial_path = f.name + ".partial"
        json.dump(dict(spec, partial_path=partial_path, parent_pid=os.getpid()), f)
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # the baseline gets torch's own default
        env.pop(var, None)
    argv = [sys.executable, os.path.abspath(script), "--worker", kind, f.name]
    proc = None
    try:
        left = time_left()
        by_deadline = left is not None and left - WORKER_MARGIN_S < timeout_s
        budget = timeout_s if not by_deadline else left - WORKER_MARGIN_S
        if budget <= 0:
            raise stop_now(f"--time-limit reached: no time left for the {kind} worker")
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True, start_new_session=True)
        RUN["worker"] = proc
        try:
            out, _ = proc.communicate(timeout=budget)
        except subprocess.TimeoutExpired:
            _kill_worker_group(proc)
            if by_deadline:
                reason = f"--time-limit reached: the {kind} worker (pid {proc.pid}) was stopped"
                raise stop_now(reason, _read_json(partial_path), proc.pid) from None
            raise RuntimeError(f"the {kind} worker ran past --worker-timeout {timeout_s} s and was killed") from None
        except BaseException as e:  # TimeLimit (SIGALRM, SIGTERM) or Ctrl-C: the worker goes too
            _kill_worker_group(proc)
            if isinstance(e, TimeLimit):
                e.partial = e.partial or _read_json(partial_path)
                e.worker_pid = proc.pid
            raise
        if proc.returncode != 0:
            raise subprocess.CalledProcessError(proc.returncode, argv)
        lines = [ln for ln in out.splitlines() if ln.strip()]
        return json.loads(lines[-1])
    finally:
        RUN["worker"] = None
        for path in (f.name, partial_path):
            if os.path.exists(path):
                os.unlink(path)


def _read_json(path: str) -> Optional[dict[str, Any]]:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def die_with_parent(parent_pid: Optional[int]) -> None:
    """In a worker (its own process group, out of reach of a signal to the run's group): killed with SIGKILL
    when the run's process ends, however it ends (Linux PR_SET_PDEATHSIG; its engine core follows it)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if parent_pid is not None and os.getppid() != parent_pid:  # the run ended before the call above
        os._exit(1)


def write_worker_partial(spec: dict[str, Any], res: dict[str, Any]) -> None:
    """In a worker: what it has measured so far, for the parent to keep should it be stopped (atomic write)."""
    path = spec.get("partial_path")
    if not path:
        return
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(res, f)
    os.replace(tmp, path)
