"""The engine core's garbage-collector policy: its start-up heap frozen, the youngest generation's threshold raised.

Python's cyclic collector runs a young collection every 700 net container allocations and, as survivors pile up,
a full one that walks every tracked object. In an engine core the heap is mostly the model, the tokenizer, torch
and CUDA graphs, none of which ever becomes garbage: vLLM freezes it once the core is up (freeze_gc_heap), and so
do we. The engine's own steps make no reference cycles (a young collection at batch 256 reclaims nothing), so a
higher young threshold only defers work that finds nothing.
"""

from __future__ import annotations

import gc
from typing import Any, Optional

from vllm_lite import envs

# Cores holding the heap frozen in this process, and the thresholds the first of them found (restored by the last).
_gc_holders = 0
_gc_saved_threshold: Optional[tuple[int, int, int]] = None


def freeze_gc_heap(collect: bool) -> bool:
    """vLLM's freeze_gc_heap: move every object alive now into the permanent generation, which collections never
    walk, and raise the youngest generation's threshold ($VLLM_LITE_GC_GEN0_THRESHOLD). A decode step at batch 256
    allocates ~1,300 short-lived containers (lists, dicts, outputs) net of what it frees: at Python's 700 that is
    ~2 young collections a step (~110 us in-process), and the objects they promote trigger a full collection every
    few hundred steps, which walked the whole heap (model, tokenizer, torch) for 150-190 ms (Zen 4, CPU tiny
    model); frozen, it walks a few hundred objects. `collect` (the core's own process, before it serves):
    unfreeze, collect everything, then freeze, so start-up garbage is reclaimed rather than kept for good; an
    in-process core freezes as it finds the heap (O(1); garbage frozen meanwhile comes back at release). False
    when $VLLM_LITE_GC_FREEZE turns it off. Each True must be paired with release_gc_heap()."""
    global _gc_holders, _gc_saved_threshold
    if not envs.VLLM_LITE_GC_FREEZE:
        return False
    if collect:
        gc.unfreeze()
        gc.collect()
    gc.freeze()
    if _gc_holders == 0:
        _gc_saved_threshold = gc.get_threshold()
    _gc_holders += 1
    gen0 = int(envs.VLLM_LITE_GC_GEN0_THRESHOLD)
    if gen0 > 0:
        _, gen1, gen2 = gc.get_threshold()
        gc.set_threshold(gen0, gen1, gen2)
    return True


def release_gc_heap() -> None:
    """Undo one freeze_gc_heap: everything frozen goes back to the oldest generation (another live core in this
    process loses its freeze too: only speed, never memory, is at stake), and the last holder restores the
    thresholds the first one found."""
    global _gc_holders, _gc_saved_threshold
    if _gc_holders <= 0:
        return
    _gc_holders -= 1
    gc.unfreeze()
    if _gc_holders == 0 and _gc_saved_threshold is not None:
        gc.set_threshold(*_gc_saved_threshold)
        _gc_saved_threshold = None


def gc_state() -> dict[str, Any]:
    """This process's collector: frozen objects, thresholds, collections so far (the core's utility call)."""
    return {
        "enabled": gc.isenabled(),
        "freeze_count": gc.get_freeze_count(),
        "threshold": list(gc.get_threshold()),
        "collections": [g["collections"] for g in gc.get_stats()],
    }
