"""The engine core's CPU thread policy: what others use, from /proc/stat and our own CPU time, sets the count."""

from __future__ import annotations

import pytest

from vllm_lite.core.thread_policy import AdaptiveThreads, CpuSample, decide, others_cores, read_host_busy_s

PROC_STAT = """cpu  900 0 300 5000 100 0 0 0 0 0
cpu0 100 0 50 2000 40 5 5 0 0 0
cpu1 200 0 100 1000 60 0 0 10 0 0
cpu2 600 0 150 2000 0 0 0 0 0 0
intr 12345
"""


def test_busy_seconds_count_only_our_cores_and_leave_out_idle_and_iowait(tmp_path) -> None:
    stat = tmp_path / "stat"
    stat.write_text(PROC_STAT)
    tck = __import__("os").sysconf("SC_CLK_TCK")
    # cpu0: 100+50+5+5 busy ticks; cpu1: 200+100+10 (steal counts: the core was not ours to use).
    assert read_host_busy_s(frozenset({0, 1}), str(stat)) == pytest.approx((160 + 310) / tck)
    assert read_host_busy_s(frozenset({2}), str(stat)) == pytest.approx(750 / tck)
    assert read_host_busy_s(frozenset({7}), str(stat)) is None  # none of ours listed
    assert read_host_busy_s(frozenset({0}), str(tmp_path / "missing")) is None


def test_others_are_host_busy_less_our_own_time_per_wall_second() -> None:
    before = CpuSample(wall_s=10.0, host_busy_s=100.0, own_s=40.0)
    after = CpuSample(wall_s=12.0, host_busy_s=103.0, own_s=42.0)  # 3 s busy in 2 s, 2 of them ours
    assert others_cores(before, after) == pytest.approx(0.5)
    assert others_cores(before, CpuSample(12.0, 102.0, 42.5)) == 0.0  # accounting skew never goes negative
    assert others_cores(before, before) == 0.0


@pytest.mark.parametrize(
    "current,others,cores,expected",
    [
        (1, 0.05, 2, 2),  # the frontend sleeps: take the second core
        (1, 0.3, 2, 1),  # others use a third of it: not worth the barrier waits
        (2, 0.3, 2, 2),  # ...but not enough to give it back (hysteresis)
        (2, 0.5, 2, 1),  # a busy neighbour: back to one thread at once
        (2, 1.8, 2, 1),  # never below one
        (15, 1.0, 16, 15),  # one core's worth of frontends on a 16-core host
        (15, 0.1, 16, 16),
        (16, 3.0, 16, 13),
    ],
)
def test_decide_gives_one_thread_per_core_others_leave_free_with_hysteresis(current, others, cores, expected) -> None:
    assert decide(current, others, cores) == expected


class FakeHost:
    """Samples at chosen moments: `others` cores busy besides us, `ours` cores of our own CPU time."""

    def __init__(self) -> None:
        self.t, self.busy, self.own = 0.0, 0.0, 0.0

    def advance(self, dt: float, others: float, ours: float) -> float:
        self.t += dt
        self.busy += dt * (others + ours)
        self.own += dt * ours
        return self.t

    def sample(self) -> CpuSample:
        return CpuSample(self.t, self.busy, self.own)


def test_adapter_goes_up_after_two_quiet_intervals_of_time_and_down_at_once_when_others_get_busy() -> None:
    host, applied = FakeHost(), []
    policy = AdaptiveThreads(frozenset({0, 1}), 1, applied.append, sample=host.sample, interval_s=0.5)
    assert policy.maybe_update(host.advance(0.2, 0.0, 0.2)) == 1 and applied == []  # too soon to sample
    assert policy.maybe_update(host.advance(0.4, 0.0, 0.6)) == 1  # one quiet interval is not enough
    assert policy.maybe_update(host.advance(0.6, 0.05, 0.6)) == 2 and applied == [2]
    assert policy.maybe_update(host.advance(0.6, 0.3, 1.4)) == 2  # between the bounds: stays
    assert policy.maybe_update(host.advance(0.6, 0.9, 1.1)) == 1 and applied == [2, 1]
    # A quiet interval then a busy one: the pending rise is forgotten.
    assert policy.maybe_update(host.advance(0.6, 0.0, 0.6)) == 1
    assert policy.maybe_update(host.advance(0.6, 0.8, 0.6)) == 1
    assert policy.maybe_update(host.advance(0.6, 0.0, 0.6)) == 1 and applied == [2, 1]
    assert policy.changes == 2
    # One step longer than two intervals (a big prefill) is quiet time enough on its own.
    assert policy.maybe_update(host.advance(1.2, 0.0, 1.0)) == 2 and applied == [2, 1, 2]


def test_a_window_spanning_a_long_idle_spell_decides_nothing() -> None:
    host, applied = FakeHost(), []
    policy = AdaptiveThreads(frozenset({0, 1}), 2, applied.append, sample=host.sample, interval_s=0.5)
    assert policy.maybe_update(host.advance(60.0, 1.5, 0.0)) == 2  # the core slept for a minute
    assert applied == []
    assert policy.maybe_update(host.advance(0.5, 1.5, 0.5)) == 1 and applied == [1]  # now it measures


def test_no_readable_counters_keep_the_start_count() -> None:
    policy = AdaptiveThreads(frozenset({0, 1}), 1, lambda n: pytest.fail("must not change"), sample=lambda: None)
    assert policy.maybe_update(100.0) == 1


