"""The bias of the AVX512-BF16 decode linears (csrc/bf16_small_m.cpp, `bf16_linear_small_m` / `bf16_linear_vnni`).

The kernels read a contiguous bfloat16 or float32 bias in place (no per-call conversion); any other bias (another
dtype, a strided view) is converted to float32 first. Either way an output is the float32 sum plus the bias
widened to float32 exactly, rounded once: so a bfloat16 bias gives the same bits as its float32 copy, a strided
view as its contiguous copy, a float16 bias as its float32 copy; the float32 path itself is checked against a
float64 reference. Row counts cover every register block shape (small-m passes of 1-4 rows, VNNI blocks of
1-12) and N is not a multiple of 16 for the small-m kernel (its 4-output tiles read 4 bias values each).
"""

from __future__ import annotations

import pytest
import torch

from vllm_lite.testing.bf16_bounds import linear_reference_and_bound
from vllm_lite.worker.models import cpu_prepack

pytestmark = pytest.mark.skipif(
    not cpu_prepack.vnni_kernel_available(), reason="the AVX512-BF16 decode kernels are not built here"
)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def _ops(n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    blocked = cpu_prepack.block_weight(w)
    small = lambda x, b: torch.ops.vllm_lite.bf16_linear_small_m(x, blocked, n, b)  # noqa: E731
    if n % 32:
        return g, w, [(small, range(1, 17))]
    vnni_w = cpu_prepack.vnni_weight(w)
    vnni = lambda x, b: torch.ops.vllm_lite.bf16_linear_vnni(x, vnni_w, n, b)  # noqa: E731
    return g, w, [(small, range(1, 17)), (vnni, [1, 5, 12, 13, 24, 33])]


@pytest.mark.parametrize("n, k", [(1284, 800), (1280, 768)])
def test_bias_in_place_equals_its_float32_copy(n, k) -> None:
    g, w, ops = _ops(n, k, n)
    wide = torch.randn(2 * n, generator=g).bfloat16() * 4
    wide[7] = float("inf")  # widened exactly: the column is +inf (or NaN) in every row
    bf16 = wide[:n].clone()
    variants = {
        "bf16": (bf16, bf16.float()),
        "strided bf16": (wide[::2], wide[::2].contiguous().float()),
        "float16": (bf16.half(), bf16.half().float()),
    }
    for op, rows_list in ops:
        for rows in rows_list:
            x = torch.randn(rows, k, generator=g).bfloat16()
            f32 = op(x, bf16.float())
            ref, ulp = linear_reference_and_bound(x, w, bf16.float())
            finite = ref.isfinite()
            assert ((f32.double() - ref).abs() <= ulp)[finite].all() and f32[:, 7].isposinf().all(), rows
            for name, (bias, as_f32) in variants.items():
                got = op(x, bias)
                assert got.shape == (rows, n) and got.dtype == torch.bfloat16
                assert torch.equal(_bits(got), _bits(op(x, as_f32))), (name, rows)
            assert not torch.equal(f32, op(x, None)), rows  # the bias is applied at all


def test_bias_is_checked() -> None:
    _, _, ops = _ops(64, 64, 0)
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    for op, _ in ops:
        with pytest.raises(ValueError, match="bias must be"):
            op(x, torch.zeros(60, dtype=torch.bfloat16))
        with pytest.raises(ValueError, match="bias must be"):
            op(x, torch.zeros(1, 64, dtype=torch.bfloat16))
