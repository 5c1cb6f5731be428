"""LoRA-wrapped linear layers: the model's projections after load, each with ``max_loras`` adapter slots.

As vLLM's ``from_layer``: a wrapper takes the place of a loaded projection and computes
``y = base(x) + B[slot[t]] @ A[slot[t]] @ x[t]`` for every token t of the step, batched over tokens
(``ops.add_lora``), where ``slot[t]`` comes from the model's shared `LoRAState` (-1: no adapter).

Slot tensors per layer: ``lora_a`` [max_loras, n_sub * max_rank, in] stacks the A matrices of the fused
sub-projections (q/k/v, or gate/up) so one shrink serves them all; ``lora_b[i]`` [max_loras, out_i, max_rank]
holds sub-projection i's B, which lands at its output offset in the fused output. Ranks below max_rank are
zero-padded, and the adapter's scale is folded into B. On CPU ``lora_bt`` [max_loras, max_rank, out] holds the
same B's transposed, each in its own output columns, for csrc's kernel (``torch_ops.add_lora``).

Tensor parallel: a column-parallel layer keeps A whole and this rank's rows of B (where its base weight's
rows come from); a row-parallel layer keeps this rank's columns of A and all of B, and its partial delta is
added before the all-reduce that sums the base layer's partial products, so the sum carries the whole delta.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch
from torch import nn

from vllm_lite.lora.ops import add_lora, set_step_slots
from vllm_lite.worker.models.cpu_prepack import linear
from vllm_lite.worker.parallel_state import tensor_model_parallel_all_reduce


class LoRAState:
    """Shared by every wrapped layer of one model: this step's per-token slot index (None: no adapter runs).

    ``LoRAModelManager.prepare_step`` hands over the step's slots on the host (``set_host_slots``); they become a
    device tensor (and the ops' declared step slots) when a layer first reads ``token_slots``. A step that replays
    a CUDA graph reads them from the graph's own slot buffer, so it makes no copy of its own to the device.
    """

    __slots__ = ("_token_slots", "_host", "kept_slots")

    def __init__(self) -> None:
        self._token_slots: Optional[torch.Tensor] = None
        self._host: Optional[tuple[np.ndarray, torch.device]] = None  # slots not yet on the device, and where to
        # The slots of the rows a step keeps past the last attention (the runner's logits_rows: the last layer's
        # o_proj and MLP run on those rows only, models/decoder.py); None: every row goes on.
        self.kept_slots: Optional[torch.Tensor] = None

    @property
    def token_slots(self) -> Optional[torch.Tensor]:
        host = self._host
        if host is not None:
            self._host = None
            self._token_slots = torch.from_numpy(host[0]).to(host[1], non_blocking=True)
            set_step_slots(self._token_slots)  # the step's segments / grouping, planned once for every layer
        return self._token_slots

    @token_slots.setter
    def token_slots(self, slots: Optional[torch.Tensor]) -> None:
        """These slots from now on (a captured graph's buffer, a test's tensor); the caller declares them."""
        self._host = None
        self._token_slots = slots

    def set_host_slots(self, slots: Optional[np.ndarray], device: torch.device) -> None:
        """This step's int32 slots on the host (None: no adapter), moved to ``device`` when first read."""
        self._token_slots = None
        self._host = None if slots is None else (slots, device)
        if slots is None:
            set_step_slots(None)


@dataclass(frozen=True)
class SubProjection:
    """One HF projection inside a (possibly fused) layer: its PEFT module name and where its rows sit."""

    module: str
    out_offset: int  # in this rank's fused output
    out_size: int  # this rank's rows
    src_start: int  # where this rank's rows start in the full projection


class LoRALinear(nn.Module):
    """A projection with adapter slots; attributes it lacks are the base layer's (``split``, ``num_heads``...)."""

    def __init__(
        self,
        base: nn.Module,
        subs: list[SubProjection],
        row_parallel: bool,
        state: LoRAState,
        max_loras: int,
        max_rank: int,
    ) -> None:
        super().__init__()
        self.base = base
        self.subs = subs
        self.row_parallel = row_parallel
        self.state = state
        self.max_rank = max_rank
        self.tp_rank = int(getattr(base, "tp_rank", 0))
        self.tp_size = int(getattr(base, "tp_size", 1))
        self.in_local = int(base.in_features)
        w = base.weight
        dtype, device = w.dtype, w.device
        self.register_buffer(
            "lora_a", torch.zeros((max_loras, len(subs) * max_rank, self.in_local), dtype=dtype, device=device)
        )
        self.lora_b = [torch.zeros((max_loras, s.out_size, max_rank), dtype=dtype, device=device) for s in subs]
        self._offsets = [s.out_offset for s in subs]
        # On CPU, every sub's B again, transposed into its output columns: [max_loras, max_rank, out]; csrc's
        # kernel (torch_ops.add_lora) reads it along output columns. Not kept on CUDA (Triton reads lora_b).
        out = max(s.out_offset + s.out_size for s in subs)
        self.lora_bt: Optional[torch.Tensor] = (
            torch.zeros((max_loras, max_rank, out), dtype=dtype, device=device) if device.type == "cpu" else None
        )

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["base"], name)

    # ------------------------------------------------------------------ slots
    def set_slot(self, slot: int, weights: list[Optional[tuple[torch.Tensor, torch.Tensor]]]) -> None:
        """Write one adapter (per sub-projection: (A [r, in_local], B [out_i, r] scaled) or None) into a slot."""
        self.lora_a[slot].zero_()
        for i, ab in enumerate(weights):
            self.lora_b[i][slot].zero_()
            if ab is None:
                continue
            a, b = ab
            r = a.shape[0]
            self.lora_a[slot, i * self.max_rank : i * self.max_rank + r].copy_(a)
            self.lora_b[i][slot, :, :r].copy_(b)
        if self.lora_bt is not None:
            self.lora_bt[slot].zero_()
            for i, sub in enumerate(self.subs):
                self.lora_bt[slot, :, sub.out_offset : sub.out_offset + sub.out_size].copy_(self.lora_b[i][slot].t())

    def clear_slot(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        for b in self.lora_b:
            b[slot].zero_()
        if self.lora_bt is not None:
            self.lora_bt[slot].zero_()

    def shard(self, sub: SubProjection, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of a full adapter pair, as the base weight is split (see the module docstring)."""
        if self.row_parallel:
            return a[:, self.tp_rank * self.in_local : (self.tp_rank + 1) * self.in_local], b
        return a, b[sub.src_start : sub.src_start + sub.out_size]

    # ------------------------------------------------------------------ forward
    def _add_delta(self, y: torch.Tensor, x: torch.Tensor, slots: torch.Tensor) -> None:
        add_lora(y, x, self.lora_a, self.lora_b, self._offsets, slots, self.lora_bt)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        slots = self.state.token_slots
        if slots is None:
            return self.base(x)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.shape[0] != slots.shape[0] and self.state.kept_slots is not None:
            slots = self.state.kept_slots  # past the last attention, on the kept rows only
        if self.row_parallel and self.tp_size > 1:
            y = linear(x2, self.base, None)
            self._add_delta(y, x2, slots)
            y = tensor_model_parallel_all_reduce(y)
            if self.base.bias is not None:
                y = y + self.base.bias
        else:
            y = self.base(x2)
            self._add_delta(y, x2, slots)
        return y.view(*shape[:-1], y.shape[-1])

    def _apply(self, fn: Any, recurse: bool = True) -> "LoRALinear":
        super()._apply(fn, recurse)
        self.lora_b = [fn(b) for b in self.lora_b]
        if self.lora_bt is not None:
            bt = fn(self.lora_bt)
            self.lora_bt = bt if bt.device.type == "cpu" else None
        return self
