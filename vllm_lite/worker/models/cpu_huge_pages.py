"""Long-lived CPU tensors in memory advised for transparent huge pages (2 MiB pages), for the weight copies that
decode streams from DRAM every step.

Why: a 32-row decode step of the bench Qwen2 in bf16 streams ~257 MB of weight copies (the VNNI layout, LM head
included) through vllm-lite's own kernels (csrc/bf16_small_m.cpp). In 4 KiB pages that is ~63,000 pages a step,
far past the TLB's reach (a few thousand entries; in a KVM guest each miss is a two-level walk), and the hardware
prefetchers stop at every 4 KiB boundary. The same kernel over the same weights in 2 MiB pages: the 49 weights of a
step 25.3 -> 21.2 ms at 32 rows on 2 Zen 4 cores (a cold sweep, as in the engine; benchmarks/PROFILE.md, "huge
pages"). Hot (in cache) nothing changes, so the gain is the TLB and the prefetch, not the arithmetic.

How: anonymous mmaps of 64 MiB (or the tensor's size, if larger) advised MADV_HUGEPAGE before they are first touched,
carved into tensors one after another at 4 KiB alignment. The kernel backs each 2 MiB-aligned region with a huge
page when the host's transparent_hugepage setting is `always` or `madvise` (the usual default); under `never` the
advice is kept but nothing changes (4 KiB pages, as before). Only memory that is touched becomes resident, so an
arena's unused tail costs address space, not RSS. A tensor keeps its arena's mmap alive (torch.frombuffer holds a
reference); pickling or deep-copying such a tensor copies it into ordinary memory. Where mmap's madvise or
MADV_HUGEPAGE is missing (not Linux), `huge_page_contiguous` is `Tensor.contiguous`.

Only for tensors that live as long as the model (weights): freed arenas go back to the OS whole, and a short-lived
activation in huge pages pays a 2 MiB zeroing on first touch (torch's THP_MEM_ALLOC_ENABLE for every allocation
measured slower in the engine, PROFILE.md, "Zen 4, offline batch 32 ... where a step's time goes now").
"""

from __future__ import annotations

import logging
import mmap
import threading
import weakref
from typing import Optional

import torch

HUGE_PAGE = 2 << 20
ARENA_BYTES = 64 << 20
ALIGN = 4096

logger = logging.getLogger(__name__)

ENABLED = [True]  # tests and A/B benchmarks turn it off (then copies are ordinary tensors)

_lock = threading.Lock()


def supported() -> bool:
    """mmap can advise huge pages on this platform (Linux with madvise)."""
    return hasattr(mmap, "MADV_HUGEPAGE") and hasattr(mmap.mmap, "madvise")


class _Arena:
    """One advised anonymous mapping, handed out front to back.

    Nothing in this module keeps an arena's memory alive: each tensor carved from it is a torch.frombuffer over the
    mapping, which holds the mapping; the arena itself keeps only a weak reference to it. So the memory goes back to
    the OS when the last weight in it is dropped (with its model), and the next copy after that starts a new arena.
    """

    def __init__(self, nbytes: int) -> None:
        usable = (nbytes + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
        mapping = mmap.mmap(-1, usable + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # + room to align
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            mapping.close()
            raise
        self.first: Optional[mmap.mmap] = mapping  # strong until the first take hands part of it out
        self.mapping = weakref.ref(mapping)
        self.pos = (-torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr()) % HUGE_PAGE  # 2 MiB boundary
        self.size = self.pos + usable

    def take(self, nbytes: int) -> Optional[torch.Tensor]:
        """nbytes of the arena, or None when it is full or its memory is gone."""
        mapping, self.first = self.mapping(), None
        start = (self.pos + ALIGN - 1) // ALIGN * ALIGN
        if mapping is None or start + nbytes > self.size:
            return None
        self.pos = start + nbytes
        return torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=start)


# The arena being carved (it holds its memory only weakly).
_arena: list[Optional[_Arena]] = [None]
# Set when the host refused a mapping or the advice (a kernel without transparent huge pages answers EINVAL, a
# strict overcommit policy ENOMEM): from then on copies are ordinary tensors, and one warning said why.
_refused: list[Optional[str]] = [None]


def _take(nbytes: int) -> Optional[torch.Tensor]:
    """nbytes carved from the current arena, or from a new one; None where the host refuses huge-page mappings."""
    if _refused[0] is not None:
        return None
    arena = _arena[0]
    raw = arena.take(nbytes) if arena is not None else None
    if raw is not None:
        return raw
    try:
        arena = _Arena(max(ARENA_BYTES, nbytes))
    except OSError as e:
        _refused[0] = f"{type(e).__name__}: {e}"
        logger.warning("huge-page weight copies unavailable (%s): weights stay in ordinary pages", _refused[0])
        return None
    _arena[0] = arena
    return arena.take(nbytes)


def huge_page_contiguous(t: torch.Tensor) -> torch.Tensor:
    """t's values as a new contiguous CPU tensor in huge-page-advised memory (`t.contiguous()` where unsupported,
    turned off, refused by the host, or not a CPU tensor). t may be a strided view: it is copied once, straight
    into the arena."""
    t = t.detach()
    if not (ENABLED[0] and supported()) or t.device.type != "cpu" or t.numel() == 0:
        return t.contiguous()
    nbytes = t.numel() * t.element_size()
    with _lock:
        raw = _take(nbytes)
    if raw is None:
        return t.contiguous()
    out = raw.view(t.dtype).view(t.shape)
    out.copy_(t)
    return out


def is_huge_page_advised(t: torch.Tensor, smaps: str = "/proc/self/smaps") -> bool:
    """Whether the mapping holding t's first byte carries the huge-page advice (VmFlags `hg`; Linux only)."""
    addr = t.data_ptr()
    inside = False
    with open(smaps) as f:
        for line in f:
            head = line.split(" ", 1)[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= addr < hi
            elif inside and line.startswith("VmFlags:"):
                return "hg" in line.split()[1:]
    return False
