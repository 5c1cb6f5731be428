"""How many torch threads the engine core computes with on a CPU, from what the host's other processes use.

Why measured, not counted: OpenMP threads that must share a core with a busy process wait on each other at
every barrier, so decode-sized matmuls run 2-20x slower than one thread with a core to itself (PROFILE.md);
yet on an idle 2-core host two threads gave 113 against 99 output tok/s. Whether the second core is free
depends on the moment: an offline `LLM.generate` frontend sleeps on its socket while the core works, an HTTP
frontend streams, and other programs come and go. So between steps, at most every `interval_s`, the core
reads the CPU time of the cores it may run on (/proc/stat) and its own (os.times); the difference is what
others use. It takes a core back for a thread only after others used at most `up_below` of one for two
intervals' worth of wall time in a row (one long prefill step can be enough), and gives one up as soon as they use more than `down_above` (hysteresis: no flapping).
Only windows in which the core itself computed count: when it wakes after an idle spell longer than an interval
(`before_step`), or a window holds less than `min_own_cores` of its own CPU time per wall second (the core slept
through most of it), that window is dropped and a fresh sample starts the busy period. Otherwise a bursty client
that works while the core waits (a benchmark running another engine between passes, a frontend tokenizing the
next batch) would be charged to the next step and take the core's threads away just as work arrives.
An explicit `num_threads` fixes the count; so does $VLLM_LITE_ADAPTIVE_THREADS=0.

Pinning (`ThreadPinner`): while the core computes on every core it may use, each of its compute threads (the
calling thread and OpenMP's workers) is bound to a core of its own, as vLLM's CPU backend binds its OpenMP threads
($VLLM_CPU_OMP_THREADS_BIND, vLLM's name: `auto` binds, `nobind` does not). Unbound, a neighbour that wakes for half
a millisecond per step (the HTTP frontend streaming a token) made a 3-row decode step 1.7-3.4 ms slower on Zen 4 (the
scheduler moves the preempted worker onto its partner's core); bound, 0-0.5 ms (PROFILE.md, 2026-11-27 HD). With fewer
threads than cores the binding is undone, so a thread can leave a core that another process took.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

logger = logging.getLogger(__name__)

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class CpuSample:
    """Cumulative CPU seconds at one moment: busy on our cores (every process), and this process's own."""

    wall_s: float
    host_busy_s: float
    own_s: float


def read_host_busy_s(cpus: frozenset[int], proc_stat: str = "/proc/stat") -> Optional[float]:
    """Busy CPU seconds so far on `cpus` (all but idle and iowait), from /proc/stat; None where unreadable."""
    try:
        with open(proc_stat) as f:
            lines = f.readlines()
    except OSError:
        return None
    busy = 0
    seen = 0
    for line in lines:
        if not line.startswith("cpu") or line.startswith("cpu "):
            continue
        name, *fields = line.split()
        if int(name[3:]) not in cpus:
            continue
        ticks = [int(x) for x in fields[:8]]  # user nice system idle iowait irq softirq steal
        busy += sum(ticks) - ticks[3] - ticks[4]
        seen += 1
    return busy / _CLK_TCK if seen else None


def take_sample(cpus: frozenset[int]) -> Optional[CpuSample]:
    busy = read_host_busy_s(cpus)
    if busy is None:
        return None
    t = os.times()
    return CpuSample(time.monotonic(), busy, t.user + t.system)


def others_cores(before: CpuSample, after: CpuSample) -> float:
    """Cores' worth of CPU that processes other than this one used between two samples."""
    wall = after.wall_s - before.wall_s
    if wall <= 0:
        return 0.0
    others = (after.host_busy_s - before.host_busy_s) - (after.own_s - before.own_s)
    return max(0.0, others / wall)


def decide(current: int, others: float, cores: int, up_below: float = 0.2, down_above: float = 0.45) -> int:
    """Threads for the next interval given the cores others use: one per core they leave free.

    A thread is added only while others leave its core all but `up_below` free, and dropped as soon as they
    take more than `down_above` of a core we compute on. Between the two bounds, the count stays."""
    free = cores - others
    want_up = min(cores, max(1, int(free + up_below)))
    want_down = min(cores, max(1, int(free + down_above)))
    if want_down < current:
        return want_down
    if want_up > current:
        return want_up
    return current


