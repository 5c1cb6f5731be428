"""The AVX512-BF16 decode kernel (csrc/bf16_small_m.cpp) and its use by cpu_prepack.linear.

Where the kernel is built (AVX512-BF16 CPUs), its outputs are checked against a float64 reference:
each within the error F.linear's own bfloat16 output has there (one final rounding) and rounded to
nearest like it, for 1-16 rows, with and without bias; equal at 1 and 2 threads, and a row's result
the same whatever rows come with it. Everywhere: bad inputs raise before any data is
read, and prepacking keeps no second weight copy where the kernel is absent or turned off.
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
    not cpu_prepack.small_m_kernel_available(), reason="bf16 small-m kernel not built here (needs AVX512-BF16)"
)


def _op(x, w, bias=None):
    return torch.ops.vllm_lite.bf16_linear_small_m(x, cpu_prepack.block_weight(w), w.shape[0], bias)


_bound = linear_reference_and_bound


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_matches_reference_within_one_bf16_rounding(rows, with_bias) -> None:
    g = torch.Generator().manual_seed(rows)
    n, k = 1284, 800  # N a multiple of 4 (not of 16), K of 32 (not of 64)
    x = torch.randn(rows, k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16() if with_bias else None
    got = _op(x, w, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    ref, ulp = _bound(x, w, bias)
    assert ((got.double() - ref).abs() <= ulp).all()
    # and as close as oneDNN's/F.linear's own result is, element for element within one ulp of it, and
    # rounded the same way: only the summation order differs, so nearly every output is identical
    # (truncating instead of rounding to nearest would change about half of them)
    theirs = F.linear(x, w, bias)
    assert ((got.double() - theirs.double()).abs() <= ulp).all()
    assert (got != theirs).double().mean() < 0.01


@needs_kernel
@pytest.mark.parametrize("rows", [2, 6, 16])
def test_kernel_result_does_not_depend_on_thread_count(rows) -> None:
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 768, generator=g).bfloat16()
    w = (torch.randn(6144, 768, generator=g) * 0.05).bfloat16()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _op(x, w)
        torch.set_num_threads(2)
        two = _op(x, w)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def _cancelling_rows(rows: int, k: int, n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """x, w whose dot products sum large terms that cancel (+-B at 16 fixed positions, where w is 1) and small
    ones: the float32 result then depends on the order of the additions, down to the bfloat16 rounding."""
    x = torch.randn(rows, k, generator=g) * 0.5
    w = torch.rand(n, k, generator=g) + 0.5
    pos = torch.randperm(k, generator=g)[:16]
    big = 2.0**20 * torch.randint(128, 256, (rows, 8), generator=g) / 128
    x[:, pos[:8]], x[:, pos[8:]] = big, -big
    w[:, pos] = 1.0
    return x.bfloat16(), w.bfloat16()


@needs_kernel
def test_kernel_row_result_does_not_depend_on_the_other_rows() -> None:
    """Each output is the same float32 sum wherever its row sits in the batch (rows go in passes of up to 4,
    split evenly): a request's logits do not change with how many others decode beside it."""
    g = torch.Generator().manual_seed(7)
    n, k = 1280, 768
    x, w = _cancelling_rows(16, k, n, g)
    bias = torch.randn(n, generator=g).bfloat16()
    blocked = cpu_prepack.block_weight(w)
    full = torch.ops.vllm_lite.bf16_linear_small_m(x, blocked, n, bias)
    # the inputs are sensitive: summed in another order (here oneDNN's), many outputs change
    assert (full != F.linear(x, w, bias)).double().mean() > 0.05
    for rows in (1, 3, 5, 6, 11):
        for start in (0, 16 - rows):
            part = torch.ops.vllm_lite.bf16_linear_small_m(x[start : start + rows], blocked, n, bias)
            assert torch.equal(part, full[start : start + rows]), (rows, start)


