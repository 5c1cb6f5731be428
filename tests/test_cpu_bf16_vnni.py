"""The AVX512-BF16 broadcast GEMM for 13-64 rows (csrc/bf16_small_m.cpp, `bf16_linear_vnni`) and its use by
cpu_prepack.linear.

Where it is built (AVX512-BF16 CPUs): outputs within one bf16 rounding of a float64 reference and rounded to
nearest like F.linear's, for 1-64 rows (register blocks of 1-12, balanced passes), with and without bias, N
several weight blocks; the same bits at 1 and 2 threads and whatever rows come with a row (bf16 greedy decoding
stays batch-independent); bad shapes raise before any data is read; the prepacked model sends 13-64 rows there
and more to oneDNN. Everywhere: no third weight copy where the kernels are absent or turned off.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllm_lite.engine_args import EngineArgs
from vllm_lite.testing.bf16_bounds import linear_reference_and_bound
from vllm_lite.testing.checkpoints import get_checkpoint
from vllm_lite.worker.model_loader import load_model
from vllm_lite.worker.models import cpu_prepack

CPU = torch.device("cpu")
needs_kernel = pytest.mark.skipif(
    not cpu_prepack.vnni_kernel_available(), reason="bf16 VNNI kernel not built here (needs AVX512-BF16)"
)


def _op(x, w, bias=None):
    return torch.ops.vllm_lite.bf16_linear_vnni(x, cpu_prepack.vnni_weight(w), w.shape[0], bias)


_bound = linear_reference_and_bound


@needs_kernel
@pytest.mark.parametrize("rows", [1, 5, 12, 13, 24, 25, 32, 37, 64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_matches_reference_within_one_bf16_rounding(rows, with_bias) -> None:
    g = torch.Generator().manual_seed(rows)
    n, k = 96, 802  # three weight blocks of 32 outputs; K even, not a multiple of 32
    x = torch.randn(rows, k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16() if with_bias else None
    got = _op(x, w, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    ref, ulp = _bound(x, w, bias)
    assert ((got.double() - ref).abs() <= ulp).all()
    theirs = F.linear(x, w, bias)  # rounded to nearest like it: nearly every output identical
    assert ((got.double() - theirs.double()).abs() <= ulp).all()
    assert (got != theirs).double().mean() < 0.02


@needs_kernel
def test_a_row_gets_the_same_bits_alone_with_other_rows_and_on_any_thread_count() -> None:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(40, 768, generator=g).bfloat16()
    w = (torch.randn(6144, 768, generator=g) * 0.05).bfloat16()
    wv = cpu_prepack.vnni_weight(w)
    together = torch.ops.vllm_lite.bf16_linear_vnni(x, wv, 6144, None)
    for lo, hi in ((0, 1), (3, 16), (17, 40), (39, 40)):
        part = torch.ops.vllm_lite.bf16_linear_vnni(x[lo:hi], wv, 6144, None)
        assert torch.equal(part, together[lo:hi]), (lo, hi)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch.ops.vllm_lite.bf16_linear_vnni(x, wv, 6144, None)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, together)


@needs_kernel
@pytest.mark.parametrize(
    ("x_shape", "w_shape", "n", "match"),
    [
        ((4, 64), (3, 16, 32, 2), 96, "weight_vnni must be"),  # K/2 = 16 but x has K = 64
        ((4, 64), (2, 32, 32, 2), 96, "weight_vnni must be"),  # N = 96 needs 3 blocks
        ((4, 64), (3, 32, 32, 2), 90, "multiple of 32"),
        ((4, 63), (3, 32, 32, 2), 96, "K even"),
        ((4, 64), (3, 32, 64), 96, "4-D|dim"),
    ],
)
def test_kernel_refuses_bad_shapes(x_shape, w_shape, n, match) -> None:
    x = torch.zeros(x_shape, dtype=torch.bfloat16)
    w = torch.zeros(w_shape, dtype=torch.bfloat16)
    with pytest.raises((ValueError, RuntimeError), match=match):
        torch.ops.vllm_lite.bf16_linear_vnni(x, w, n, None)


def _bf16_model() -> torch.nn.Module:
    cfg = EngineArgs(model=get_checkpoint("qwen2"), dtype="bfloat16", device="cpu").create_engine_config()
    return load_model(cfg.model_config, CPU)


@needs_kernel
def test_prepacked_model_runs_13_to_64_rows_through_the_kernel(monkeypatch) -> None:
    model = _bf16_model()
    weights = {name: m.weight.detach().clone() for name, m in model.named_modules() if hasattr(m, "supports_prepack")}
    assert cpu_prepack.prepack_linear_weights(model) > 0
    copies = {n: m for n, m in model.named_modules() if getattr(m, "vnni_weight", None) is not None}
    assert any(name.endswith("gate_up_proj") for name in copies) and any(name.endswith("o_proj") for name in copies)
    calls = []
    real = cpu_prepack._vnni_op
    monkeypatch.setattr(cpu_prepack, "_vnni_op", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    g = torch.Generator().manual_seed(1)
    edges = (cpu_prepack.SMALL_M_MAX, cpu_prepack.SMALL_M_MAX + 1, 32, cpu_prepack.VNNI_MAX, cpu_prepack.VNNI_MAX + 1)
    for name, module in copies.items():
        if name not in weights:
            continue
        w = weights[name]
        bias = getattr(module, "bias", None)
        for rows in edges:
            x = torch.randn(rows, w.shape[1], generator=g).bfloat16()
            got = cpu_prepack.linear(x, module, bias)
            _, ulp = _bound(x, w, bias)
            assert ((got.double() - F.linear(x, w, bias).double()).abs() <= ulp).all(), name
    assert calls and set(calls) == {cpu_prepack.SMALL_M_MAX + 1, 32, cpu_prepack.VNNI_MAX}


def test_no_third_copy_when_turned_off(monkeypatch) -> None:
    monkeypatch.setenv("VLLM_LITE_CPU_BF16_SMALL_M", "0")
    assert not cpu_prepack.vnni_kernel_available()
    model = _bf16_model()
    cpu_prepack.prepack_linear_weights(model)
    assert [n for n, m in model.named_modules() if getattr(m, "vnni_weight", None) is not None] == []
