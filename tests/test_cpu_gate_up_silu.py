"""gate_up with SiLU-and-mul in the kernel's epilogue (csrc/bf16_small_m.cpp, `bf16_gate_up_small_m` /
`bf16_gate_up_vnni`, over cpu_prepack.interleave_gate_up's copy) gives bit for bit what the path before it gave:
the plain kernel (bf16_linear_small_m <= 12 rows, bf16_linear_vnni 13-64) writing gate_up, then
fused_silu_and_mul. At every decode row count the decoder stack uses, with and without a bias, for the bench
model's shape and for intermediate sizes that are not a multiple of the 16-output block or of the 64 elements of
SiLU's vector loop (the std::exp tail). Without SiLU the same kernels give the plain kernel's gate_up (what
cpu_prepack.linear hands every other caller). And a whole decoder step (cpu_decoder_layers) over models prepacked
with the interleaved copies equals one over models prepacked without, bit for bit."""

from __future__ import annotations

import pytest
import torch
import transformers

from vllm_lite.testing.decoder_stack import assert_same_step, count_stack_runs, stack_and_python
from vllm_lite.worker.models import cpu_prepack
from vllm_lite.worker.models.layers import RotaryEmbedding
from vllm_lite.worker.models.llama import LlamaForCausalLM

pytestmark = pytest.mark.skipif(
    not (cpu_prepack.small_m_kernel_available() and hasattr(torch.ops.vllm_lite, "bf16_gate_up_vnni")),
    reason="the AVX512-BF16 decode kernels are not built here",
)

ROWS = [1, 4, 12, 13, 32, 64]
# (d, K): the bench Qwen2's MLP; the tiny test models'; d a multiple of 16 but not of 64 (SiLU's scalar tail past
# 64); d = 80 (64 in SiLU's vector loop, 16 in its tail); d not a multiple of 16 (the last block padded: the
# small-m kernel applies, as its N = 2d is a multiple of 4; the VNNI copy is not made for such d).
SHAPES = [(3072, 768), (128, 64), (48, 96), (80, 128), (200, 64), (18, 32)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def _plain(x: torch.Tensor, w: torch.Tensor, bias) -> torch.Tensor:
    """gate_up [rows, 2d] as the decode path computes it without the interleaved copy."""
    n = w.shape[0]
    if x.shape[0] <= cpu_prepack.SMALL_M_MAX:
        return torch.ops.vllm_lite.bf16_linear_small_m(x, cpu_prepack.block_weight(w), n, bias)
    if n % 32 == 0:
        return torch.ops.vllm_lite.bf16_linear_vnni(x, cpu_prepack.vnni_weight(w), n, bias)
    # No plain VNNI copy for this d (oneDNN runs it in the model): the plain VNNI kernel over the interleaved
    # weight itself (its outputs do not depend on their order), put back in gate-then-up order.
    d = n // 2
    wi = cpu_prepack.interleave_gate_up(w, d)
    bi = None if bias is None else cpu_prepack.interleave_gate_up(bias.view(-1, 1), d).view(-1)
    out = torch.ops.vllm_lite.bf16_linear_vnni(x, cpu_prepack.vnni_weight(wi), wi.shape[0], bi)
    out = out.view(x.shape[0], -1, 2, cpu_prepack.GATE_UP_BLOCK)
    return torch.cat([out[:, :, 0].flatten(1)[:, :d], out[:, :, 1].flatten(1)[:, :d]], 1)


def _fused(x: torch.Tensor, w: torch.Tensor, bias, silu_and_mul: bool) -> torch.Tensor:
    d = w.shape[0] // 2
    wi = cpu_prepack.interleave_gate_up(w, d)
    if x.shape[0] <= cpu_prepack.SMALL_M_MAX:
        return torch.ops.vllm_lite.bf16_gate_up_small_m(x, cpu_prepack.block_weight(wi), d, bias, silu_and_mul)
    return torch.ops.vllm_lite.bf16_gate_up_vnni(x, cpu_prepack.vnni_weight(wi), d, bias, silu_and_mul)


@pytest.mark.parametrize("d,k", SHAPES, ids=[f"d{d}-k{k}" for d, k in SHAPES])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_fused_equals_gate_up_then_silu_and_mul(d, k, with_bias) -> None:
    g = torch.Generator().manual_seed(d + k)
    w = (0.1 * torch.randn(2 * d, k, generator=g)).bfloat16()
    bias = (0.5 * torch.randn(2 * d, generator=g)).bfloat16() if with_bias else None
    for rows in ROWS:
        # Spread: SiLU's exp sees large negative and positive gates (exp's edges), not only values near 0.
        x = (3 * torch.randn(rows, k, generator=g)).bfloat16()
        gate_up = _plain(x, w, bias)
        want = torch.ops.vllm_lite.fused_silu_and_mul(gate_up)
        got = _fused(x, w, bias, True)
        assert got.shape == (rows, d)
        assert torch.equal(_bits(got), _bits(want)), (
            f"rows {rows}: {int((got != want).sum())} outputs differ, max |diff| "
            f"{(got.float() - want.float()).abs().max().item()}"
        )
        unfused = _fused(x, w, bias, False)
        assert torch.equal(_bits(unfused), _bits(gate_up)), f"rows {rows}: gate_up without SiLU differs"


@pytest.mark.parametrize("rows", [12, 32], ids=["small_m", "vnni"])
def test_fused_sees_every_bf16_gate_value(rows) -> None:
    """Every finite bfloat16 value as a gate output, in SiLU's vector columns and in its std::exp tail: row r of x
    is the unit vector e_r, so gate_up's outputs are the weight's column r exactly and the weights choose them."""
    d, k = 80, 32  # columns 0-63 in SiLU's vector loop, 64-79 in its tail
    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    every = every[torch.isfinite(every.float())]
    x = torch.eye(rows, k).bfloat16()
    g = torch.Generator().manual_seed(rows)
    per = rows * d
    for start in range(0, every.numel(), per):
        vals = every[start : start + per]
        vals = torch.cat([vals, torch.zeros(per - vals.numel(), dtype=torch.bfloat16)]).view(rows, d)
        for shift in range(0, d, 16):  # each value once in every 16-column block, the tail's included
            w = torch.zeros(2 * d, k, dtype=torch.bfloat16)
            w[:d, :rows] = vals.roll(shift, 1).t()  # gate weight [d, K]: column r is row r's outputs
            w[d:, :rows] = (2 * torch.randn(d, rows, generator=g)).bfloat16()
            want = torch.ops.vllm_lite.fused_silu_and_mul(_plain(x, w, None))
            got = _fused(x, w, None, True)
            assert torch.equal(_bits(got), _bits(want)), f"values {start}..: {int((got != want).sum())} differ"


def test_interleave_gate_up_layout() -> None:
    d, k = 20, 4  # 2 blocks, the second padded with 12 zero rows
    w = torch.arange(2 * d * k, dtype=torch.float32).view(2 * d, k).bfloat16()
    wi = cpu_prepack.interleave_gate_up(w, d)
    assert wi.shape == (64, k)
    assert torch.equal(wi[0:16], w[0:16]) and torch.equal(wi[16:32], w[20:36])
    assert torch.equal(wi[32:36], w[16:20]) and torch.equal(wi[48:52], w[36:40])
    assert not wi[36:48].any() and not wi[52:64].any()


@pytest.mark.parametrize(
    "fn,w_shape,d,match",
    [
        ("bf16_gate_up_small_m", (8, 2, 4, 32), 18, "needs 64"),  # 32 interleaved outputs hold d <= 16
        ("bf16_gate_up_vnni", (1, 32, 32, 2), 17, "needs 64"),
        ("bf16_gate_up_small_m", (8, 1, 4, 32), 16, "weight_blocked must be"),
        ("bf16_gate_up_vnni", (1, 16, 32, 2), 16, "weight_vnni must be"),
    ],
)
def test_gate_up_ops_refuse_bad_shapes(fn, w_shape, d, match) -> None:
    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=match):
        getattr(torch.ops.vllm_lite, fn)(x, torch.zeros(w_shape, dtype=torch.bfloat16), d, None, True)
    good = {"bf16_gate_up_small_m": (8, 2, 4, 32), "bf16_gate_up_vnni": (1, 32, 32, 2)}[fn]  # d <= 16
    with pytest.raises(ValueError, match="bias must be"):
        getattr(torch.ops.vllm_lite, fn)(
            x, torch.zeros(good, dtype=torch.bfloat16), 16, torch.zeros(16, dtype=torch.bfloat16), True
        )


