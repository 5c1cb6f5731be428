"""The engine core's garbage-collector policy: its start-up heap frozen (its own process), the youngest
generation's threshold raised (there and in-process).

Python's cyclic collector runs a young collection every 700 net container allocations and, as survivors pile up,
a full one that walks every tracked object. In an engine core the heap is mostly the model, the tokenizer, torch
and CUDA graphs, none of which ever becomes garbage: vLLM freezes it once the core is up (freeze_gc_heap), and so
do we. The engine's own steps make no reference cycles (a young collection at batch 256 reclaims nothing), so a
higher young threshold only defers work that finds nothing.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any, Optional

from vllm_lite import envs
from vllm_lite.held_setting import HeldSetting

# The young threshold as in-process cores hold it: the first saves the process's thresholds, the last restores them.
_young_gen: HeldSetting[tuple[int, int, int]] = HeldSetting(gc.get_threshold, lambda t: gc.set_threshold(*t))


def _young_threshold() -> int:
    return int(envs.VLLM_LITE_GC_GEN0_THRESHOLD)


def freeze_gc_heap() -> bool:
    """vLLM's freeze_gc_heap, for a process that is the engine core's alone (run_engine_core, before it serves):
    collect everything (start-up garbage is reclaimed, not kept for good), move every object alive into the
    permanent generation, which collections never walk, and raise the youngest generation's threshold
    ($VLLM_LITE_GC_GEN0_THRESHOLD). Measured at batch 256 (CPU tiny model, Zen 4): Python's 700 gave ~1.8 young
    collections a step (~110 us) and, every ~300 steps, a full collection that walked the whole heap (340k objects:
    model, tokenizer, torch) for 155-186 ms; frozen with 10000, none in 300 steps. False (nothing done) when
    $VLLM_LITE_GC_FREEZE turns it off. Never undone: the process ends with the core."""
    if not envs.VLLM_LITE_GC_FREEZE:
        return False
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    gen0 = _young_threshold()
    if gen0 > 0:
        _, gen1, gen2 = gc.get_threshold()
        gc.set_threshold(gen0, gen1, gen2)
    return True


def raise_gc_threshold(owner: object) -> Optional[weakref.finalize]:
    """An in-process core (LLM(multiprocess=False), tests): only the youngest generation's threshold is raised, so
    its steps trigger (almost) no collections, and with them no full one. Its heap is not frozen: it shares the
    process with the caller's objects, and a core never shut down (tests build hundreds) would keep whatever was
    frozen alive for good. Returns the release (None: nothing changed, when $VLLM_LITE_GC_FREEZE is off or the
    threshold is 0): call it at shutdown; it also runs when ``owner`` is collected, so a core never shut down does
    not leave the process's threshold raised. The last release restores the thresholds the first hold found."""
    gen0 = _young_threshold()
    if not envs.VLLM_LITE_GC_FREEZE or gen0 <= 0:
        return None
    _, gen1, gen2 = gc.get_threshold()
    return _young_gen.hold(owner, (gen0, gen1, gen2))


def gc_state() -> dict[str, Any]:
    """This process's collector: frozen objects, thresholds, collections so far (the core's utility call)."""
    return {
        "enabled": gc.isenabled(),
        "freeze_count": gc.get_freeze_count(),
        "threshold": list(gc.get_threshold()),
        "collections": [g["collections"] for g in gc.get_stats()],
    }
