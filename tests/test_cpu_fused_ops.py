"""Fused CPU small ops (csrc/fused_cpu_ops.cpp) against the torch code they replace in layers.py / gemma2.py.

The kernels repeat torch's operations and roundings, so where torch vectorises as they do (AVX2 or AVX-512
capability, kernels built with AVX2 or more) they must match bit for bit; elsewhere within the stated
tolerance. Shapes: hidden 64..5120 and odd widths, head_dim 16..256 with partial rotary, T = 0, 1, 3, 257.
"""

from __future__ import annotations

import pytest
import torch

from vllm_lite.worker.attention.cpu_kernels import load_cpu_ops
from vllm_lite.worker.models import layers
from vllm_lite.worker.models.gemma2 import GemmaRMSNorm
from vllm_lite.worker.models.layers import RMSNorm, RotaryEmbedding, SiluAndMul

pytestmark = pytest.mark.skipif(
    not (load_cpu_ops() and hasattr(torch.ops.vllm_lite, "fused_rms_norm")), reason="CPU kernels not built here"
)

DTYPES = (torch.float32, torch.bfloat16)
HIDDEN = (64, 100, 768, 896, 5120)
TOKENS = (0, 1, 3, 257)


def _width() -> int:
    return torch.ops.vllm_lite.fused_cpu_ops_vector_width()


def _capability() -> str:
    return torch.backends.cpu.get_cpu_capability()


def norm_exact() -> bool:
    # torch's sum kernel runs 8-float vectors under both AVX2 and AVX-512 capability (no AVX-512 variant).
    return _capability() in ("AVX2", "AVX512") and _width() >= 8


def silu_exact() -> bool:
    # SiLU's split between SLEEF exp (vector body) and std::exp (row tail) follows torch's vector width.
    return {"AVX512": 16, "AVX2": 8}.get(_capability()) == _width() and torch.ops.vllm_lite.fused_cpu_ops_vector_exp()


def ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in units in the last place between same-signed a and b (0 for empty tensors)."""
    assert a.shape == b.shape and a.dtype == b.dtype
    if a.numel() == 0:
        return 0
    if a.dtype == torch.bfloat16:
        ai, bi = a.contiguous().view(torch.int16).int(), b.contiguous().view(torch.int16).int()
    else:
        ai, bi = a.contiguous().view(torch.int32).long(), b.contiguous().view(torch.int32).long()
    return int((ai - bi).abs().max())


def assert_close_ulps(got: torch.Tensor, want: torch.Tensor, exact: bool, fp32_ulps: int = 4) -> None:
    """Bit-exact when `exact`; else within one bfloat16 ulp or fp32_ulps float32 ulps."""
    limit = 0 if exact else (1 if got.dtype == torch.bfloat16 else fp32_ulps)
    assert ulps(got, want) <= limit, f"{ulps(got, want)} ulps apart (limit {limit})"


def reference(fn, *args):
    """fn(*args) with the fused ops turned off (the torch code)."""
    saved = list(layers._fused_state)
    layers._fused_state[:] = [None]
    try:
        return fn(*args)
    finally:
        layers._fused_state[:] = saved


def _weight(n: int, dtype: torch.dtype) -> torch.nn.Parameter:
    return torch.nn.Parameter((torch.rand(n) + 0.5).to(dtype), requires_grad=False)


@pytest.fixture(autouse=True)
def _fused_on():
    layers.reset_fused_cpu_ops()
    assert layers.fused_cpu_ops() is not None
    yield
    layers.reset_fused_cpu_ops()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", HIDDEN + (17,))
@pytest.mark.parametrize("t", TOKENS)
@torch.inference_mode()
def test_rms_norm_matches_torch(dtype, hidden, t):
    gen = torch.Generator().manual_seed(hidden * 1000 + t)
    norm = RMSNorm(hidden, eps=1e-6).to(dtype)
    norm.weight = _weight(hidden, dtype)
    x = (torch.randn(t, hidden, generator=gen) * 3).to(dtype)
    res = torch.randn(t, hidden, generator=gen).to(dtype)
    want = reference(norm, x)
    got = norm(x)
    assert_close_ulps(got, want, norm_exact())
    want_y, want_r = reference(norm, x, res)
    got_y, got_r = norm(x, res)
    assert torch.equal(got_r, want_r)  # the residual add is one rounding either way
    assert_close_ulps(got_y, want_y, norm_exact())
    assert got_y.dtype == dtype and got_y.shape == x.shape


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", (64, 768, 3072))
@pytest.mark.parametrize("weight_dtype", (None, torch.float32))
@torch.inference_mode()
def test_gemma_rms_norm_matches_torch(dtype, hidden, weight_dtype):
    gen = torch.Generator().manual_seed(hidden)
    norm = GemmaRMSNorm(hidden, eps=1e-6)
    norm.weight = torch.nn.Parameter(torch.randn(hidden, generator=gen).to(weight_dtype or dtype), requires_grad=False)
    for t in TOKENS:
        x = (torch.randn(t, hidden, generator=gen) * 3).to(dtype)
        assert_close_ulps(norm(x), reference(norm, x), norm_exact())


@pytest.mark.parametrize("dtype", DTYPES)
@torch.inference_mode()
def test_rms_norm_per_head_on_a_strided_view(dtype):
    """Qwen3's q/k norm: a [T, H, D] view with a row stride wider than H*D (q inside the qkv output)."""
    heads, d, t = 5, 128, 7
    norm = RMSNorm(d, eps=1e-6).to(dtype)
    norm.weight = _weight(d, dtype)
    qkv = torch.randn(t, (heads + 4) * d).to(dtype)
    q = qkv[:, : heads * d]
    got = layers.norm_per_head(norm, q, heads, d)
    want = reference(layers.norm_per_head, norm, q, heads, d)
    assert_close_ulps(got, want, norm_exact())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", (1, 7, 31, 100, 3072, 4864))
