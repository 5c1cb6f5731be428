"""The four AVX512-BF16 decode ops (csrc/bf16_small_m.cpp: bf16_linear_small_m, bf16_linear_vnni,
bf16_gate_up_small_m, bf16_gate_up_vnni) share one check of x and the weight copy (check_args): each refuses the
same bad inputs with the same message, before reading any data, and accepts zero rows. The shape-specific
refusals are in test_cpu_bf16_small_m.py, test_cpu_bf16_vnni.py and test_cpu_gate_up_silu.py."""

from __future__ import annotations

import pytest
import torch

from vllm_lite.worker.models import cpu_prepack

pytestmark = pytest.mark.skipif(
    not cpu_prepack.vnni_kernel_available(), reason="the AVX512-BF16 decode kernels are not built here"
)

K = 64
# op -> (its weight's name, a good weight for 32 outputs = gate_up's d of 16, its call, its row limit or None)
OPS = {
    "bf16_linear_small_m": ("weight_blocked", (8, 2, 4, 32), lambda x, w: (x, w, 32, None), 16),
    "bf16_linear_vnni": ("weight_vnni", (1, 32, 32, 2), lambda x, w: (x, w, 32, None), None),
    "bf16_gate_up_small_m": ("weight_blocked", (8, 2, 4, 32), lambda x, w: (x, w, 16, None, True), 16),
    "bf16_gate_up_vnni": ("weight_vnni", (1, 32, 32, 2), lambda x, w: (x, w, 16, None, False), None),
}


def _call(name, x, w):
    return getattr(torch.ops.vllm_lite, name)(*OPS[name][2](x, w))


@pytest.mark.parametrize("name", sorted(OPS))
def test_shared_checks(name) -> None:
    weight, shape, _, max_rows = OPS[name]
    x = torch.zeros(2, K, dtype=torch.bfloat16)
    w = torch.zeros(shape, dtype=torch.bfloat16)
    assert _call(name, x, w).shape[0] == 2 and _call(name, x[:0], w).shape[0] == 0
    with pytest.raises(TypeError, match="^x must have dtype BFloat16"):
        _call(name, x.float(), w)
    with pytest.raises(TypeError, match=f"^{weight} must have dtype BFloat16"):
        _call(name, x, w.float())
    with pytest.raises(ValueError, match="^x must have 2 dimensions"):
        _call(name, x[None], w)
    with pytest.raises(ValueError, match=f"^{weight} must have 4 dimensions"):
        _call(name, x, w[0])
    with pytest.raises(ValueError, match=f"^{weight} must be contiguous"):
        _call(name, x, torch.zeros(*shape[:-1], 2 * shape[-1], dtype=torch.bfloat16)[..., ::2])
    with pytest.raises(ValueError, match=f"^{name}: {weight} must be"):
        _call(name, torch.zeros(2, 2 * K, dtype=torch.bfloat16), w)  # K = 128 against a copy for 64
    rows = torch.zeros(17, K, dtype=torch.bfloat16)
    if max_rows is None:
        assert _call(name, rows, w).shape[0] == 17
    else:
        with pytest.raises(ValueError, match=f"^{name}: at most {max_rows} rows of x, got 17"):
            _call(name, rows, w)
