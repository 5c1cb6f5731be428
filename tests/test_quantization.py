"""AWQ/GPTQ int4: the packing as published, loading into our layers bit for bit, TP shards, memory, refusals.

Engine-level token checks live in test_quantization_e2e.py; here everything runs on loaded models in-process.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from vllm_lite.engine_args import EngineArgs
from vllm_lite.quantization import dequantize_awq, dequantize_gptq
from vllm_lite.quantization.int4_linear import SMALL_M_MAX, dequantize_nk, quantized_weight_bytes
from vllm_lite.quantization.packing import AWQ_ORDER, pack_cols, pack_rows, unpack_cols, unpack_rows
from vllm_lite.testing.checkpoints import CACHE_VERSION, cached_build, get_checkpoint
from vllm_lite.testing.quantize import dequantize_checkpoint_tensors, quantize_checkpoint
from vllm_lite.worker import parallel_state
from vllm_lite.worker.model_loader import load_model

# Our fused layers and the checkpoint projections stacked in them, in order.
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
ROW_PARALLEL = ("o_proj", "down_proj")


def _wide_llama() -> str:
    """Tiny llama whose every input size (128, 256) holds whole groups of 128 (the tiny one's tokenizer)."""
    return cached_build(f"{CACHE_VERSION}-llama-wide128", _build_wide_llama)


def _build_wide_llama(path: str) -> None:
    import shutil

    import transformers

    src = get_checkpoint("llama")
    config = transformers.AutoConfig.from_pretrained(src)
    config.update({"hidden_size": 128, "intermediate_size": 256, "head_dim": 32})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.2 * noise if p.dim() == 1 else 0.1 * noise)
    model.save_pretrained(path, safe_serialization=True)
    for f in os.listdir(src):
        if f.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(os.path.join(src, f), os.path.join(path, f))


def _quantized(name: str, src: str, method: str, **kwargs: Any) -> str:
    return cached_build(f"{CACHE_VERSION}-int4-{name}", lambda tmp: quantize_checkpoint(src, tmp, method, **kwargs))


CASES = {
    "awq-g32": ("llama", "awq", dict(group_size=32)),
    "awq-g128": ("wide", "awq", dict(group_size=128)),
    "gptq-g32-sym": ("llama", "gptq", dict(group_size=32, desc_act=False, sym=True)),
    "gptq-g32-actorder-asym": ("llama", "gptq", dict(group_size=32, desc_act=True, sym=False)),
    "gptq-g128-actorder-sym": ("wide", "gptq", dict(group_size=128, desc_act=True, sym=True)),
    "gptq-g128-asym": ("wide", "gptq", dict(group_size=128, desc_act=False, sym=False)),
    "gptq_v2-g32-actorder": ("llama", "gptq", dict(group_size=32, desc_act=True, checkpoint_format="gptq_v2")),
}


def _case_dir(case: str) -> str:
    base, method, kwargs = CASES[case]
    src = _wide_llama() if base == "wide" else get_checkpoint(base)
    return _quantized(case, src, method, **kwargs)


def _load(path: str, rank: int = 0, size: int = 1) -> torch.nn.Module:
    mc = EngineArgs(model=path, device="cpu", dtype="float32").create_engine_config().model_config
    parallel_state.set_tp_state_for_testing(rank, size)
    try:
        return load_model(mc, torch.device("cpu"))
    finally:
        parallel_state.set_tp_state_for_testing(0, 1)


def _int4_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {n: m for n, m in model.named_modules() if getattr(m, "quant_method", None) is not None}


def _reference(ref: dict[str, torch.Tensor], name: str, rank: int = 0, size: int = 1) -> torch.Tensor:
    """This rank's [N, K] weight of our layer `name`, cut from the reference-dequantized projections."""
    prefix, ours = name.rsplit(".", 1)
    if ours in ROW_PARALLEL:
        w = ref[f"{name}.weight"]
        k = w.shape[1] // size
        return w[:, rank * k : (rank + 1) * k]
    parts = []
    for proj in FUSED.get(ours, (ours,)):
        w = ref[f"{prefix}.{proj}.weight"]
        n = w.shape[0] // size
        parts.append(w[rank * n : (rank + 1) * n])
    return torch.cat(parts)