class AdaptiveThreads:
    """Re-decides the core's thread count between steps (`maybe_update`), cheaply: a clock read per call."""

    def __init__(
        self,
        cpus: frozenset[int],
        start: int,
        set_threads: Callable[[int], None],
        sample: Optional[Callable[[], Optional[CpuSample]]] = None,
        interval_s: float = 0.5,
        log_every_s: float = 30.0,
        min_own_cores: float = 0.25,
    ) -> None:
        self.cpus = cpus
        self.cores = len(cpus)
        self.current = start
        self.interval_s = interval_s
        self.log_every_s = log_every_s
        self.min_own_cores = min_own_cores
        self._set = set_threads
        self._sample = sample or (lambda: take_sample(cpus))
        self._last = self._sample()
        self._quiet_s = 0.0  # wall time of consecutive samples that asked for more threads
        self._last_log = -float("inf")
        self._last_step_end = self._last.wall_s if self._last is not None else time.monotonic()
        self._stepped = False  # no step has run yet: the window since construction is the start-up
        self.min_startup_window_s = min(0.1, interval_s)
        self.changes = 0

    def before_step(self, now: Optional[float] = None) -> None:
        """Before a step: after an idle spell longer than an interval, start a fresh window here, so what
        others did while the core waited is not charged to the busy period that starts now.

        The idle spell itself is a clean measurement of the others (the core used next to nothing), so if they
        left the cores free through it, the burst starts on them at once instead of one thread for the first
        two intervals (a second or so of a short offline batch). It never lowers the count: what others did
        while the core waited may have ended; a neighbour that is busy now takes the thread back at the first
        interval (maybe_update drops at once).

        The first step's window is the start-up (the core loading its model, its own CPU time subtracted, while an
        offline frontend waits for it): it counts from `min_startup_window_s` (0.1 s: ten clock ticks a core)
        rather than a whole interval, since a benchmark's or an offline batch's first requests come within a
        fraction of a second of the core's start, and 1 thread of 2 for the first second of a 3-s batch cost
        ~0.5 s (moe_throughput.py, Zen 4; PROFILE.md)."""
        now = time.monotonic() if now is None else now
        first, self._stepped = not self._stepped, True
        if now - self._last_step_end <= (self.min_startup_window_s if first else self.interval_s):
            return
        before, sample = self._last, self._sample()
        self._quiet_s = 0.0
        if sample is None:
            return
        self._last = sample
        if before is None or sample.wall_s - before.wall_s < (self.min_startup_window_s if first else self.interval_s):
            return
        others = others_cores(before, sample)
        target = decide(self.current, others, self.cores)
        if target > self.current:
            self._apply(target, others, sample.wall_s)

    def maybe_update(self, now: Optional[float] = None) -> int:
        """After a step: if an interval has passed, sample, decide and apply; returns the count in use."""
        now = time.monotonic() if now is None else now
        self._last_step_end = now
        if self._last is None or now - self._last.wall_s < self.interval_s:
            return self.current
        sample = self._sample()
        if sample is None:
            return self.current
        before, self._last = self._last, sample
        window = sample.wall_s - before.wall_s
        own = sample.own_s - before.own_s
        if window > 20 * self.interval_s or own < self.min_own_cores * window:
            self._quiet_s = 0.0  # the core sat idle through most of it: says little about now; measure afresh
            return self.current
        others = others_cores(before, sample)
        target = decide(self.current, others, self.cores)
        if target > self.current:
            self._quiet_s += window
            if self._quiet_s < 2 * self.interval_s:
                return self.current
        self._quiet_s = 0.0
        if target != self.current:
            self._apply(target, others, sample.wall_s)
        return self.current

    def _apply(self, n: int, others: float, now: float) -> None:
        old, self.current = self.current, n
        self._set(n)
        self.changes += 1
        level = logging.INFO if now - self._last_log >= self.log_every_s else logging.DEBUG
        if level == logging.INFO:
            self._last_log = now
        logger.log(
            level,
            "engine core CPU threads %d -> %d (other processes use %.2f of %d cores)",
            old,
            n,
            others,
            self.cores,
        )


