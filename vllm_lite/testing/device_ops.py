"""Count what a piece of host code would ask of a GPU, on CPU: ATen ops (each one a kernel launch, or at least
~5-10 us of host dispatch, on CUDA), host syncs, and host-to-device copies.

On a GPU a small step is bound by host work: every eager op outside a CUDA graph costs host time, and every
sync (``.item()``, ``.tolist()``, ``.cpu()``, ``.numpy()``, ``bool(t)``, ``int(t)``, ``nonzero``, a boolean
mask index) waits for the device. Those counts do not depend on the device, so a CPU test can pin them.

    with DeviceOpCounter() as c:
        with c.paused():          # e.g. the model forward, which a CUDA graph replays as one launch
            ...
    c.num_ops, c.syncs, c.h2d

Tensors produced by ATen ops inside the counter stand for device tensors; a sync is a host read of one of them
(tensors made by ``torch.from_numpy`` / ``torch.tensor`` are host data: reading them is free), plus the ATen ops
whose output size depends on device data (nonzero and friends, bool-mask indexing). ``h2d`` counts ``.to()``
calls that move a host tensor (one not produced inside the counter) with an explicit device argument, i.e. the
copies a runner makes with ``.to(self.device)``, which on CPU are no-ops invisible to ATen.
"""

from __future__ import annotations

import contextlib
import traceback
import weakref
from collections import Counter
from typing import Any, Callable, Iterator, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# ATen ops whose output size depends on tensor values: on CUDA they copy a count back to the host.
SYNC_OPS = frozenset({"aten.nonzero.default", "aten.masked_select.default", "aten._unique2.default"})
# Ops that make a view or an alias: host dispatch only, no kernel.
VIEW_OPS = frozenset(
    f"aten.{n}"
    for n in (
        "slice.Tensor", "view.default", "select.int", "unsqueeze.default", "squeeze.dim", "expand.default",
        "alias.default", "t.default", "transpose.int", "permute.default", "as_strided.default", "_unsafe_view.default",
        "detach.default", "reshape.default", "squeeze.default",
    )
)  # fmt: skip
# Host reads of a device tensor (patched on torch.Tensor while counting).
_READS = ("item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__")


class DeviceOpCounter(TorchDispatchMode):
    """ATen ops (by name), host syncs and host-to-device copies made inside the ``with`` block."""

    def __init__(self, where: bool = False) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.syncs: list[str] = []
        self.h2d = 0
        self._where = where  # record the caller's line of each sync (debugging)
        self._device: dict[int, "weakref.ref[torch.Tensor]"] = {}  # id -> ref (a WeakSet would compare by ==)
        self._paused = 0
        self._saved: dict[str, Callable[..., Any]] = {}

    @property
    def num_ops(self) -> int:
        return sum(self.ops.values())

    @property
    def num_kernels(self) -> int:
        """Ops that are not views (on CUDA, roughly the kernels launched; copies from the host included)."""
        return sum(n for name, n in self.ops.items() if name not in VIEW_OPS)

    @property
    def num_syncs(self) -> int:
        return len(self.syncs)

    def reset(self) -> None:
        self.ops.clear()
        self.syncs.clear()
        self.h2d = 0

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Nothing inside is counted (its results still count as device tensors)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def is_device(self, t: torch.Tensor) -> bool:
        ref = self._device.get(id(t))
        return ref is not None and ref() is t

    def _sync(self, what: str) -> None:
        if self._where:
            frames = [f for f in traceback.extract_stack() if "/torch/" not in f.filename and __file__ != f.filename]
            if frames:
                what = f"{what} at {frames[-1].filename.rsplit('/', 2)[-1]}:{frames[-1].lineno}"
        self.syncs.append(what)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.lift_fresh.default:  # torch.from_numpy / torch.tensor under a mode: host data
            return out
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self._device[id(t)] = weakref.ref(t)
        if not self._paused:
            name = str(func)
            self.ops[name] += 1
            if name in SYNC_OPS or (
                name == "aten.index.Tensor"
                and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])
            ):
                self._sync(name)
        return out

    def _patch(self) -> None:
        counter = self

        def reader(name: str, orig: Callable[..., Any]) -> Callable[..., Any]:
            def read(t: torch.Tensor, *a: Any, **k: Any) -> Any:
                if not counter._paused and counter.is_device(t):
                    counter._sync(f"Tensor.{name}")
                with counter.paused():  # the read's own ATen calls (item -> _local_scalar_dense) are the sync
                    out = orig(t, *a, **k)
                if isinstance(out, torch.Tensor):  # .cpu(): host data now (on CPU the same object: untrack it)
                    counter._device.pop(id(out), None)
                return out

            return read

        def to(t: torch.Tensor, *a: Any, **k: Any) -> Any:
            moves = "device" in k or any(isinstance(x, (torch.device, str)) for x in a)
            if moves and not counter._paused and not counter.is_device(t):
                counter.h2d += 1
            return counter._saved["to"](t, *a, **k)

        for name in _READS:
            self._saved[name] = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, reader(name, self._saved[name]))
        self._saved["to"] = torch.Tensor.to
        torch.Tensor.to = to  # type: ignore[method-assign]

    def _unpatch(self) -> None:
        for name, orig in self._saved.items():
            setattr(torch.Tensor, name, orig)
        self._saved.clear()

    def __enter__(self) -> "DeviceOpCounter":
        self._patch()
        try:
            return super().__enter__()
        except BaseException:
            self._unpatch()
            raise

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._unpatch()

    def summary(self) -> dict[str, Any]:
        return {"ops": self.num_ops, "kernels": self.num_kernels, "syncs": self.num_syncs, "h2d": self.h2d}


