"""LoRA-wrapped layers under tensor parallelism, ranks emulated in one process (no model, no collectives).

A column-parallel layer (fused q/k/v, gate/up) keeps A whole and its rows of B, so each rank's output is its
slice of the full one; a row-parallel layer (o, down) keeps its columns of A, so the ranks' partial outputs,
delta included, sum to the full output (what the all-reduce does).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

from vllm_lite.config import LoRAConfig
from vllm_lite.lora.model_manager import LoRAModelManager
from vllm_lite.lora.request import LoRARequest
from vllm_lite.testing.lora_checkpoints import AdapterSpec, build_lora_adapter
from vllm_lite.worker import parallel_state
from vllm_lite.worker.models.parallel_linear import MergedLinear, QKVLinear, RowParallelLinear

HIDDEN, HEAD_DIM, HEADS, KV_HEADS, INTER = 16, 4, 4, 2, 24


@pytest.fixture(autouse=True)
def _reset_tp_state():
    yield
    parallel_state.set_tp_state_for_testing(0, 1)


class _Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv_proj = QKVLinear(HIDDEN, HEAD_DIM, HEADS, KV_HEADS, bias=False)
        self.o_proj = RowParallelLinear(HEADS * HEAD_DIM, HIDDEN, bias=False)


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(HIDDEN, [INTER, INTER], False, [0, 1])
        self.down_proj = RowParallelLinear(INTER, HIDDEN, bias=False)


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn = _Attn()
        self.mlp = _MLP()


class _Model(nn.Module):
    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Layer()])
        attn, mlp = self.layers[0].self_attn, self.layers[0].mlp
        for sid in "qkv":
            attn.qkv_proj.weight_loader(attn.qkv_proj.weight, weights[sid], sid)
        attn.o_proj.load_weight(attn.o_proj.weight, weights["o"])
        mlp.gate_up_proj.weight_loader(mlp.gate_up_proj.weight, weights["gate"], 0)
        mlp.gate_up_proj.weight_loader(mlp.gate_up_proj.weight, weights["up"], 1)
        mlp.down_proj.load_weight(mlp.down_proj.weight, weights["down"])


def _adapter(tmp_path) -> str:
    base = tmp_path / "base"
    base.mkdir()
    config = dict(
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        intermediate_size=INTER,
        num_hidden_layers=1,
    )
    (base / "config.json").write_text(json.dumps(config))
    return build_lora_adapter(str(base), str(tmp_path / "adapter"), AdapterSpec(r=4, lora_alpha=6, seed=5))


def _wrapped(weights, adapter: str, rank: int, tp: int) -> tuple[_Model, LoRAModelManager]:
    parallel_state.set_tp_state_for_testing(rank, tp)
    model = _Model(weights)
    manager = LoRAModelManager(model, LoRAConfig(max_loras=2, max_lora_rank=8), torch.device("cpu"))
    manager.add_lora(LoRARequest("a", 1, adapter))
    return model, manager


# Every wrapped projection's base weight shape [out, in] in the test model.
BASE_SHAPES = dict(
    q=(HEADS * HEAD_DIM, HIDDEN),
    k=(KV_HEADS * HEAD_DIM, HIDDEN),
    v=(KV_HEADS * HEAD_DIM, HIDDEN),
    o=(HIDDEN, HEADS * HEAD_DIM),
    gate=(INTER, HIDDEN),
    up=(INTER, HIDDEN),
    down=(HIDDEN, INTER),
)


def _base_weights(g: torch.Generator) -> dict[str, torch.Tensor]:
    """Random float32 base weights of the seven wrapped projections, drawn from g in BASE_SHAPES' order."""
    return {k: torch.randn(s, generator=g) for k, s in BASE_SHAPES.items()}