def _model(intermediate: int, mlp_bias: bool, fuse: bool) -> torch.nn.Module:
    cfg = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=intermediate,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        mlp_bias=mlp_bias,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif p.dim() == 1:
                p.copy_(0.1 * torch.randn_like(p))
    model.to(torch.bfloat16)
    for m in model.modules():
        if isinstance(m, RotaryEmbedding):
            m.init_buffers()
    assert cpu_prepack.prepack_linear_weights(model, fuse_gate_up=fuse) > 0
    return model


@pytest.mark.parametrize("intermediate,mlp_bias", [(256, False), (80, True), (200, False)])
def test_decoder_stack_fused_equals_unfused(intermediate, mlp_bias, monkeypatch) -> None:
    """A decoder step through cpu_decoder_layers over the interleaved copies (SiLU fused into gate_up at 1-64
    rows) equals the same step over the plain copies (gate_up, then SiLU-and-mul), and the Python layers over the
    interleaved copies (cpu_prepack.linear without SiLU, then SiluAndMul) equal both."""
    fused = _model(intermediate, mlp_bias, True)
    plain = _model(intermediate, mlp_bias, False)
    for model, interleaved in ((fused, True), (plain, False)):
        mods = [layer.mlp.gate_up_proj for layer in model.model.layers]
        assert all((cpu_prepack._GATE_UP_ATTR in m.__dict__) == interleaved for m in mods)
        if interleaved:
            assert all(m.gate_up_interleaved == intermediate for m in mods)
            assert all(m.small_m_weight.shape[0] * 4 == 2 * (-(-intermediate // 16) * 16) for m in mods)
    n = count_stack_runs(monkeypatch)
    for rows in (1, 4, 12, 13, 32, 64, 65):
        seq_lens = [20 + (7 * i) % 23 for i in range(rows)]
        a, python = stack_and_python(fused, [1] * rows, seq_lens, seed=rows)
        b, _ = stack_and_python(plain, [1] * rows, seq_lens, seed=rows)
        assert_same_step(a, b)
        assert_same_step(a, python)
    assert n[0] == 2 * 7, "every bf16 forward outside python_layers() must take the C++ stack"
