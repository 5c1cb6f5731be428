"""Binding the engine core's compute threads one per core while it uses every core (vLLM's VLLM_CPU_OMP_THREADS_BIND)."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from vllm_lite.core import thread_policy
from vllm_lite.core.thread_policy import ThreadPinner, compute_thread_ids


class Recorder:
    def __init__(self, fail_on: int | None = None) -> None:
        self.calls: list[tuple[int, list[int]]] = []
        self.fail_on = fail_on

    def __call__(self, tid: int, cpus) -> None:
        if tid == self.fail_on:
            raise OSError("no such thread")
        self.calls.append((tid, sorted(cpus)))


def make(monkeypatch, workers: list[int], cpus=(4, 5), fail_on: int | None = None):
    counts: list[int] = []
    affinity = Recorder(fail_on)
    monkeypatch.setattr(thread_policy, "compute_thread_ids", lambda probe, main: list(workers))
    pinner = ThreadPinner(frozenset(cpus), counts.append, probe=lambda: None, set_affinity=affinity)
    return pinner, counts, affinity


def test_all_cores_bind_one_thread_each_and_fewer_threads_unbind(monkeypatch) -> None:
    pinner, counts, affinity = make(monkeypatch, workers=[77])
    main = threading.get_native_id()
    pinner(2)
    assert counts == [2]
    assert pinner.pinned == {main: 4, 77: 5} and affinity.calls == [(main, [4]), (77, [5])]
    affinity.calls.clear()
    pinner(2)  # the same threads: nothing to redo
    assert affinity.calls == []
    pinner(1)  # a neighbour took a core: every bound thread may run anywhere again
    assert counts == [2, 2, 1]
    assert pinner.pinned == {} and sorted(affinity.calls) == sorted([(main, [4, 5]), (77, [4, 5])])


def test_fewer_threads_than_cores_or_unseen_workers_never_bind(monkeypatch) -> None:
    pinner, counts, affinity = make(monkeypatch, workers=[77], cpus=(0, 1, 2))
    pinner(2)  # 2 of 3 cores: the scheduler keeps placing them
    assert counts == [2] and pinner.pinned == {} and affinity.calls == []
    pinner, counts, affinity = make(monkeypatch, workers=[])
    pinner(2)  # the probe saw no worker (no /proc, another OpenMP runtime): unbound
    assert counts == [2] and pinner.pinned == {} and affinity.calls == []


def test_a_probe_that_misses_the_worker_is_retried_a_bounded_number_of_times(monkeypatch) -> None:
    """Under a busy neighbour one probe can see the worker run too little; binding must not hang on that."""
    seen: list[list[int]] = [[], [], [77]]
    calls: list[int] = []

    def ids(probe, main):
        calls.append(main)
        return seen.pop(0) if seen else []

    affinity = Recorder()
    monkeypatch.setattr(thread_policy, "compute_thread_ids", ids)
    pinner = ThreadPinner(frozenset((4, 5)), lambda n: None, probe=lambda: None, set_affinity=affinity)
    pinner(2)
    assert len(calls) == 3 and pinner.pinned == {threading.get_native_id(): 4, 77: 5}
    pinner._unpin()
    calls.clear()
    pinner(2)  # never seen: gives up after its attempts, unbound
    assert len(calls) == ThreadPinner.probe_attempts and pinner.pinned == {}


def test_a_refused_binding_leaves_every_thread_unbound(monkeypatch) -> None:
    pinner, _, affinity = make(monkeypatch, workers=[77], fail_on=77)
    main = threading.get_native_id()
    pinner(2)
    assert pinner.pinned == {}
    assert affinity.calls == [(main, [4]), (main, [4, 5])]  # the main thread was bound, then released again


def _two_cpus() -> list[int]:
    if not hasattr(os, "sched_getaffinity") or not os.path.exists(f"/proc/self/task/{threading.get_native_id()}"):
        pytest.skip("thread ids in /proc and sched_setaffinity are Linux's")
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two usable cores")
    return cpus[:2]


def test_on_this_host_the_openmp_worker_is_found_and_bound() -> None:
    cpus = _two_cpus()
    main = threading.get_native_id()
    before_threads, before_mask = torch.get_num_threads(), os.sched_getaffinity(main)
    pinner = ThreadPinner(frozenset(cpus), torch.set_num_threads)
    try:
        pinner(2)
        assert len(pinner.pinned) == 2 and pinner.pinned[main] == cpus[0]
        (worker,) = [t for t in pinner.pinned if t != main]
        assert os.sched_getaffinity(main) == {cpus[0]} and os.sched_getaffinity(worker) == {cpus[1]}
        assert worker in compute_thread_ids(thread_policy._default_probe, main)  # it is torch's worker
        pinner(1)
        assert pinner.pinned == {} and os.sched_getaffinity(main) == set(cpus)
    finally:
        pinner._unpin()
        os.sched_setaffinity(main, before_mask)
        torch.set_num_threads(before_threads)


def test_the_core_binds_unless_told_nobind(monkeypatch) -> None:
    from vllm_lite.core.engine_core_proc import set_core_thread_policy
    from vllm_lite.testing.fake_core import fake_config

    cfg = fake_config()
    cfg.device_config.num_threads = None  # the policy's count, not a fixed one
    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        _, adaptive = set_core_thread_policy(cfg)
        assert adaptive is not None and adaptive._set is torch.set_num_threads
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "auto")
        _, adaptive = set_core_thread_policy(cfg)
        assert adaptive is not None and isinstance(adaptive._set, ThreadPinner)
    finally:
        torch.set_num_threads(before)


def test_a_cpu_list_for_the_binding_is_not_silently_taken_as_auto(monkeypatch, caplog) -> None:
    """vLLM accepts CPU lists ("0-31|32-63"); we bind as 'auto' and must say so."""
    from vllm_lite.core.engine_core_proc import set_core_thread_policy
    from vllm_lite.testing.fake_core import fake_config

    cfg = fake_config()
    cfg.device_config.num_threads = None
    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1")
        with caplog.at_level("WARNING", logger="vllm_lite.core.engine_core_proc"):
            _, adaptive = set_core_thread_policy(cfg)
        assert adaptive is not None and isinstance(adaptive._set, ThreadPinner)
        assert any("VLLM_CPU_OMP_THREADS_BIND" in r.getMessage() and "'0-1'" in r.getMessage() for r in caplog.records)
    finally:
        torch.set_num_threads(before)