@pytest.mark.parametrize("t", TOKENS)
@torch.inference_mode()
def test_silu_and_mul_matches_torch(dtype, d, t):
    gen = torch.Generator().manual_seed(d * 1000 + t)
    x = (torch.randn(t, 2 * d, generator=gen) * 4).to(dtype)
    act = SiluAndMul()
    got = act(x)
    want = reference(act, x)
    assert got.shape == want.shape == (t, d)
    assert_close_ulps(got, want, silu_exact())


@torch.inference_mode()
def test_silu_and_mul_3d_and_strided_rows():
    x = torch.randn(3, 4, 2 * 96 + 8).to(torch.bfloat16)[..., : 2 * 96]  # rows of 192 with a stride of 200
    act = SiluAndMul()
    assert_close_ulps(act(x), reference(act, x), silu_exact())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", (16, 64, 80, 128, 256))
@pytest.mark.parametrize("partial", (1.0, 0.5))
@pytest.mark.parametrize("t", TOKENS)
@torch.inference_mode()
def test_rotary_matches_torch_in_place(dtype, head_dim, partial, t):
    """q and k are views into one qkv row (as QKVLinear.split gives them), rotated in place."""
    gen = torch.Generator().manual_seed(head_dim * 1000 + t)
    rope = RotaryEmbedding(
        head_dim, 4096, {"rope_theta": 10000.0, "rope_type": "default", "partial_rotary_factor": partial}
    )
    heads, kv_heads = 6, 2
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    q, k = qkv[:, : heads * head_dim], qkv[:, heads * head_dim : (heads + kv_heads) * head_dim]
    v_before = qkv[:, (heads + kv_heads) * head_dim :].clone()
    positions = torch.randint(0, 4096, (t,), generator=gen)
    if t == 0:  # the torch code cannot view an empty batch; the kernel returns it untouched
        got_q, got_k = rope(positions, q, k)
        assert got_q.shape == q.shape and got_k.shape == k.shape
        return
    want_q, want_k = reference(rope, positions, q.clone(), k.clone())
    got_q, got_k = rope(positions, q, k)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()  # in place
    # No transcendental and no reduction: bit-exact on every build.
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], v_before)  # v untouched


