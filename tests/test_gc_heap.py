"""The engine core's garbage-collector policy (vllm_lite/core/gc_heap.py, issue #14).

An engine-core process freezes its start-up heap (collected first) before it serves and raises the youngest
generation's threshold; $VLLM_LITE_GC_FREEZE=0 leaves the collector as Python set it. An in-process core only
raises the threshold while it lives (the last one to shut down, or to be collected unshut, restores it) and
freezes nothing.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any, Optional

import pytest
import zmq

from vllm_lite import launcher
from vllm_lite.config import encode_vllm_config
from vllm_lite.core import gc_heap
from vllm_lite.core.messages import EngineCoreArgs, EngineCoreReady
from vllm_lite.held_setting import HeldSetting
from vllm_lite.testing.fake_core import FAKE_CORE_MODULE, RawFrontend, fake_config, make_addresses


def _core_gc_state(tmpdir: str, env: Optional[dict[str, str]] = None) -> dict[str, Any]:
    """A fake engine-core process started by the launcher (as `vllm-lite serve` starts real ones): its gc state,
    read with the get_gc_state utility call once it serves."""
    addresses = make_addresses(tmpdir)
    args = EngineCoreArgs(
        vllm_config=encode_vllm_config(fake_config()),
        input_address=addresses.input,
        output_address=addresses.output,
    )
    proc = launcher.start_child(FAKE_CORE_MODULE, args, EngineCoreReady, name="fake-core", env=env)
    ctx = zmq.Context()
    try:
        proc.wait_ready(120)
        fe = RawFrontend(ctx, addresses)
        assert fe.hello().accepted
        out = fe.utility("get_gc_state")
        assert out.failure_message is None, out.failure_message
        return out.result
    finally:
        proc.stop()
        ctx.destroy(linger=0)


def test_core_process_freezes_its_heap_and_raises_the_young_threshold(tmp_path):
    state = _core_gc_state(str(tmp_path), env={"VLLM_LITE_GC_FREEZE": "1", "VLLM_LITE_GC_GEN0_THRESHOLD": "12345"})
    assert state["enabled"]
    assert state["freeze_count"] > 1000  # torch, zmq, the core: thousands of objects
    assert state["threshold"][0] == 12345


def test_core_process_leaves_the_collector_alone_when_turned_off(tmp_path):
    state = _core_gc_state(str(tmp_path), env={"VLLM_LITE_GC_FREEZE": "0", "VLLM_LITE_GC_GEN0_THRESHOLD": "12345"})
    assert state["freeze_count"] == 0
    assert state["threshold"][0] != 12345


@pytest.fixture
def clean_gc(monkeypatch):
    """No in-process holder yet (cores other tests never shut down keep theirs: set aside here), nothing frozen;
    the collector as it was afterwards, whatever the test does."""
    before = gc.get_threshold()
    was_frozen = gc.get_freeze_count() > 0
    gc.unfreeze()  # some interpreters start with objects frozen (the H100 image's Python did)
    monkeypatch.setattr(gc_heap, "_young_gen", HeldSetting(gc.get_threshold, lambda t: gc.set_threshold(*t)))
    monkeypatch.setenv("VLLM_LITE_GC_FREEZE", "1")
    monkeypatch.setenv("VLLM_LITE_GC_GEN0_THRESHOLD", "9999")
    gc.set_threshold(700, *before[1:])
    try:
        yield gc.get_threshold()
    finally:
        gc.unfreeze()
        if was_frozen:  # the interpreter's own frozen heap back (what is alive now, as close as freeze gets)
            gc.freeze()
        gc.set_threshold(*before)


class _Cycle:
    def __init__(self) -> None:
        self.me = self


class _Owner:
    pass


def test_raised_threshold_is_held_until_the_last_in_process_core_restores_it(clean_gc):
    before = clean_gc
    first, second = _Owner(), _Owner()
    release_first = gc_heap.raise_gc_threshold(first)
    assert gc.get_threshold() == (9999, *before[1:]) and gc.get_freeze_count() == 0  # in-process: never frozen
    release_second = gc_heap.raise_gc_threshold(second)  # a second core in this process
    release_first()
    assert gc.get_threshold()[0] == 9999  # the other core still holds it
    release_second()
    assert gc.get_threshold() == before
    release_second()  # released twice: nothing happens
    assert gc.get_threshold() == before and gc_heap._young_gen.holders == 0


def test_an_owner_collected_without_a_release_restores_the_threshold(clean_gc):
    owner = _Owner()
    owner.me = owner  # only the cyclic collector frees it, as an engine core (its profiler's lambda holds it)
    assert gc_heap.raise_gc_threshold(owner) is not None
    assert gc.get_threshold()[0] == 9999
    del owner
    gc.collect()
    assert gc.get_threshold() == clean_gc and gc_heap._young_gen.holders == 0


def test_freeze_collects_first_then_freezes_and_raises_the_threshold(clean_gc):
    obj = _Cycle()
    ref = weakref.ref(obj)
    gc.freeze()  # garbage an earlier freeze kept is reclaimed too
    del obj
    assert gc_heap.freeze_gc_heap()
    assert ref() is None  # collected before the freeze, not kept for good
    assert gc.get_freeze_count() > 1000 and gc.get_threshold()[0] == 9999
    kept = _Cycle()
    ref = weakref.ref(kept)
    gc.freeze()
    del kept
    gc.collect()
    assert ref() is not None  # what is frozen no collection reaches (why the in-process core does not freeze)


def test_turned_off_changes_nothing(clean_gc, monkeypatch):
    monkeypatch.setenv("VLLM_LITE_GC_FREEZE", "0")
    assert not gc_heap.freeze_gc_heap()
    assert gc_heap.raise_gc_threshold(_Owner()) is None
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == clean_gc


def test_in_process_engine_core_raises_the_threshold_while_it_lives(clean_gc):
    from vllm_lite.testing.core_harness import tiny_engine_core

    core = tiny_engine_core()
    try:
        assert gc.get_threshold()[0] == 9999 and gc.get_freeze_count() == 0
        assert core.call_utility("get_gc_state", [])["threshold"][0] == 9999
    finally:
        core.shutdown()
    assert gc.get_threshold() == clean_gc
    core.shutdown()  # a second shutdown restores nothing more
    assert gc_heap._young_gen.holders == 0


def test_in_process_engine_core_never_shut_down_restores_the_threshold_when_collected(clean_gc):
    from vllm_lite.testing.core_harness import drain, make_request, tiny_engine_core

    core = tiny_engine_core()
    core.add_request(make_request("a", [1, 2, 3]))
    results: dict = {}
    drain(core, results)
    assert len(results["a"].token_ids) == 4
    assert gc.get_threshold()[0] == 9999
    del core  # dropped, as tests and notebooks drop engines
    gc.collect()
    assert gc.get_threshold() == clean_gc and gc_heap._young_gen.holders == 0