@needs_kernel
def test_kernel_nan_and_inf_rows_stay_in_their_rows() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 64, generator=g).bfloat16()
    w = (torch.randn(8, 64, generator=g) * 0.05).bfloat16()
    x[1, 5] = float("nan")
    x[4, 0] = float("inf")
    w[:, 0] = 1.0  # so row 4 sums to +inf in every column
    got = _op(x, w)
    assert got[1].isnan().all() and got[4].isposinf().all()
    rest = [0, 2, 3, 5]
    assert got[rest].isfinite().all()
    assert torch.equal(got[rest], _op(x[rest], w))


@needs_kernel
@pytest.mark.parametrize(
    "x_shape, w_shape, n, match",
    [
        ((17, 64), (4, 2, 4, 32), 16, "at most 16 rows"),
        ((1, 64), (4, 2, 4, 32), 15, "multiple of 4"),
        ((1, 48), (4, 2, 4, 32), 16, "multiple of 4 and K of 32"),
        ((1, 64), (4, 1, 4, 32), 16, "weight_blocked must be"),
    ],
)
def test_kernel_refuses_bad_shapes(x_shape, w_shape, n, match) -> None:
    with pytest.raises(ValueError, match=match):
        torch.ops.vllm_lite.bf16_linear_small_m(
            torch.zeros(x_shape, dtype=torch.bfloat16), torch.zeros(w_shape, dtype=torch.bfloat16), n, None
        )
    with pytest.raises(TypeError, match="x must have dtype"):
        torch.ops.vllm_lite.bf16_linear_small_m(
            torch.zeros(1, 64), torch.zeros(4, 2, 4, 32, dtype=torch.bfloat16), 16, None
        )


def _bf16_model() -> torch.nn.Module:
    cfg = EngineArgs(model=get_checkpoint("qwen2"), dtype="bfloat16", device="cpu").create_engine_config()
    return load_model(cfg.model_config, CPU)


def _copies(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {name: m for name, m in model.named_modules() if getattr(m, "small_m_weight", None) is not None}


@needs_kernel
def test_prepacked_model_runs_decode_rows_through_the_kernel(monkeypatch) -> None:
    model = _bf16_model()
    weights = {name: m.weight.detach().clone() for name, m in model.named_modules() if hasattr(m, "supports_prepack")}
    assert cpu_prepack.prepack_linear_weights(model) > 0
    copies = _copies(model)
    assert (
        copies
        and "model.embed_tokens" in copies
        and any(  # the tied LM head is the embedding
            name.endswith("qkv_proj") for name in copies
        )
    )
    calls = []
    real = torch.ops.vllm_lite.bf16_linear_small_m
    monkeypatch.setattr(cpu_prepack, "_small_m_op", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    g = torch.Generator().manual_seed(1)
    for name, module in copies.items():
        if name not in weights:
            continue
        w = weights[name]
        bias = getattr(module, "bias", None)
        for rows in (1, 2, cpu_prepack.SMALL_M_MAX, cpu_prepack.SMALL_M_MAX + 1):
            x = torch.randn(rows, w.shape[1], generator=g).bfloat16()
            got = cpu_prepack.linear(x, module, bias)
            _, ulp = _bound(x, w, bias)
            assert ((got.double() - F.linear(x, w, bias).double()).abs() <= ulp).all(), name
    assert calls and set(calls) == {1, 2, cpu_prepack.SMALL_M_MAX}  # more rows go to another kernel
    assert cpu_prepack.SMALL_M_MAX <= torch.ops.vllm_lite.bf16_small_m_max_rows()


def test_no_second_copy_when_turned_off_or_not_built(monkeypatch) -> None:
    monkeypatch.setenv("VLLM_LITE_CPU_BF16_SMALL_M", "0")
    assert not cpu_prepack.small_m_kernel_available()
    model = _bf16_model()
    cpu_prepack.prepack_linear_weights(model)
    assert _copies(model) == {}
