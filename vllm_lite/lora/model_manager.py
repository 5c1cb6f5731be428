"""Adapters on one worker: the wrapped layers, ``max_loras`` device slots (LRU) and a host cache (LRU).

``LoRAModelManager.wrap`` replaces a loaded model's projections by `LoRALinear` wrappers. Adapters are read
from their PEFT directory into a host cache of ``max_cpu_loras`` (least recently used dropped; a dropped one
is read again from disk when a request needs it), already split for this rank and scaled. Each step
``prepare_step`` puts the batch's adapters in device slots (evicting the least recently used slot no request
of this step needs and nobody pinned) and builds the per-token slot index once, vectorised.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from typing import Optional

import numpy as np
import torch
from torch import nn

from vllm_lite.config import LoRAConfig
from vllm_lite.lora.layers import LoRALinear, LoRAState, SubProjection
from vllm_lite.lora.peft_adapter import load_adapter_tensors
from vllm_lite.lora.request import LoRARequest

# Our fused layer -> the HF projections inside it (shard ids as the model's loader names them).
_FUSED = {
    "qkv_proj": (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")),
    "gate_up_proj": (("gate_proj", 0), ("up_proj", 1)),
}
_ROW = {"o_proj", "down_proj"}
_LAYER = re.compile(r"^(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(qkv_proj|gate_up_proj|o_proj|down_proj)$")

# One adapter as a wrapped layer takes it: per (layer, wrapper name) the per-sub (A, B) pairs or None.
AdapterWeights = dict[tuple[int, str], list[Optional[tuple[torch.Tensor, torch.Tensor]]]]


def _subs_of(name: str, base: nn.Module) -> list[SubProjection]:
    if name in _FUSED:
        return [
            SubProjection(hf, base.shards[sid][0], base.shards[sid][1], base.src_start[sid]) for hf, sid in _FUSED[name]
        ]
    out = int(base.out_features)
    start = 0 if name in _ROW else int(getattr(base, "tp_rank", 0)) * out
    return [SubProjection(name, 0, out, start)]


class LoRAModelManager:
    def __init__(self, model: nn.Module, lora_config: LoRAConfig, device: torch.device) -> None:
        self.config = lora_config
        self.device = device
        self.max_loras = lora_config.max_loras
        self.max_rank = lora_config.max_lora_rank
        assert lora_config.max_cpu_loras is not None
        self.max_cpu_loras = lora_config.max_cpu_loras
        self.state = LoRAState()
        self.layers: dict[tuple[int, str], LoRALinear] = {}
        self._wrap(model)
        # Which adapter each slot holds; slots in least-recently-used order (first = evicted first).
        self.slot_ids: list[Optional[int]] = [None] * self.max_loras
        self._slot_lru: OrderedDict[int, int] = OrderedDict()  # lora id -> slot
        self.pinned: set[int] = set()
        self._host: OrderedDict[int, AdapterWeights] = OrderedDict()  # lora id -> weights, LRU order
        self.known: dict[int, LoRARequest] = {}  # where to (re)load each adapter from
        self.num_disk_loads = 0  # adapters read from disk (host-cache misses included), for tests and stats
        # This step's per-token slots on the host (None: no adapter runs), which CUDA graphs copy into their buffer.
        self.step_token_slots: Optional[np.ndarray] = None
        # The last step's (lora ids bytes, num_scheduled bytes) -> its token slots, while no slot or LRU change
        # happened since: a decode batch that stays the same (most steps) skips the grouping and slot lookups.
        self._last_step: Optional[tuple[bytes, bytes, np.ndarray]] = None

    # ------------------------------------------------------------------ wrapping
    def _wrap(self, model: nn.Module) -> None:
        found = []
        for name, module in model.named_modules():
            m = _LAYER.match(name)
            if m is not None and not isinstance(module, LoRALinear):
                found.append((name, module, int(m.group(1)), m.group(2)))
        if not found:
            raise ValueError(
                f"enable_lora: {type(model).__name__} has no q/k/v/o or gate/up/down projections to apply "
                "LoRA adapters to (Llama-family decoders only)."
            )
        for name, module, layer, kind in found:
            parent_name, attr = name.rsplit(".", 1)
            parent = model.get_submodule(parent_name)
            wrapper = LoRALinear(
                module, _subs_of(kind, module), kind in _ROW, self.state, self.max_loras, self.max_rank
            )
            setattr(parent, attr, wrapper)
            self.layers[(layer, kind)] = wrapper
        self._module_to_layer = {
            sub.module: kind for (_, kind), w in self.layers.items() for sub in w.subs
        }  # hf module name -> wrapper kind
        self.num_layers = 1 + max(layer for layer, _ in self.layers)

    # ------------------------------------------------------------------ host cache
    def _read(self, req: LoRARequest) -> AdapterWeights:
        """Read an adapter from disk, check it against the model and split it for this rank."""
        cfg, tensors = load_adapter_tensors(req.lora_path)
        self.num_disk_loads += 1
        out: AdapterWeights = {}
        dtype = next(iter(self.layers.values())).lora_a.dtype
        for (layer, module), ab in tensors.items():
            a, b = ab["A"], ab["B"]
            r = a.shape[0]
            if r > self.max_rank:
                raise ValueError(
                    f"lora_request: adapter {req.lora_name!r} has rank {r} in layer {layer} {module}, more than "
                    f"max_lora_rank={self.max_rank}."
                )
            kind = self._module_to_layer.get(module)
            wrapper = self.layers.get((layer, kind)) if kind is not None else None
            if wrapper is None:
                raise ValueError(
                    f"lora_request: adapter {req.lora_name!r} targets layer {layer} {module}, absent here."
                )
            i = [s.module for s in wrapper.subs].index(module)
            sub = wrapper.subs[i]
            full_in = wrapper.in_local * (wrapper.tp_size if wrapper.row_parallel else 1)
            if wrapper.row_parallel or wrapper.tp_size == 1:
                fits = b.shape[0] == sub.out_size
            else:  # this rank's rows of B must exist (KV heads may be replicated over ranks)
                fits = b.shape[0] >= sub.src_start + sub.out_size
            if a.shape[1] != full_in or not fits:
                raise ValueError(
                    f"lora_request: adapter {req.lora_name!r} layer {layer} {module} has shapes A {tuple(a.shape)}, "
                    f"B {tuple(b.shape)}, which do not fit the model's projection."
                )
            a_s, b_s = wrapper.shard(sub, a, b * cfg.scaling)
            pair = (a_s.to(dtype).contiguous(), b_s.to(dtype).contiguous())
            out.setdefault((layer, kind), [None] * len(wrapper.subs))[i] = pair  # type: ignore[index]
        return out

    def _weights(self, lora_id: int) -> AdapterWeights:
        w = self._host.get(lora_id)
        if w is not None:
            self._host.move_to_end(lora_id)
            return w
        req = self.known.get(lora_id)
        if req is None:
            raise ValueError(f"LoRA adapter id {lora_id} is not loaded and no request named its path.")
        w = self._read(req)
        self._host[lora_id] = w
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)
        return w

    def register(self, req: LoRARequest) -> None:
        """Remember where an adapter lives (a request carrying it joined the batch); read lazily."""
        known = self.known.get(req.lora_int_id)
        if known is not None and known.lora_path != req.lora_path:
            self._drop(req.lora_int_id)  # the same id now names other weights: forget the old ones
        self.known[req.lora_int_id] = req

    # ------------------------------------------------------------------ vLLM's worker API
    def add_lora(self, req: LoRARequest) -> bool:
        """Read an adapter into the host cache now; False if it was already there."""
        self.register(req)
        if req.lora_int_id in self._host:
            self._host.move_to_end(req.lora_int_id)
            return False
        self._weights(req.lora_int_id)
        return True

    def remove_lora(self, lora_id: int) -> bool:
        """Free the adapter's host copy and slot. Its path stays known: a request still running with it
        (another frontend's, or one already scheduled) reloads it at its next step instead of failing."""
        was = lora_id in self._host or lora_id in self._slot_lru
        self._drop(lora_id)
        return was

    def list_loras(self) -> set[int]:
        return set(self._host) | set(self._slot_lru)

    def pin_lora(self, lora_id: int) -> bool:
        """Keep an adapter in a device slot until removed (it is put in one now)."""
        if lora_id not in self.known and lora_id not in self._host:
            raise ValueError(f"pin_lora: LoRA adapter id {lora_id} is not loaded.")
        if len(self.pinned - {lora_id}) >= self.max_loras:
            raise ValueError(f"pin_lora: all {self.max_loras} slots are pinned already.")
        self._ensure_slots([lora_id])
        self.pinned.add(lora_id)
        return True

    def _drop(self, lora_id: int) -> None:
        self._last_step = None
        self._host.pop(lora_id, None)
        self.pinned.discard(lora_id)
        slot = self._slot_lru.pop(lora_id, None)
        if slot is not None:
            self.slot_ids[slot] = None
            for w in self.layers.values():
                w.clear_slot(slot)

    # ------------------------------------------------------------------ slots
    def _ensure_slots(self, lora_ids: list[int]) -> dict[int, int]:
        """Slots for these adapters (at most max_loras), loading and evicting least recently used as needed."""
        if len(lora_ids) > self.max_loras:
            raise ValueError(f"{len(lora_ids)} LoRA adapters in one step, more than max_loras={self.max_loras}.")
        self._last_step = None  # the LRU order (and maybe slots) change here
        needed = set(lora_ids)
        out: dict[int, int] = {}
        for lid in lora_ids:
            slot = self._slot_lru.get(lid)
            if slot is None:
                slot = self._free_slot(needed)
                self._load_slot(slot, lid)
            self._slot_lru.move_to_end(lid)
            out[lid] = slot
        return out

    def _free_slot(self, needed: set[int]) -> int:
        for slot, lid in enumerate(self.slot_ids):
            if lid is None:
                return slot
        # Least recently used first; a pinned adapter only when the step cannot run otherwise (the scheduler
        # admits max_loras adapters and knows nothing of pins), and it comes back when next needed.
        for spare_pinned in (False, True):
            for lid, slot in self._slot_lru.items():
                if lid not in needed and (spare_pinned or lid not in self.pinned):
                    del self._slot_lru[lid]
                    self.slot_ids[slot] = None
                    return slot
        raise ValueError(f"no LoRA slot free: max_loras={self.max_loras} slots hold adapters this step needs.")

    def _load_slot(self, slot: int, lora_id: int) -> None:
        weights = self._weights(lora_id)
        for key, wrapper in self.layers.items():
            pairs = weights.get(key)
            if pairs is None:
                wrapper.clear_slot(slot)
            else:
                wrapper.set_slot(
                    slot, [None if p is None else (p[0].to(self.device), p[1].to(self.device)) for p in pairs]
                )
        self.slot_ids[slot] = lora_id
        self._slot_lru[lora_id] = slot

    # ------------------------------------------------------------------ per step
    def prepare_step(self, req_lora_ids: np.ndarray, num_scheduled: np.ndarray) -> None:
        """Slots for this step's adapters and the per-token slot index ([T] int32, -1: none), built once."""
        self.state.kept_slots = None
        if len(req_lora_ids) == 0 or not req_lora_ids.any():
            self.state.set_host_slots(None, self.device)
            self.step_token_slots = None
            return
        key_ids = req_lora_ids.dtype.str + num_scheduled.dtype.str + str(len(req_lora_ids))
        key_ids, key_counts = key_ids.encode() + req_lora_ids.tobytes(), num_scheduled.tobytes()
        last = self._last_step
        if last is not None and last[0] == key_ids and last[1] == key_counts:
            # The same batch as the last step and nothing moved since: _ensure_slots would find every adapter in
            # its slot and move them to the LRU end in the same order, changing nothing.
            token_slots = last[2]
        else:
            uniq, inverse = np.unique(req_lora_ids, return_inverse=True)
            ids = [int(u) for u in uniq if u != 0]
            slots = self._ensure_slots(ids)
            slot_of_uniq = np.array([slots.get(int(u), -1) for u in uniq], dtype=np.int32)
            token_slots = np.repeat(slot_of_uniq[inverse.reshape(-1)], num_scheduled)
            self._last_step = (key_ids, key_counts, token_slots)
        self.step_token_slots = token_slots
        self.state.set_host_slots(token_slots, self.device)  # on the device when an eager forward first reads them

    def keep_rows(self, rows: Optional[np.ndarray]) -> None:
        """This step runs its last layer past attention on these token rows only (the runner's logits_rows):
        their slots, for the layers that see only them (None: every row goes on)."""
        if rows is None or self.step_token_slots is None:
            self.state.kept_slots = None
            return
        kept = np.ascontiguousarray(self.step_token_slots[rows])
        self.state.kept_slots = torch.from_numpy(kept).to(self.device, non_blocking=True)
