"""csrc's direct int4 kernel for decode-sized forwards (torch.ops.vllm_lite.int4_linear_small_m) and its dispatch.

The kernel sums the dequantized weights in another order than F.linear, so it is checked against a float64
product with the exactly dequantized weight: |y - ref| <= tol * sum_k |x_k w_nk| (+ |bias|), tol 2e-5 for
float32 activations (float32 rounding over up to a few hundred terms) and 8e-3 for bfloat16 ones (the output
is rounded to bfloat16). Shapes cover plain groups of whole 64-input blocks, groups that split a block,
groups that straddle blocks, K not a multiple of 64 (a scalar tail), odd N and row counts past one tile.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

import pytest
import torch
import torch.nn.functional as F

from vllm_lite.engine_args import EngineArgs
from vllm_lite.quantization import int4_linear
from vllm_lite.quantization.int4_linear import SMALL_M_MAX, dequantize_nk
from vllm_lite.quantization.packing import pack_cols
from vllm_lite.testing.quantize import get_quantized_checkpoint
from vllm_lite.worker.model_loader import load_model, load_native_int4

TOL = {torch.float32: 2e-5, torch.bfloat16: 8e-3}


@pytest.fixture(scope="module")
def op() -> Any:
    assert load_native_int4(), "the CPU kernels (csrc/int4_cpu.cpp) must build here"
    return torch.ops.vllm_lite.int4_linear_small_m


def _check(y: torch.Tensor, x: torch.Tensor, w64: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
    b = torch.zeros(w64.shape[0], dtype=torch.float64) if bias is None else bias.double()
    ref = x.double() @ w64.t() + b
    bound = TOL[x.dtype] * (x.double().abs() @ w64.abs().t() + b.abs()) + 1e-30
    assert y.dtype == x.dtype and y.shape == ref.shape
    err = (y.double() - ref).abs()
    assert bool((err <= bound).all()), f"max error / bound {(err / bound).max().item():.3g}"


# (N, K, group size): whole-block groups; a group of 32 splits each 64-input block; groups of 40 straddle
# blocks and K=200 leaves a 1-word tail; groups of 8 (one word); K=96 (a 4-word tail); N=13 (odd).
SHAPES = [(16, 256, 128), (24, 192, 64), (32, 128, 32), (13, 200, 40), (40, 64, 8), (24, 96, 32), (8, 768, 128)]


@pytest.mark.parametrize("n, k, group", SHAPES)
@pytest.mark.parametrize("scales_dtype", [torch.float16, torch.bfloat16])
def test_direct_kernel_matches_a_float64_product_with_the_dequantized_weight(op, n, k, group, scales_dtype):
    g = torch.Generator().manual_seed(n * k + group)
    groups = k // group
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
    z = torch.randint(0, 16, (n, groups), generator=g, dtype=torch.int32).to(torch.uint8)
    s = (0.001 + 0.02 * torch.rand(n, groups, generator=g)).to(scales_dtype)
    w64 = (q.double() - z.double().repeat_interleave(group, 1)) * s.double().repeat_interleave(group, 1)
    qw = pack_cols(q)
    for m in (1, 2, 3, 4, 7, 8, 9, 17):  # 9 and 17: more than one tile of 8 rows
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(m, k, generator=g).to(dtype)
            bias = torch.randn(n, generator=g).to(dtype) if m % 2 else None
            _check(op(x, qw, z, s, bias), x, w64, bias)


def _load(path: str) -> torch.nn.Module:
    mc = EngineArgs(model=path, device="cpu", dtype="float32").create_engine_config().model_config
    return load_model(mc, torch.device("cpu"))


@pytest.fixture(scope="module")
def models(op) -> dict[str, torch.nn.Module]:
    """Tiny int4 models as the engine loads them: AWQ and GPTQ (plain groups, and act order)."""
    return {
        "awq": _load(get_quantized_checkpoint("llama", "awq", group_size=32)),
        "gptq": _load(get_quantized_checkpoint("qwen2", "gptq", group_size=32, desc_act=False, sym=False)),
        "gptq-actorder": _load(get_quantized_checkpoint("qwen2", "gptq", group_size=32, desc_act=True, sym=False)),
    }


def _layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {n: m for n, m in model.named_modules() if getattr(m, "quant_method", None) is not None}


@pytest.fixture
def calls() -> Iterator[list[int]]:
    """Rows of every forward that reached the direct kernel (the real kernel still runs)."""
    seen: list[int] = []
    real = int4_linear._SMALL_M[0]
    assert real is not None

    def counting(x, *args):
        seen.append(x.shape[0])
        return real(x, *args)

    int4_linear._SMALL_M[0] = counting
    try:
        yield seen
    finally:
        int4_linear._SMALL_M[0] = real


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_decode_sized_forwards_run_the_direct_kernel_and_larger_ones_dequantize(models, calls, method):
    """<= SMALL_M_MAX rows: the direct kernel, close to the float64 reference; more: exactly F.linear over the
    dequantized weight (bit for bit, as before the kernel existed)."""
    for name, layer in _layers(models[method]).items():
        w = dequantize_nk(layer, torch.float32).clone()
        for m in (1, SMALL_M_MAX):
            x = torch.randn(2, m, layer.in_features)[0]  # a [m, K] view with a leading batch dim of one
            before = len(calls)
            y = layer(x.unsqueeze(0))
            assert calls[before:] == [m], name
            _check(y.squeeze(0), x, w.double(), layer.bias)
        x = torch.randn(SMALL_M_MAX + 1, layer.in_features)
        before = len(calls)
        assert torch.equal(layer(x), F.linear(x, w, layer.bias)), name
        assert calls[before:] == [], name


def test_act_order_layers_always_dequantize(models, calls):
    """A real g_idx (GPTQ desc_act) is not the kernel's plain groups: even one row goes through F.linear."""
    layers = _layers(models["gptq-actorder"])
    assert any(layer.g_idx_k is not None for layer in layers.values())
    for name, layer in layers.items():
        if layer.g_idx_k is None:
            continue
        x = torch.randn(1, layer.in_features)
        assert torch.equal(layer(x), F.linear(x, dequantize_nk(layer, torch.float32), layer.bias)), name
    assert not calls