def test_tp2_shards_sum_to_the_unsharded_lora_layers(tmp_path) -> None:
    g = torch.Generator().manual_seed(0)

    weights = _base_weights(g)
    adapter = _adapter(tmp_path)
    lora_ids, num_scheduled = np.array([1, 0]), np.array([3, 2])  # 3 tokens with the adapter, 2 without
    x = torch.randn(5, HIDDEN, generator=g)
    h_attn = torch.randn(5, HEADS * HEAD_DIM, generator=g)
    h_mlp = torch.randn(5, INTER, generator=g)

    full, manager = _wrapped(weights, adapter, 0, 1)
    manager.prepare_step(lora_ids, num_scheduled)
    layer = full.layers[0]
    want_q, want_k, want_v = layer.self_attn.qkv_proj.split(layer.self_attn.qkv_proj(x))
    want_o = layer.self_attn.o_proj(h_attn)
    want_gate_up = layer.mlp.gate_up_proj(x).view(5, 2, INTER)
    want_down = layer.mlp.down_proj(h_mlp)
    assert not torch.allclose(want_o[:3], nn.functional.linear(h_attn[:3], weights["o"]))  # the adapter acts
    torch.testing.assert_close(want_o[3:], nn.functional.linear(h_attn[3:], weights["o"]))  # and only on its tokens

    o_sum, down_sum = torch.zeros_like(want_o), torch.zeros_like(want_down)
    for rank in range(2):
        model, manager = _wrapped(weights, adapter, rank, 2)
        manager.prepare_step(lora_ids, num_scheduled)
        attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
        q, k, v = attn.qkv_proj.split(attn.qkv_proj(x))
        qs, kvs = HEADS * HEAD_DIM // 2, KV_HEADS * HEAD_DIM // 2
        torch.testing.assert_close(q, want_q[:, rank * qs : (rank + 1) * qs])
        torch.testing.assert_close(k, want_k[:, rank * kvs : (rank + 1) * kvs])
        torch.testing.assert_close(v, want_v[:, rank * kvs : (rank + 1) * kvs])
        half = INTER // 2
        torch.testing.assert_close(
            mlp.gate_up_proj(x).view(5, 2, half), want_gate_up[:, :, rank * half : (rank + 1) * half]
        )
        slots = manager.state.token_slots
        for wrapper, h, total in ((attn.o_proj, h_attn, o_sum), (mlp.down_proj, h_mlp, down_sum)):
            part = h[:, rank * wrapper.in_local : (rank + 1) * wrapper.in_local]
            y = nn.functional.linear(part, wrapper.base.weight)  # this rank's partial product
            wrapper._add_delta(y, part, slots)
            total += y
    torch.testing.assert_close(o_sum, want_o)
    torch.testing.assert_close(down_sum, want_down)


def test_slots_evict_least_recently_used_and_pinned_stay(tmp_path) -> None:
    g = torch.Generator().manual_seed(1)
    weights = _base_weights(g)
    adapter = _adapter(tmp_path)
    _, manager = _wrapped(weights, adapter, 0, 1)
    for lid in (2, 3):
        manager.register(LoRARequest(f"a{lid}", lid, adapter))
    one = np.array([1])
    manager.prepare_step(np.array([1, 2]), np.array([1, 1]))
    assert set(manager.slot_ids) == {1, 2}
    manager.prepare_step(np.array([2]), one)  # 1 is now the least recently used
    manager.prepare_step(np.array([3]), one)
    assert set(manager.slot_ids) == {2, 3}
    manager.pin_lora(2)
    manager.prepare_step(np.array([1]), one)  # 3 goes, pinned 2 stays
    assert set(manager.slot_ids) == {1, 2}
    manager.prepare_step(np.array([1, 3]), np.array([1, 1]))  # a step that needs both slots: the pin yields
    assert set(manager.slot_ids) == {1, 3}
    with pytest.raises(ValueError, match="max_loras"):
        manager.prepare_step(np.array([1, 2, 3]), np.array([1, 1, 1]))


def test_cpu_kernel_and_bmm_segments_agree_in_every_wrapped_layer(tmp_path, monkeypatch) -> None:
    """The CPU layers keep B transposed (lora_bt) for csrc's kernel: it must mirror lora_b through loads and
    removals, and the kernel's delta must equal the segments' one (torch only) in every projection."""
    from vllm_lite.lora import torch_ops

    if torch_ops.kernel_op() is None:
        pytest.skip("vllm-lite's CPU kernels (lora_add_cpu) are not built here")
    g = torch.Generator().manual_seed(2)

    adapter = _adapter(tmp_path)
    model, manager = _wrapped({k: torch.randn(s, generator=g) for k, s in BASE_SHAPES.items()}, adapter, 0, 1)
    manager.prepare_step(np.array([1, 0]), np.array([3, 2]))
    (slot,) = [s for s, lid in enumerate(manager.slot_ids) if lid == 1]
    calls = []
    real = torch_ops.kernel_op()
    for wrapper in manager.layers.values():
        for i, sub in enumerate(wrapper.subs):
            mirror = wrapper.lora_bt[:, :, sub.out_offset : sub.out_offset + sub.out_size]
            torch.testing.assert_close(mirror, wrapper.lora_b[i].transpose(1, 2), rtol=0, atol=0)
        assert wrapper.lora_bt[slot].abs().sum() > 0
        x = torch.randn(5, wrapper.in_local, generator=g)
        monkeypatch.setattr(torch_ops, "_KERNEL", [lambda *a: (calls.append(1), real(*a))])
        with_kernel = wrapper(x)
        monkeypatch.setattr(torch_ops, "_KERNEL", [None])
        segments = wrapper(x)
        torch.testing.assert_close(with_kernel, segments)
    assert len(calls) == len(manager.layers)
    manager.remove_lora(1)
    for wrapper in manager.layers.values():
        assert not wrapper.lora_bt[slot].any()