def usable_cpus() -> frozenset[int]:
    """The cores this process may run on."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return frozenset(range(os.cpu_count() or 1))


def _task_ids() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except (OSError, ValueError):
        return []


def _run_time_ns(tid: int) -> Optional[int]:
    """Nanoseconds thread `tid` of this process has run (/proc schedstat); None where unreadable."""
    try:
        with open(f"/proc/self/task/{tid}/schedstat") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def compute_thread_ids(run_parallel: Callable[[], None], main_tid: int, share: float = 0.3) -> list[int]:
    """The threads of this process, other than `main_tid`, that ran `run_parallel` beside it (OpenMP's workers):
    each ran at least `share` of the caller's time during it. Busiest first; [] where /proc says nothing."""
    before = {t: _run_time_ns(t) for t in _task_ids()}
    main_before = before.get(main_tid)
    run_parallel()
    main_after = _run_time_ns(main_tid)
    if main_before is None or main_after is None or main_after <= main_before:
        return []
    floor = share * (main_after - main_before)
    ran = []
    for tid in _task_ids():
        if tid == main_tid:
            continue
        after = _run_time_ns(tid)
        if after is not None and after - (before.get(tid) or 0) >= floor:
            ran.append((after - (before.get(tid) or 0), tid))
    return [tid for _, tid in sorted(ran, reverse=True)]


def _default_probe() -> None:
    """A few milliseconds of work that torch spreads over all its intra-op threads."""
    import torch

    a = torch.ones(256, 256)
    for _ in range(20):
        a = torch.mm(a, a).clamp_(-1.0, 1.0)


class ThreadPinner:
    """Sets the core's torch thread count and, when it equals the number of cores, binds one thread per core.

    Called with each new count (start-up and every change of `AdaptiveThreads`). Binding needs Linux (thread
    ids in /proc); anywhere else, or when the workers cannot be told apart, it only sets the count."""

    probe_attempts = 4  # probes before giving up on finding the workers

    def __init__(
        self,
        cpus: frozenset[int],
        set_threads: Callable[[int], None],
        probe: Optional[Callable[[], None]] = None,
        set_affinity: Optional[Callable[[int, Sequence[int]], None]] = None,
    ) -> None:
        self.cpus = sorted(cpus)
        self._set = set_threads
        self._probe = probe or _default_probe
        self._affinity = set_affinity or getattr(os, "sched_setaffinity", None)
        self.pinned: dict[int, int] = {}  # thread id -> the core it is bound to

    def __call__(self, n: int) -> None:
        self._set(n)
        if n > 1 and n == len(self.cpus) and self._affinity is not None:
            self._pin(n)
        else:
            self._unpin()

    def _pin(self, n: int) -> None:
        main = threading.get_native_id()
        workers: list[int] = []
        for _ in range(self.probe_attempts):  # one probe can miss a worker a busy neighbour kept off its core
            workers = compute_thread_ids(self._probe, main)
            if len(workers) >= n - 1:
                break
        if len(workers) < n - 1:
            logger.debug("not binding the engine core's threads: %d of %d OpenMP workers seen", len(workers), n - 1)
            self._unpin()
            return
        want = dict(zip([main] + workers[: n - 1], self.cpus))
        if want == self.pinned:
            return
        self._unpin()
        try:
            for tid, cpu in want.items():
                self._affinity(tid, [cpu])
                self.pinned[tid] = cpu
        except OSError as e:  # a thread gone, or binding refused (a container's policy): run unbound
            logger.debug("binding the engine core's threads failed (%s); running unbound", e)
            self._unpin()
            return
        logger.debug("engine core threads bound one per core: %s", self.pinned)

    def _unpin(self) -> None:
        for tid in list(self.pinned):
            try:
                self._affinity(tid, self.cpus)  # type: ignore[misc]
            except OSError:
                pass  # the thread has exited
        self.pinned = {}
