"""Checks of the LoRA (SGMV/BGMV) and int4 (AWQ/GPTQ) Triton kernels against float64 oracles and the torch paths.

Shared by the CPU interpreter run (`python -m vllm_lite.testing.triton_cases --suite lora_int4
--device cpu`, TRITON_INTERPRET=1 in that process only) and the native CUDA run (in-process,
compiled, `full=True`: larger shapes). Each check raises on a mismatch.

Tolerances, relative to the largest reference magnitude (and the same relative term): float32 1e-5;
float16 2e-3 and bfloat16 1.6e-2, a few roundings of the output dtype, since the kernels accumulate in
float32 and round once. The int4 kernels' dequantized tile is checked bit for bit through an identity
input in float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from vllm_lite.testing.lora_int4_oracle import (
    Int4Case,
    lora_expand_ref,
    lora_shrink_ref,
    random_awq_case,
    random_gptq_case,
)

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _close(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    out, expected = out.double().cpu(), expected.double().cpu()
    scale = max(float(expected.abs().max()), 1e-6) if expected.numel() else 1.0
    torch.testing.assert_close(out, expected, atol=TOL[dtype] * scale, rtol=TOL[dtype], msg=lambda m: f"{what}: {m}")


# ---------------------------------------------------------------------------------------------- LoRA


@dataclass(frozen=True)
class LoRACase:
    """One batch: T tokens over S slots (max rank R), some without an adapter, one slot of a lower rank."""

    method: Optional[str]  # "sgmv", "bgmv" or None (the size-based default)
    dtype: str
    tokens: int
    slots: int
    rank: int
    hidden: int
    out: int
    split_k: Optional[int] = None
    seed: int = 0

    @property
    def name(self) -> str:
        split = f"-split{self.split_k}" if self.split_k else ""
        return (
            f"lora-{self.method or 'auto'}-{self.dtype}-t{self.tokens}-s{self.slots}-r{self.rank}"
            f"-h{self.hidden}-o{self.out}{split}"
        )


def lora_cases(full: bool) -> list[LoRACase]:
    """The interpreter's few small batches, or a matrix of realistic ones for compiled kernels."""
    if not full:
        return [
            LoRACase("sgmv", "fp32", 21, 3, 8, 48, 40),
            LoRACase("sgmv", "bf16", 37, 4, 16, 64, 24, split_k=2, seed=1),
            LoRACase("bgmv", "fp32", 5, 3, 8, 48, 40, seed=2),
            LoRACase("bgmv", "fp16", 3, 2, 16, 80, 32, split_k=2, seed=3),
            LoRACase(None, "bf16", 19, 2, 8, 32, 16, seed=4),
        ]
    cases = []
    for i, (method, dtype, tokens) in enumerate(
        (m, d, t) for m in ("sgmv", "bgmv", None) for d in DTYPES for t in (1, 7, 16, 17, 100, 700)
    ):
        rank = (8, 16, 64)[i % 3]
        cases.append(LoRACase(method, dtype, tokens, 1 + i % 8, rank, (1024, 2048, 4096)[i % 3], 1024, seed=i))
    return cases