# ---------------------------------------------------------------------------- the formats as published


def test_awq_words_hold_columns_in_autoawqs_interleaved_order():
    # Nibble i of the word holds value i: AutoAWQ's order puts nibble i at column AWQ_ORDER[i].
    word = torch.tensor([[0x76543210]], dtype=torch.int32)
    assert unpack_cols(word, AWQ_ORDER).tolist() == [[0, 4, 1, 5, 2, 6, 3, 7]]
    assert AWQ_ORDER == (0, 2, 4, 6, 1, 3, 5, 7)
    zeros = torch.tensor([[0x11111111]], dtype=torch.int32)  # zero 1 in every column
    scales = torch.full((1, 8), 0.5, dtype=torch.float16)
    w = dequantize_awq(word.expand(4, 1).contiguous(), zeros, scales, group_size=4)
    assert w.dtype == torch.float32 and w.shape == (4, 8)
    assert w[0].tolist() == [(v - 1) * 0.5 for v in (0, 4, 1, 5, 2, 6, 3, 7)]


def test_gptq_words_pack_input_rows_in_order_and_classic_zeros_are_stored_minus_one():
    qweight = torch.tensor([[0x76543210, -0x76543211]], dtype=torch.int32)  # second word: ~0x76543210
    assert unpack_rows(qweight)[:, 0].tolist() == list(range(8))
    assert unpack_rows(qweight)[:, 1].tolist() == [15 - v for v in range(8)]
    qzeros = torch.tensor([[0x00000007]], dtype=torch.int32)  # stored 7 in column 0, 0 elsewhere
    scales = torch.tensor([[2.0] * 8], dtype=torch.float16)
    qw = torch.cat([qweight, torch.zeros(1, 6, dtype=torch.int32)], dim=1)
    g_idx = torch.zeros(8, dtype=torch.int32)
    classic = dequantize_gptq(qw, qzeros, scales, g_idx)
    assert classic[:, 0].tolist() == [(v - 8) * 2.0 for v in range(8)]  # zero 7 + 1
    assert classic[:, 1].tolist() == [(15 - v - 1) * 2.0 for v in range(8)]  # stored 0 -> zero 1
    v2 = dequantize_gptq(qw, qzeros, scales, g_idx, checkpoint_format="gptq_v2")
    assert v2[:, 0].tolist() == [(v - 7) * 2.0 for v in range(8)]


def test_gptq_g_idx_picks_each_rows_group():
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (16, 8), generator=g)
    zeros = torch.randint(0, 15, (2, 8), generator=g)
    scales = torch.rand(2, 8, generator=g).to(torch.float16)
    g_idx = torch.randperm(16, generator=g) % 2
    w = dequantize_gptq(pack_rows(q), pack_cols(zeros), scales, g_idx.to(torch.int32))
    for k in range(16):  # element by element, from the format's definition
        gk = int(g_idx[k])
        want = (q[k] - (zeros[gk] + 1)).float() * scales[gk].float()
        assert torch.equal(w[k], want)


def test_packing_round_trips_and_refuses_out_of_range_values():
    v = torch.randint(0, 16, (16, 24))
    assert torch.equal(unpack_cols(pack_cols(v, AWQ_ORDER), AWQ_ORDER), v)
    assert torch.equal(unpack_rows(pack_rows(v)), v)
    with pytest.raises(ValueError, match=r"\[0, 15\]"):
        pack_cols(torch.full((1, 8), 16))
    with pytest.raises(TypeError, match="qweight"):
        dequantize_awq(v.float(), v, v.float(), 8)