# ---------------------------------------------------------------------------------------------- runner steps
class StandInGraph:
    """A stand-in for a captured graph on CPU: replay runs the same forward eagerly into the graph's output, and
    notes its key in ``replays`` when given one (tests count which graphs a step replayed)."""

    def __init__(self, graphs: Any, key: tuple[int, int], replays: Optional[list] = None) -> None:
        self.graphs, self.key, self.replays = graphs, key, replays

    def replay(self) -> None:
        if self.replays is not None:
            self.replays.append(self.key)
        self.graphs.outputs[self.key] = self.graphs._forward(self.key)


def install_stand_in_graphs(
    runner: Any, keys: list[tuple[int, int]], lora: bool = False, replays: Optional[list] = None
) -> Any:
    """Give a CPU runner CUDA-graph stand-ins for `keys` (batch, q): its uniform steps take the replay path the GPU
    takes (persistent-buffer copies, one 'replay'), which `count_steps` counts like the GPU's (forward excluded).
    Returns the runner's new CudaDecodeGraphs; each replay's key is appended to ``replays`` when given."""
    from vllm_lite.worker.cuda_graphs import CudaDecodeGraphs

    g = CudaDecodeGraphs(
        runner.model,
        runner.backend,
        runner.device,
        [b for b, q in keys if q == 1],
        runner.block_size,
        runner.max_blocks_per_req,
        runner.max_model_len,
        keys=keys,
        lora_state=runner.lora_manager.state if lora else None,
    )
    for key in g.keys:
        g.graphs[key] = StandInGraph(g, key, replays)  # type: ignore[assignment]
    runner.cuda_graphs = g
    return g


class StepRecord:
    """One execute_model call: its kind, batch size, counts outside the model forward, host seconds outside it."""

    def __init__(self, kind: str, batch: int, counter: DeviceOpCounter, host_s: float) -> None:
        self.kind, self.batch, self.host_s = kind, batch, host_s
        self.num_ops, self.syncs, self.h2d = counter.num_ops, list(counter.syncs), counter.h2d
        self.num_kernels = counter.num_kernels
        self.ops = Counter(counter.ops)

    def __repr__(self) -> str:
        return f"StepRecord({self.kind}, b={self.batch}, ops={self.num_ops}, kernels={self.num_kernels}, syncs={len(self.syncs)}, h2d={self.h2d})"


def step_kind(so: Any) -> str:
    if so.scheduled_spec_decode_tokens:
        return "verify"
    if any(n > 1 for n in so.num_scheduled_tokens.values()):
        return "prefill"
    return "decode"


@contextlib.contextmanager
def count_steps(runner: Any, where: bool = False) -> Iterator[list[StepRecord]]:
    """Record every execute_model call of `runner` while inside: ATen ops, syncs and h2d copies of the step with
    the model's forward (a graph replay on CUDA) left out, and its host seconds without the forward."""
    import time

    records: list[StepRecord] = []
    model = runner.model
    orig_exec, orig_forward = runner.execute_model, model.forward
    state: dict[str, Any] = {}

    def forward(*a: Any, **k: Any) -> Any:
        c = state.get("counter")
        if c is None:
            return orig_forward(*a, **k)
        t0 = time.perf_counter()
        with c.paused():
            out = orig_forward(*a, **k)
        state["forward_s"] += time.perf_counter() - t0
        return out

    def execute_model(so: Any) -> Any:
        state["forward_s"] = 0.0
        with DeviceOpCounter(where=where) as c:
            state["counter"] = c
            t0 = time.perf_counter()
            try:
                out = orig_exec(so)
            finally:
                state["counter"] = None
            host = time.perf_counter() - t0 - state["forward_s"]
        if so.total_num_scheduled_tokens:
            records.append(StepRecord(step_kind(so), len(so.num_scheduled_tokens), c, host))
        return out

    runner.execute_model, model.forward = execute_model, forward
    try:
        yield records
    finally:
        del runner.execute_model, model.forward