def _lora_inputs(case: LoRACase, device: str):
    g = torch.Generator().manual_seed(case.seed)
    dtype = DTYPES[case.dtype]
    x = torch.randn(case.tokens, case.hidden, generator=g).to(dtype)
    lora_a = (torch.randn(case.slots, case.rank, case.hidden, generator=g) / case.hidden**0.5).to(dtype)
    lora_b = torch.randn(case.slots, case.out, case.rank, generator=g).to(dtype)
    if case.slots > 1:  # slot 1 holds a lower-rank adapter, padded with zeros to the max rank
        lora_a[1, case.rank // 2 :] = 0
        lora_b[1, :, case.rank // 2 :] = 0
    slots = torch.randint(-1, case.slots, (case.tokens,), generator=g, dtype=torch.int32)
    slots[0] = -1  # at least one token without an adapter
    y = torch.randn(case.tokens, case.out + 24, generator=g).to(dtype)
    return tuple(t.to(device) for t in (x, lora_a, lora_b, slots, y))


def check_lora(case: LoRACase, device: str) -> None:
    """Shrink then expand (at a column offset) equal the float64 oracle and the torch ops; other columns untouched."""
    from vllm_lite.lora import torch_ops
    from vllm_lite.lora.triton_ops import lora_expand, lora_shrink

    dtype = DTYPES[case.dtype]
    x, lora_a, lora_b, slots, y = _lora_inputs(case, device)
    buf = lora_shrink(x, lora_a, slots, method=case.method, split_k=case.split_k)
    assert buf.dtype == torch.float32 and buf.shape == (case.tokens, case.rank)
    _close(buf, lora_shrink_ref(x, lora_a, slots), dtype, "shrink vs float64 oracle")
    _close(buf, torch_ops.lora_shrink(x, lora_a, slots), dtype, "shrink vs torch_ops")
    assert not buf[slots < 0].any(), "rows without an adapter must be zero"

    offset = 16
    expected = lora_expand_ref(y, buf.to(dtype), lora_b, slots, offset)
    torch_y = y.clone()
    torch_ops.lora_expand(torch_y, buf, lora_b, slots, offset)
    before = y.clone()
    lora_expand(y, buf, lora_b, slots, offset, method=case.method)
    _close(y, expected, dtype, "expand vs float64 oracle")
    _close(y, torch_y, dtype, "expand vs torch_ops")
    no_adapter = slots < 0
    assert torch.equal(y[no_adapter], before[no_adapter]), "expand changed rows without an adapter"
    outside = torch.ones(y.shape[1], dtype=torch.bool, device=y.device)
    outside[offset : offset + case.out] = False
    assert torch.equal(y[:, outside], before[:, outside]), "expand wrote outside [out_offset, out_offset + out)"


def check_lora_packed_projections(device: str) -> None:
    """q|k|v into one y with three offsets and one shared grouping: each slice gets its own adapter's delta."""
    from vllm_lite.lora.triton_ops import group_tokens_by_slot, lora_expand, lora_shrink

    g = torch.Generator().manual_seed(5)
    t, h, r, s = 40, 32, 8, 3
    x = torch.randn(t, h, generator=g)
    slots = torch.tensor([(i % 4) - 1 for i in range(t)], dtype=torch.int32)
    a = torch.randn(s, 3 * r, h, generator=g)  # three projections' A stacked along the rank
    bs = [torch.randn(s, n, r, generator=g) for n in (32, 16, 16)]
    y = torch.randn(t, 64, generator=g)
    x, slots, a, y = x.to(device), slots.to(device), a.to(device), y.to(device)
    bs = [b.to(device) for b in bs]
    grouping = group_tokens_by_slot(slots, s)
    buf = lora_shrink(x, a, slots, grouping=grouping, method="sgmv")
    expected = y.double().cpu()
    offset = 0
    for i, b in enumerate(bs):
        part = buf[:, i * r : (i + 1) * r].contiguous()
        expected = lora_expand_ref(expected, part, b, slots, offset)
        lora_expand(y, part, b, slots, offset, grouping=grouping, method="sgmv")
        offset += b.shape[1]
    _close(y, expected, torch.float32, "packed q|k|v expand")


def check_lora_slots_outside_table(device: str) -> None:
    """Every token without an adapter (and a slot past the table) leaves buf zero and y unchanged, both kernels."""
    from vllm_lite.lora.triton_ops import lora_expand, lora_shrink

    g = torch.Generator().manual_seed(6)
    x = torch.randn(20, 32, generator=g).to(device)
    a = torch.randn(2, 16, 32, generator=g).to(device)
    b = torch.randn(2, 16, 16, generator=g).to(device)
    slots = torch.tensor([-1] * 19 + [2], dtype=torch.int32, device=device)
    for method in ("sgmv", "bgmv"):
        y = torch.randn(20, 16, generator=g).to(device)
        before = y.clone()
        buf = lora_shrink(x, a, slots, method=method)
        assert not buf.any(), f"{method}: shrink wrote rows without an adapter"
        lora_expand(y, torch.randn(20, 16, generator=g).to(device), b, slots, method=method)
        assert torch.equal(y, before), f"{method}: expand changed rows without an adapter"


# ---------------------------------------------------------------------------------------------- int4


@dataclass(frozen=True)
class QuantCase:
    """One int4 matmul: format, activation dtype, M x K x N, group size, act-order."""

    fmt: str  # "awq", "gptq", "gptq_v2"
    dtype: str
    m: int
    k: int
    n: int
    group_size: int
    desc_act: bool = False
    bits: int = 4
    pass_g_idx: bool = True  # gptq: False takes the g_idx=None (k // G) path
    split_k: Optional[int] = None
    wide_load: bool = True  # False: the kernel's gather-per-weight loads
    seed: int = 0

    @property
    def name(self) -> str:
        extra = ("-desc_act" if self.desc_act else "") + ("" if self.pass_g_idx else "-no_g_idx")
        extra += "" if self.wide_load else "-gather"
        extra += (f"-{self.bits}bit" if self.bits != 4 else "") + (f"-split{self.split_k}" if self.split_k else "")
        return f"{self.fmt}-{self.dtype}-m{self.m}-k{self.k}-n{self.n}-g{self.group_size}{extra}"


def quant_cases(full: bool) -> list[QuantCase]:
    """The interpreter's set (M=1 and M>1, groups 32/64/128, desc_act), or the full matrix compiled."""
    if not full:
        return [
            QuantCase("awq", "fp16", 1, 128, 48, 32),
            QuantCase("awq", "fp16", 3, 128, 48, 32, wide_load=False),
            QuantCase("awq", "bf16", 5, 128, 64, 64, split_k=1),
            QuantCase("awq", "fp16", 33, 256, 32, 128, seed=1),
            QuantCase("gptq", "fp16", 1, 128, 48, 64, pass_g_idx=False),
            QuantCase("gptq", "bf16", 7, 128, 32, 64, desc_act=True),
            QuantCase("gptq", "fp16", 4, 128, 32, 32, desc_act=True, wide_load=False),
            QuantCase("gptq", "fp16", 20, 256, 32, 128, desc_act=True, split_k=2, seed=2),
            QuantCase("gptq_v2", "fp32", 3, 64, 32, 32, seed=3),
            QuantCase("gptq", "fp16", 2, 64, 32, 32, bits=8, seed=4),
        ]
    cases = []
    shapes = ((1, 4096, 4096), (16, 4096, 1024), (33, 2048, 4096), (128, 4096, 11008), (300, 1024, 2048))
    for i, (fmt, dtype, (m, k, n)) in enumerate(
        (f, d, s) for f in ("awq", "gptq") for d in ("fp16", "bf16") for s in shapes
    ):
        gs = (32, 64, 128)[i % 3]
        cases.append(QuantCase(fmt, dtype, m, k, n, gs, desc_act=fmt == "gptq" and i % 2 == 1, seed=i))
    cases += [
        QuantCase("gptq", "fp16", 1, 4096, 4096, 128, pass_g_idx=False),
        QuantCase("gptq_v2", "bf16", 8, 2048, 2048, 128, desc_act=True),
        QuantCase("gptq", "fp16", 4, 2048, 1024, 128, bits=8),
        QuantCase("awq", "fp32", 3, 1024, 512, 128),
        QuantCase("awq", "bf16", 16, 4096, 4096, 128, wide_load=False),
        QuantCase("gptq", "fp16", 64, 4096, 4096, 128, desc_act=True, wide_load=False),
    ]
    return cases


def _quant_case(case: QuantCase) -> Int4Case:
    dtype = DTYPES[case.dtype]
    scale_dtype = torch.float16 if dtype == torch.float32 else dtype
    if case.fmt == "awq":
        return random_awq_case(case.m, case.k, case.n, case.group_size, scale_dtype, seed=case.seed)
    return random_gptq_case(
        case.m,
        case.k,
        case.n,
        case.group_size,
        scale_dtype,
        desc_act=case.desc_act,
        bits=case.bits,
        zero_offset=1 if case.fmt == "gptq" else 0,
        seed=case.seed,
    )


def _run_quant(case: QuantCase, q: Int4Case, x: torch.Tensor, device: str) -> torch.Tensor:
    from vllm_lite.quantization.triton_int4 import awq_gemm, gptq_gemm

    qweight, qzeros, scales = (t.to(device) for t in (q.qweight, q.qzeros, q.scales))
    if case.fmt == "awq":
        return awq_gemm(
            x.to(device), qweight, qzeros, scales, q.group_size, split_k=case.split_k, wide_load=case.wide_load
        )
    g_idx = q.g_idx.to(device) if case.pass_g_idx else None
    return gptq_gemm(
        x.to(device),
        qweight,
        qzeros,
        scales,
        g_idx,
        case.bits,
        checkpoint_format=case.fmt,
        group_size=q.group_size,
        split_k=case.split_k,
        wide_load=case.wide_load,
    )


def check_quant(case: QuantCase, device: str) -> None:
    """The fused kernel equals x @ W in float64 (W the packed truth) and x @ the reference dequantization."""
    from vllm_lite.quantization.packing import dequantize_awq, dequantize_gptq

    dtype = DTYPES[case.dtype]
    q = _quant_case(case)
    x = q.x.to(dtype)
    out = _run_quant(case, q, x, device)
    assert out.dtype == dtype and out.shape == (case.m, case.n) and out.device.type == torch.device(device).type
    x64 = x.double().to(device)  # references computed where the kernel ran (float64 matmuls are fast on a GPU)
    _close(out, x64 @ q.weight.to(device), dtype, "vs float64 oracle")
    if case.bits == 4:  # the quantization package's reference dequantizers are 4-bit
        qw, qz, s = (t.to(device) for t in (q.qweight, q.qzeros, q.scales))
        if case.fmt == "awq":
            w = dequantize_awq(qw, qz, s, q.group_size, dtype=s.dtype)
        else:
            w = dequantize_gptq(qw, qz, s, q.g_idx.to(device), case.fmt, dtype=s.dtype)
        _close(out, x64 @ w.double(), dtype, "vs packing.dequantize_* reference")


def check_quant_dequantizes_exactly(fmt: str, device: str) -> None:
    """An identity input in float32 returns the kernel's dequantized tile: bit-equal to the reference's."""
    from vllm_lite.quantization.packing import dequantize_awq, dequantize_gptq

    k = 64
    case = QuantCase(fmt, "fp32", k, k, 32, 32, desc_act=fmt == "gptq")
    q = _quant_case(case)
    eye = torch.eye(k, dtype=torch.float32)
    out = _run_quant(case, q, eye, device).cpu()
    if fmt == "awq":
        ref = dequantize_awq(q.qweight, q.qzeros, q.scales, q.group_size, dtype=q.scales.dtype)
    else:
        ref = dequantize_gptq(q.qweight, q.qzeros, q.scales, q.g_idx, fmt, dtype=q.scales.dtype)
    assert torch.equal(out, ref.float()), (
        f"{fmt}: dequantized tile differs from the reference in {int((out != ref.float()).sum())} weights"
    )


def check_gptq_sorted_act_order(device: str) -> None:
    """desc_act rows sorted by group at load time, x's columns gathered to match: the oracle's product."""
    from vllm_lite.quantization.triton_int4 import gptq_gemm, sort_gptq_act_order

    q = random_gptq_case(6, 256, 48, 64, torch.float16, desc_act=True, seed=8)
    sorted_rows = sort_gptq_act_order(q.qweight.to(device), q.g_idx.to(device), 4)
    assert sorted_rows is not None
    qweight, perm = sorted_rows
    x = q.x.to(device)
    out = gptq_gemm(x.index_select(1, perm), qweight, q.qzeros.to(device), q.scales.to(device), None, group_size=64)
    _close(out, x.double() @ q.weight.to(device), torch.float16, "sorted act-order vs float64 oracle")


# ---------------------------------------------------------------------------------------------- all


def all_checks(device: str, full: bool) -> dict[str, Callable[[], None]]:
    """Every LoRA and int4 check by name, bound to a device."""
    checks: dict[str, Callable[[], None]] = {c.name: (lambda c=c: check_lora(c, device)) for c in lora_cases(full)}
    checks["lora-packed-qkv-shared-grouping"] = lambda: check_lora_packed_projections(device)
    checks["lora-no-adapter-and-out-of-table-slots"] = lambda: check_lora_slots_outside_table(device)
    checks.update({c.name: (lambda c=c: check_quant(c, device)) for c in quant_cases(full)})
    checks["awq-dequantizes-bit-exactly"] = lambda: check_quant_dequantizes_exactly("awq", device)
    checks["gptq-desc_act-dequantizes-bit-exactly"] = lambda: check_quant_dequantizes_exactly("gptq", device)
    checks["gptq-desc_act-rows-sorted-by-group"] = lambda: check_gptq_sorted_act_order(device)
    return checks
