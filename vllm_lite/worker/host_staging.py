"""Host -> device copies that never wait for the device, for async scheduling (issue #14).

A copy from *pageable* host memory (`torch.from_numpy(a).to("cuda", non_blocking=True)`) is staged by the
driver and returns only once the stream reached it: while step N runs, launching step N+1 would wait for step N,
and the overlap async scheduling exists for is gone. `PinnedRing` stages every host array of a step through a
pinned buffer first: two slots (step N+1 fills one while step N's copies may still read the other), each a
bump allocator over one pinned byte buffer with an event recorded after its last copy; a slot is reused two
steps later, after waiting on that event (by then its copies ran long ago: the engine keeps at most two steps in
flight and reads step N's tokens before it launches step N+2).

Off CUDA the ring is a passthrough (`torch.from_numpy`): CPU tensors need no copy, and the runner's synchronous
path keeps its own copies unchanged (it never builds a ring).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

_ALIGN = 64  # bytes: every staged array starts on a cache line (and any dtype's alignment)
_MIN_SLOT_BYTES = 1 << 20


_TORCH_DTYPES: dict[np.dtype, torch.dtype] = {}


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    t = _TORCH_DTYPES.get(dtype)
    if t is None:
        t = _TORCH_DTYPES[dtype] = torch.from_numpy(np.empty(0, dtype=dtype)).dtype
    return t


class PinnedRing:
    """Two pinned staging slots for one device; `begin_step` switches slot, `stage`/`host` copy arrays in, and
    `record` (once a step, after its last copy is queued) marks when the slot may be written again."""

    def __init__(self, device: torch.device, num_slots: int = 2) -> None:
        self.device = torch.device(device)
        self.passthrough = self.device.type != "cuda"
        self.num_slots = num_slots
        self.slot = 0
        self._offset = 0
        self._buffers: list[Optional[torch.Tensor]] = [None] * num_slots
        self._retired: list[list[torch.Tensor]] = [[] for _ in range(num_slots)]  # outgrown, maybe still read
        self._events: list[Optional[torch.cuda.Event]] = [None] * num_slots
        # Per slot: the buffer as a numpy byte array (writes), and its typed views by numpy dtype (the tensors
        # handed out are slices of these: one torch op an array, not a slice and two views).
        self._bytes: list[Optional[np.ndarray]] = [None] * num_slots
        self._typed: list[dict[np.dtype, torch.Tensor]] = [{} for _ in range(num_slots)]
        # The stream the runner's steps run on: the device's current stream at the first step, cached
        # (torch.cuda.current_stream costs ~10 us a call on an H100; the runner never switches streams, and CUDA
        # graph capture's side stream exists only inside capture, which runs no step).
        self.stream: Optional[torch.cuda.Stream] = None
        self.steps = 0

    def begin_step(self) -> None:
        """Take the next slot for a new step: its previous copies (two steps ago) must have finished."""
        self.steps += 1
        if self.passthrough:
            return
        if self.stream is None and self.device.type == "cuda":
            self.stream = torch.cuda.current_stream(self.device)
        self.slot = (self.slot + 1) % self.num_slots
        event = self._events[self.slot]
        if event is not None and not event.query():  # recorded two steps ago: done by the time the engine
            event.synchronize()  # has read that step's tokens, so this wait is only a guard
        self._retired[self.slot].clear()
        self._offset = 0

    def host(self, arr: np.ndarray) -> torch.Tensor:
        """A pinned host tensor holding a copy of `arr` (valid until this slot is reused, two steps on)."""
        arr = np.ascontiguousarray(arr)
        if self.passthrough:
            return torch.from_numpy(arr)
        nbytes = arr.nbytes
        start = -(-self._offset // _ALIGN) * _ALIGN
        slot = self.slot
        buf = self._buffers[slot]
        if buf is None or start + nbytes > buf.numel():
            if buf is not None:
                self._retired[slot].append(buf)  # earlier copies of this step may still read it
            size = max(_MIN_SLOT_BYTES, 2 * (nbytes + _ALIGN), 0 if buf is None else 2 * buf.numel())
            size = -(-size // _ALIGN) * _ALIGN  # every dtype's view of it covers it whole
            buf = self._buffers[slot] = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            self._bytes[slot] = buf.numpy()
            self._typed[slot] = {}
            start = 0
        self._offset = start + nbytes
        host = self._bytes[slot]
        assert host is not None
        if nbytes:
            host[start : start + nbytes] = (arr if arr.ndim == 1 else arr.reshape(-1)).view(np.uint8)
        typed = self._typed[slot].get(arr.dtype)
        if typed is None:
            typed = self._typed[slot][arr.dtype] = buf.view(_torch_dtype(arr.dtype))
        first = start // arr.itemsize
        view = typed[first : first + arr.size]
        return view if arr.ndim == 1 else view.view(arr.shape)

    def stage(self, arr: np.ndarray) -> torch.Tensor:
        """`arr` on the device, copied asynchronously from pinned memory (the array itself on CPU)."""
        t = self.host(arr)
        return t if self.passthrough else t.to(self.device, non_blocking=True)

    def record(self) -> None:
        """Mark the slot's copies issued so far (on the step stream); `begin_step` waits for the last mark."""
        if self.passthrough:
            return
        event = self._events[self.slot]
        if event is None:
            event = self._events[self.slot] = torch.cuda.Event()
        event.record(self.stream)


class SampledRing:
    """Pinned host slots the sampled token ids of a step are copied into, one per step in flight, each with its
    event (CUDA; made once and recorded again each time the slot is used: a slot is acquired again only after
    its tokens were read, i.e. after its last record was waited on).

    The copies are queued on the step's own stream, right after the sampler's kernels: stream order makes them
    read the finished ids, and the next step's kernels (which may reuse the freed device memory) run only after
    them, so no side stream, stream switch or held device reference is needed. The id copy is a few bytes a row;
    logprobs (rows x (k + 1) x 12 bytes) and prompt logprobs take the same path: they delay the next step's
    kernels by their copy time, against ~45 us of host work a step that a side stream costs (issue #14)."""

    def __init__(self, device: torch.device, max_rows: int, num_slots: int = 2) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.num_slots = num_slots
        self.buffers = [
            torch.empty(max(1, max_rows), dtype=torch.int64, pin_memory=self.cuda) for _ in range(num_slots)
        ]
        self.host_views = [b.numpy() for b in self.buffers]  # the same memory, read without a torch call
        self.events: list[Optional[torch.cuda.Event]] = [
            torch.cuda.Event() if self.cuda else None for _ in range(num_slots)
        ]
        self.in_use = [False] * num_slots
        self._heads: list[Optional[torch.Tensor]] = [None] * num_slots
        self._next = 0

    def acquire(self) -> int:
        slot = self._next
        if self.in_use[slot]:
            raise RuntimeError(
                "async scheduling: a third step was launched before the first one's tokens were read "
                "(at most two steps may be in flight)"
            )
        self.in_use[slot] = True
        self._next = (slot + 1) % self.num_slots
        return slot

    def release(self, slot: int) -> None:
        self.in_use[slot] = False

    def head(self, slot: int, n: int) -> torch.Tensor:
        """The slot's first n entries (the copy's destination), the view kept per slot while n stays the same (a
        slice is a torch call, microseconds of host time on CUDA)."""
        view = self._heads[slot]
        if view is None or len(view) != n:
            view = self._heads[slot] = self.buffers[slot][:n]
        return view
