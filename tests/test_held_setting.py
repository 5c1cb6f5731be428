"""HeldSetting (vllm_lite/held_setting.py): the process-wide settings in-process engines hold while they live."""

from __future__ import annotations

import gc
import threading

from vllm_lite.held_setting import HeldSetting


class _Owner:
    """Stands in for an engine; `cycle` puts it in a reference cycle, so only a collection frees it."""

    def __init__(self) -> None:
        self.cycle = self


def test_last_release_restores_the_value_the_process_had() -> None:
    box = ["caller"]
    held = HeldSetting(lambda: box[0], lambda v: box.__setitem__(0, v))
    a, b = _Owner(), _Owner()
    release_a = held.hold(a, "a")
    release_b = held.hold(b, "b")
    assert box[0] == "b"
    release_a()
    assert box[0] == "b" and held.holders == 1
    release_b()
    release_b()  # a second call does nothing
    assert box[0] == "caller" and held.holders == 0


def test_a_late_release_leaves_a_value_set_since_by_someone_else() -> None:
    """A dropped engine's release may run at any later collection: by then the process may own the setting again
    (the test suite's thread pinning set torch's threads to 2 and a late release put 1 back mid-probe)."""
    box = ["caller"]
    held = HeldSetting(lambda: box[0], lambda v: box.__setitem__(0, v))
    release = held.hold(_Owner(), "engine")
    box[0] = "the process's own"
    release()
    assert box[0] == "the process's own" and held.holders == 0
    release_again = held.hold(_Owner(), "engine")  # and a new hold saves and restores as usual
    release_again()
    assert box[0] == "the process's own"


def test_a_collection_inside_hold_that_releases_an_earlier_owner_does_not_deadlock() -> None:
    """A new engine's hold() may trigger a collection (set_ allocates) that finalizes an engine dropped without
    shutdown, on the same thread, while hold() holds the lock: the release must not wait on that lock forever."""
    box = ["caller"]

    def set_and_collect(v: str) -> None:
        box[0] = v
        gc.collect()  # what an allocation inside set_ may do on its own

    held = HeldSetting(lambda: box[0], set_and_collect)
    was_enabled = gc.isenabled()
    gc.disable()  # the first owner is freed only by the collection inside the second hold
    try:
        old = _Owner()
        held.hold(old, "old")
        del old
        owners = [_Owner()]
        done: list[bool] = []

        def hold_new() -> None:
            held.hold(owners[0], "new")
            done.append(True)

        worker = threading.Thread(target=hold_new, daemon=True)
        worker.start()
        worker.join(timeout=60)  # a deadlock guard, not a timing assertion
        assert not worker.is_alive(), "hold() deadlocked on the release of an owner it collected"
    finally:
        if was_enabled:
            gc.enable()
    assert done and held.holders == 1 and box[0] == "new"
    owners.clear()
    gc.collect()
    assert held.holders == 0 and box[0] == "caller"