def test_bfloat16_activations_come_back_bfloat16_and_close(models):
    layer = next(iter(_layers(models["awq"]).values()))
    x = torch.randn(3, layer.in_features).to(torch.bfloat16)
    bias = None if layer.bias is None else layer.bias.to(torch.bfloat16)
    y = int4_linear.small_m_linear(layer, x, bias)
    assert y is not None
    _check(y, x, dequantize_nk(layer, torch.float32).double(), bias)


def test_bad_inputs_are_refused_naming_the_argument(op):
    """Refused with the argument and its value in the message (formatted by csrc's msg(): the path that crashed
    the process on the H100 image while it went through c10::str), never a crash: K = 0 divided by zero."""
    q = pack_cols(torch.zeros(8, 64, dtype=torch.int32))
    z = torch.zeros(8, 2, dtype=torch.uint8)
    s = torch.ones(8, 2, dtype=torch.float16)
    with pytest.raises(RuntimeError, match=r"x must be \[M, 64\], got \[1, 32\]"):
        op(torch.zeros(1, 32), q, z, s, None)
    with pytest.raises(RuntimeError, match="x must be float32 or bfloat16, got Double"):
        op(torch.zeros(1, 64, dtype=torch.float64), q, z, s, None)
    with pytest.raises(RuntimeError, match=r"zeros must be a contiguous \[N, G\] uint8 tensor with N = 8, got Int"):
        op(torch.zeros(1, 64), q, z.to(torch.int32), s, None)
    with pytest.raises(RuntimeError, match=r"bias must be \[8\], got \[3\]"):
        op(torch.zeros(1, 64), q, z, s, torch.zeros(3))
    with pytest.raises(RuntimeError, match="scales must be float16, bfloat16 or float32, got Int"):
        op(torch.zeros(1, 64), q, z, s.to(torch.int32), None)
    with pytest.raises(RuntimeError, match="K > 0"):
        op(torch.zeros(1, 0), torch.zeros(8, 0, dtype=torch.int32), z, s, None)
    dequant = torch.ops.vllm_lite.int4_dequant_nk
    g_idx = torch.zeros(64, dtype=torch.int64)
    g_idx[5] = 2
    with pytest.raises(RuntimeError, match=r"g_idx values must lie in \[0, G = 2\), got \[0, 2\]"):
        dequant(torch.empty(8, 64), q, z, s, g_idx)
    with pytest.raises(RuntimeError, match=r"out must be a contiguous \[N, K\] = \[8, 64\] tensor, got \[8, 32\]"):
        dequant(torch.empty(8, 32), q, z, s, None)