@torch.inference_mode()
def test_rotary_int32_positions_and_bounds():
    rope = RotaryEmbedding(64, 128, {"rope_theta": 10000.0, "rope_type": "default"})
    q, k = torch.randn(3, 128), torch.randn(3, 64)
    pos = torch.tensor([0, 5, 127], dtype=torch.int32)
    want = reference(rope, pos.long(), q.clone(), k.clone())
    got = rope(pos, q.clone(), k.clone())
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(IndexError, match="position 128 at row 1 is outside the cos/sin table of 128 rows"):
        rope(torch.tensor([0, 128, 1]), q.clone(), k.clone())
    with pytest.raises(IndexError, match="position -1 at row 0"):
        rope(torch.tensor([-1, 0, 1]), q.clone(), k.clone())


def test_bad_inputs_raise():
    ops = torch.ops.vllm_lite
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="weight must have 64 entries"):
        ops.fused_rms_norm(x, None, torch.ones(32), 1e-6, False)
    with pytest.raises(TypeError, match="weight must have dtype"):
        ops.fused_rms_norm(x, None, torch.ones(64, dtype=torch.bfloat16), 1e-6, False)
    with pytest.raises(ValueError, match="residual must have x's shape"):
        ops.fused_rms_norm(x, torch.randn(3, 64), torch.ones(64), 1e-6, False)
    with pytest.raises(TypeError, match="x must be float32 or bfloat16"):
        ops.fused_rms_norm(x.half(), None, torch.ones(64).half(), 1e-6, False)
    with pytest.raises(ValueError, match="contiguous along its last dimension"):
        ops.fused_silu_and_mul(torch.randn(64, 4).t())
    with pytest.raises(ValueError, match="last dim must be even"):
        ops.fused_silu_and_mul(torch.randn(2, 7))
    cache = torch.randn(16, 8)
    with pytest.raises(ValueError, match="rotary_dim <= head_size"):
        ops.fused_rotary_embedding(torch.zeros(2, dtype=torch.long), torch.randn(2, 8), torch.randn(2, 8), cache, 8, 10)
    with pytest.raises(ValueError, match="multiples of head_size 8"):
        ops.fused_rotary_embedding(torch.zeros(2, dtype=torch.long), torch.randn(2, 12), torch.randn(2, 8), cache, 8, 8)
    with pytest.raises(ValueError, match="must have 2 rows"):
        ops.fused_rotary_embedding(torch.zeros(2, dtype=torch.long), torch.randn(3, 8), torch.randn(3, 8), cache, 8, 8)


@torch.inference_mode()
def test_layers_call_the_fused_ops_on_cpu_only_outside_autograd(monkeypatch):
    calls: list[str] = []
    real = layers.fused_cpu_ops()

    def spy(name):
        fn = getattr(real, name)
        return lambda *a: (calls.append(name), fn(*a))[1]

    monkeypatch.setattr(layers, "_fused_state", [type(real)(**{n: spy(n) for n in vars(real)})])
    norm, act = RMSNorm(64), SiluAndMul()
    rope = RotaryEmbedding(16, 32, {"rope_theta": 10000.0, "rope_type": "default"})
    x = torch.randn(2, 64)
    norm(x, x.clone())
    act(x)
    rope(torch.tensor([1, 2]), torch.randn(2, 32), torch.randn(2, 16))
    assert calls == ["rms_norm", "silu_and_mul", "rotary"]
    norm(x.half())  # other dtypes take the torch code
    with torch.inference_mode(False), torch.enable_grad():
        y = RMSNorm(64)(torch.randn(2, 64))
    assert y.requires_grad  # autograd keeps the torch code
    assert calls == ["rms_norm", "silu_and_mul", "rotary"]


def test_env_switch_turns_them_off(monkeypatch):
    monkeypatch.setenv("VLLM_LITE_CPU_FUSED_OPS", "0")
    layers.reset_fused_cpu_ops()
    assert layers.fused_cpu_ops() is None
    monkeypatch.setenv("VLLM_LITE_CPU_FUSED_OPS", "1")
    layers.reset_fused_cpu_ops()
    assert layers.fused_cpu_ops() is not None