def test_kept_rows_take_their_own_slots() -> None:
    """Past the last attention a step may keep only its sampling rows (the runner's logits_rows): a layer that
    sees those rows alone must give each its own adapter's delta (state.kept_slots), as on the full step."""
    from vllm_lite.lora.layers import LoRALinear, LoRAState, SubProjection

    g = torch.Generator().manual_seed(5)
    k, out, r, slots_n = 16, 12, 4, 3
    base = nn.Linear(k, out, bias=False)
    state = LoRAState()
    layer = LoRALinear(base, [SubProjection("p", 0, out, 0)], False, state, slots_n, r)
    for s in range(slots_n):
        layer.set_slot(s, [(torch.randn(r, k, generator=g), torch.randn(out, r, generator=g))])
    x = torch.randn(10, k, generator=g)
    token_slots = torch.tensor([0, 0, 0, 1, 1, -1, 2, 2, 2, 2], dtype=torch.int32)
    state.token_slots = token_slots
    full = layer(x)
    rows = torch.tensor([2, 4, 5, 9])
    state.kept_slots = token_slots[rows].contiguous()
    torch.testing.assert_close(layer(x[rows]), full[rows])
    assert not torch.allclose(layer(x[rows]), base(x[rows]))  # the deltas are there


def test_step_slots_reach_the_device_only_when_a_layer_reads_them(tmp_path, monkeypatch) -> None:
    """prepare_step keeps the step's slots on the host (a replayed CUDA graph copies them into its own buffer);
    the first read by a layer makes the tensor and declares it to the ops once; the next step starts over."""
    from vllm_lite.lora import layers

    g = torch.Generator().manual_seed(2)
    weights = _base_weights(g)
    model, manager = _wrapped(weights, _adapter(tmp_path), 0, 1)
    declared: list = []
    real = layers.set_step_slots
    monkeypatch.setattr(layers, "set_step_slots", lambda t: (declared.append(t), real(t)))
    made: list = []
    from_numpy = torch.from_numpy
    monkeypatch.setattr(torch, "from_numpy", lambda a: (made.append(len(a)), from_numpy(a))[1])
    manager.prepare_step(np.array([1, 0]), np.array([2, 3]))
    assert made == [] and declared == []  # nothing on the device yet
    x = torch.randn(5, HIDDEN, generator=g)
    model.layers[0].self_attn.qkv_proj(x)
    model.layers[0].mlp.gate_up_proj(x)
    slots = manager.state.token_slots
    assert made == [5] and len(declared) == 1 and declared[0] is slots
    assert slots.tolist() == [manager.slot_ids.index(1)] * 2 + [-1] * 3
    manager.prepare_step(np.array([0]), np.array([4]))  # no adapter: None, declared as such
    assert manager.state.token_slots is None and declared[-1] is None and made == [5]
    manager.state.token_slots = slots  # a captured graph's buffer (set directly)
    manager.prepare_step(np.array([1]), np.array([1]))
    assert manager.state.token_slots.tolist() == [manager.slot_ids.index(1)] and made == [5, 1]


def test_a_repeated_step_reuses_its_slots_until_adapters_move(tmp_path) -> None:
    """The same batch twice gives the same slots without regrouping; removing, pinning or another step's eviction
    in between makes the next step look its adapters up again (and reload a removed one)."""
    g = torch.Generator().manual_seed(4)
    weights = _base_weights(g)
    adapter = _adapter(tmp_path)
    _, manager = _wrapped(weights, adapter, 0, 1)
    for lid in (2, 3):
        manager.register(LoRARequest(f"a{lid}", lid, adapter))
    ids, counts = np.array([1, 0, 2]), np.array([1, 1, 1])
    manager.prepare_step(ids, counts)
    first = manager.step_token_slots.tolist()
    manager.prepare_step(ids.copy(), counts.copy())
    assert manager.step_token_slots.tolist() == first
    manager.remove_lora(1)
    manager.prepare_step(ids, counts)  # must put adapter 1 back in a slot
    assert 1 in manager.slot_ids and manager.step_token_slots.tolist() == [
        manager.slot_ids.index(1),
        -1,
        manager.slot_ids.index(2),
    ]
    manager.prepare_step(np.array([3]), np.array([1]))  # evicts the least recently used of 1 and 2 (slots: 2)
    manager.prepare_step(ids, counts)
    assert {1, 2} <= set(manager.slot_ids)
    assert manager.step_token_slots.tolist() == [manager.slot_ids.index(1), -1, manager.slot_ids.index(2)]
    manager.prepare_step(ids, counts.astype(np.int32))  # other dtypes, same values: looked up again, same slots
    assert manager.step_token_slots.tolist() == [manager.slot_ids.index(1), -1, manager.slot_ids.index(2)]
    manager.pin_lora(3)  # takes a slot from 1 or 2 (max_loras 2) between two identical steps
    manager.prepare_step(ids, counts.astype(np.int32))
    assert {1, 2} <= set(manager.slot_ids)
    assert manager.step_token_slots.tolist() == [manager.slot_ids.index(1), -1, manager.slot_ids.index(2)]