@pytest.mark.parametrize("case", ["awq-g32", "gptq-g32-actorder-asym"])
def test_quantizer_output_dequantizes_close_to_the_float_weights(case):
    """Round-to-nearest with stored float16 scales: every weight within half a step of the original."""
    from safetensors.torch import load_file

    base = get_checkpoint(CASES[case][0])
    orig = load_file(os.path.join(base, "model.safetensors"))
    ref = dequantize_checkpoint_tensors(_case_dir(case))
    name = "model.layers.1.mlp.down_proj.weight"
    err = (ref[name] - orig[name].float()).abs().max()
    assert 0 < err < 0.1 * orig[name].abs().max()


def test_act_order_g_idx_is_a_permutation_map_shared_by_fused_projections():
    from safetensors.torch import load_file

    t = load_file(os.path.join(_case_dir("gptq-g32-actorder-asym"), "model.safetensors"))
    g_idx = t["model.layers.0.self_attn.q_proj.g_idx"]
    assert torch.bincount(g_idx.long()).tolist() == [32, 32]  # whole groups ...
    assert not torch.equal(g_idx, torch.arange(64, dtype=torch.int32) // 32)  # ... not in input order
    assert torch.equal(g_idx, t["model.layers.0.self_attn.k_proj.g_idx"])


# ---------------------------------------------------------------------------- our layers, bit for bit


@pytest.mark.parametrize("case", sorted(CASES))
def test_loaded_int4_layers_dequantize_to_the_reference_bit_for_bit(case):
    path = _case_dir(case)
    model = _load(path)
    ref = dequantize_checkpoint_tensors(path)
    layers = _int4_layers(model)
    assert len(layers) == 4 * 3  # qkv, o, gate_up, down in each of 3 layers
    # Past SMALL_M_MAX rows the forward is F.linear over exactly that weight; at decode sizes the direct
    # kernel sums the same weights in another order (tests/test_int4_cpu_kernel.py bounds it).
    x = torch.randn(SMALL_M_MAX + 1, next(iter(layers.values())).in_features)
    for name, layer in layers.items():
        want = _reference(ref, name)
        got = dequantize_nk(layer, torch.float32)
        assert torch.equal(got, want), name
        if layer.in_features == x.shape[1]:
            assert torch.equal(layer(x), F.linear(x, want, layer.bias)), name
            torch.testing.assert_close(layer(x[:3]), F.linear(x[:3], want, layer.bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["awq-g32", "gptq-g32-actorder-asym", "gptq-g32-sym"])
def test_tensor_parallel_ranks_hold_their_slices_of_the_int4_weights(case):
    """Column layers split N per fused projection, row layers split K in whole groups (act order: all groups)."""
    path = _case_dir(case)
    ref = dequantize_checkpoint_tensors(path)
    for rank in range(2):
        layers = _int4_layers(_load(path, rank, 2))
        for name, layer in layers.items():
            assert torch.equal(dequantize_nk(layer, torch.float32), _reference(ref, name, rank, 2)), (rank, name)


@pytest.mark.parametrize("case", ["awq-g128", "gptq-g128-asym"])
def test_resident_int4_weights_take_about_4_25_bits_each(case):
    model = _load(_case_dir(case))
    held, weights = quantized_weight_bytes(model)
    bits = 8 * held / weights
    assert 4.1 < bits < 4.3, bits
    for layer in _int4_layers(model).values():  # no float copy of the weight stays behind
        assert layer.weight.numel() == 0


@pytest.mark.parametrize("case", ["awq-g32", "gptq-g32-actorder-asym"])
def test_native_cpu_dequantization_equals_the_torch_ops_bit_for_bit(case):
    """csrc's int4_dequant_nk (plain groups; act-order g_idx) writes what the torch ops compute, both dtypes."""
    from vllm_lite.worker.model_loader import load_native_int4

    model = _load(_case_dir(case))
    assert load_native_int4(), "the CPU kernels (csrc/int4_cpu.cpp) must build here"
    for name, layer in _int4_layers(model).items():
        for dtype in (torch.float32, torch.bfloat16):
            want = dequantize_nk(layer, dtype, native=False).clone()
            assert torch.equal(dequantize_nk(layer, dtype), want), (name, dtype)


@pytest.mark.parametrize("case", ["awq-g32", "gptq-g32-sym", "gptq-g32-actorder-asym"])
def test_fused_kernel_path_passes_the_checkpoint_layout_as_the_triton_kernels_take_it(case, monkeypatch):
    """The CUDA path's wiring, on CPU: reference matmuls stand in for triton_int4's awq_gemm/gptq_gemm
    (same signatures); act order runs on rows sorted by group with x's columns gathered, as on CUDA."""
    from vllm_lite.quantization import int4_linear

    calls: list[str] = []

    def awq_gemm(x, qweight, qzeros, scales, group_size):
        calls.append("awq")
        return x @ dequantize_awq(qweight, qzeros, scales, group_size)

    def gptq_gemm(x, qweight, qzeros, scales, g_idx, bits=4, *, checkpoint_format="gptq", group_size=None):
        calls.append(f"gptq g_idx={'map' if g_idx is not None else 'plain'}")
        assert bits == 4 and (g_idx is None) == (group_size is not None)
        return x @ dequantize_gptq(qweight, qzeros, scales, g_idx, checkpoint_format)

    path = _case_dir(case)
    monkeypatch.setattr(int4_linear, "_kernels_for", lambda device: (awq_gemm, gptq_gemm))
    model = _load(path)
    ref = dequantize_checkpoint_tensors(path)
    x = torch.randn(3, 64)
    for name, layer in _int4_layers(model).items():
        if layer.in_features == 64:
            torch.testing.assert_close(layer(x), F.linear(x, _reference(ref, name), layer.bias))
    assert calls and (calls[0] == "awq" if case.startswith("awq") else set(calls) == {"gptq g_idx=plain"})


def test_bfloat16_compute_rounds_the_exact_float32_weights_once():
    model = _load(_case_dir("awq-g32"))
    layer = next(iter(_int4_layers(model).values()))
    want = dequantize_nk(layer, torch.float32).clone()
    assert torch.equal(dequantize_nk(layer, torch.bfloat16), want.to(torch.bfloat16))


# ---------------------------------------------------------------------------- refusals


def _with_config(tmp_path, src: str, **qc: Any) -> str:
    import json
    import shutil

    for f in os.listdir(src):
        shutil.copy(os.path.join(src, f), tmp_path / f)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"].update(qc)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


@pytest.mark.parametrize(
    "quantization, match",
    [
        ("fp8", r"quantization='fp8' is not supported.*awq, gptq"),
        ("gptq", r"quantization='gptq' contradicts the checkpoint.*'awq'"),
    ],
)
def test_a_method_we_lack_or_one_the_checkpoint_contradicts_is_a_value_error(quantization, match):
    with pytest.raises(ValueError, match=match):
        EngineArgs(model=_case_dir("awq-g32"), device="cpu", quantization=quantization).create_engine_config()


def test_quantization_is_read_from_the_checkpoint_and_agreeing_methods_pass():
    path = _case_dir("gptq-g32-actorder-asym")
    for quantization in (None, "gptq", "GPTQ"):
        mc = EngineArgs(model=path, device="cpu", quantization=quantization).create_engine_config().model_config
        assert mc.quantization == "gptq"
        assert (mc.quant_config.group_size, mc.quant_config.desc_act, mc.quant_config.sym) == (32, True, False)


@pytest.mark.parametrize(
    "qc, match",
    [
        ({"bits": 8}, "bits=8"),
        ({"version": "gemv"}, "version 'gemv'"),
        ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes'"),
        ({"modules_to_not_convert": ["mlp"]}, "modules_to_not_convert"),
    ],
)
def test_checkpoint_formats_we_lack_are_refused_naming_quantization(tmp_path, qc, match):
    path = _with_config(tmp_path, _case_dir("awq-g32"), **qc)
    with pytest.raises(ValueError, match=f"quantization.*{match}"):
        EngineArgs(model=path, device="cpu").create_engine_config()


def test_quantization_flag_on_the_command_line():
    import argparse

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = parser.parse_args(["--model", _case_dir("awq-g32"), "--quantization", "awq", "--device", "cpu"])
    assert EngineArgs.from_cli_args(args).create_engine_config().model_config.quantization == "awq"