def test_a_burst_after_a_short_idle_spell_is_not_charged_for_what_others_did_meanwhile() -> None:
    """The embedding benchmark's pattern: the core idles ~8 s (under the 20-interval reset) while the frontend
    process runs another engine on both cores, then works again on an idle host. It must keep its 2 threads.
    (min_own_cores=0: the step hook alone, not the own-CPU check, must do it.)"""
    host, applied = FakeHost(), []
    policy = AdaptiveThreads(
        frozenset({0, 1}), 2, applied.append, sample=host.sample, interval_s=0.5, min_own_cores=0.0
    )
    assert policy.maybe_update(host.advance(0.6, 0.0, 2.0)) == 2  # busy, alone
    host.advance(8.0, 1.85, 0.0)  # idle; others use 1.85 cores
    policy.before_step(host.t)  # the busy period starts: a fresh window
    assert policy.maybe_update(host.advance(0.6, 0.05, 1.95)) == 2
    assert policy.maybe_update(host.advance(0.6, 0.05, 1.95)) == 2 and applied == []


def test_without_the_step_hook_a_window_the_core_mostly_slept_through_decides_nothing() -> None:
    host, applied = FakeHost(), []
    policy = AdaptiveThreads(frozenset({0, 1}), 2, applied.append, sample=host.sample, interval_s=0.5)
    host.advance(8.0, 1.85, 0.0)  # idle while others work; no before_step (another caller)
    assert policy.maybe_update(host.advance(0.4, 0.0, 2.0)) == 2 and applied == []  # own 0.8 s of 8.4: dropped
    assert policy.maybe_update(host.advance(0.6, 0.05, 1.95)) == 2 and applied == []  # measured afresh: quiet
    # A neighbour that is busy while the core works still takes a thread away at once.
    assert policy.maybe_update(host.advance(0.6, 0.9, 1.1)) == 1 and applied == [1]


def test_before_step_right_after_a_step_keeps_the_window_running() -> None:
    host, applied = FakeHost(), []
    policy = AdaptiveThreads(frozenset({0, 1}), 2, applied.append, sample=host.sample, interval_s=0.5)
    assert policy.maybe_update(host.advance(0.3, 0.9, 1.1)) == 2  # too soon to sample
    policy.before_step(host.advance(0.01, 0.9, 0.0))  # back to back steps: no fresh window
    assert policy.maybe_update(host.advance(0.3, 0.9, 1.1)) == 1 and applied == [1]  # busy others count in full


def test_a_burst_after_a_quiet_idle_spell_starts_on_every_free_core_at_once() -> None:
    """Offline batches start after the core waited: if nobody used the cores meanwhile, no ramp-up second."""
    host, applied = FakeHost(), []
    policy = AdaptiveThreads(frozenset({0, 1}), 1, applied.append, sample=host.sample, interval_s=0.5)
    host.advance(3.0, 0.05, 0.02)  # start-up done, the core waits for requests; the host is quiet
    policy.before_step(host.t)
    assert applied == [2] and policy.current == 2
    assert policy.maybe_update(host.advance(0.6, 0.05, 1.95)) == 2 and applied == [2]
    # A neighbour busy while the core works still takes the thread back at once.
    assert policy.maybe_update(host.advance(0.6, 0.9, 1.1)) == 1 and applied == [2, 1]


def test_an_idle_spell_others_kept_busy_neither_raises_nor_lowers() -> None:
    host, applied = FakeHost(), []
    policy = AdaptiveThreads(frozenset({0, 1}), 1, applied.append, sample=host.sample, interval_s=0.5)
    host.advance(3.0, 1.0, 0.0)  # others use a whole core while the core waits
    policy.before_step(host.t)
    assert applied == [] and policy.current == 1
    policy = AdaptiveThreads(frozenset({0, 1}), 2, applied.append, sample=host.sample, interval_s=0.5)
    host.advance(3.0, 1.85, 0.0)  # busy meanwhile, maybe over now: lowering waits for a window of work
    policy.before_step(host.t)
    assert applied == [] and policy.current == 2


def test_the_first_step_counts_a_short_quiet_start_up_window() -> None:
    """An offline batch's first requests come within a fraction of a second of the core's start: if others left
    the cores free while it loaded, the first step starts on all of them (not after a second at one thread)."""
    host, applied = FakeHost(), []
    policy = AdaptiveThreads(frozenset({0, 1}), 1, applied.append, sample=host.sample, interval_s=0.5)
    host.advance(0.3, 0.02, 0.9)  # loading the model (own CPU), the frontend waits
    policy.before_step(host.t)
    assert applied == [2] and policy.current == 2


def test_only_the_first_step_counts_a_short_window_and_a_busy_start_up_raises_nothing() -> None:
    host, applied = FakeHost(), []
    policy = AdaptiveThreads(frozenset({0, 1}), 1, applied.append, sample=host.sample, interval_s=0.5)
    host.advance(0.3, 0.8, 0.9)  # a frontend busy beside the loading core
    policy.before_step(host.t)
    assert applied == [] and policy.current == 1
    policy.maybe_update(host.advance(0.01, 0.8, 0.01))
    host.advance(0.3, 0.0, 0.0)  # a quiet idle spell shorter than an interval, after the first step
    policy.before_step(host.t)
    assert applied == [] and policy.current == 1
    # Shorter than the start-up minimum (0.1 s) decides nothing either.
    fresh = AdaptiveThreads(frozenset({0, 1}), 1, applied.append, sample=host.sample, interval_s=0.5)
    fresh.before_step(host.advance(0.05, 0.0, 0.05))
    assert applied == [] and fresh.current == 1
