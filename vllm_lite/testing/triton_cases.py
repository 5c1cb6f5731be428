"""Triton kernel checks against the float64 oracle, shared by the CPU interpreter run and the native CUDA run.

Triton picks the interpreter when a kernel is decorated, i.e. when the backend is first imported,
so the CPU cases must run in a process whose environment had TRITON_INTERPRET=1 from the start.
`python -m vllm_lite.testing.triton_cases --device cpu` is that process: tests start it with the
variable set in the child's environment only and read the one JSON line it prints (case name ->
null or the failure text). On CUDA the same checks run in-process, compiled. `--suite lora_int4`
runs the LoRA and int4 kernels' checks (vllm_lite/testing/triton_lora_int4_cases.py) instead of
the attention ones, so each test module pays only for its own kernels under the interpreter.

Tolerances against the float64 oracle: float32 1e-5; bfloat16 2e-2 absolute and relative. On
CUDA, bf16 probabilities are rounded to bf16 before the P·V tensor-core dot; a float32 simulation
of that rounding stays within ~0.016 absolute and 0.0035 beyond the relative term on these cases.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch

from vllm_lite import envs
from vllm_lite.testing.attention_oracle import (
    poison_blocks_before_window,
    random_attention_case,
    reference_paged_attention,
)
from vllm_lite.testing.triton_interpreter import run_named_checks

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
NUM_KV_HEADS = 2
# Decode without context, decodes with context, a first prefill chunk, a later chunk with context.
MIXED = ((1, 1, 5, 1, 9), (1, 40, 5, 70, 30))
# The same plus a 40-token chunk at offset 35: several query tiles for one request.
MIXED_LONG = ((1, 1, 5, 1, 9, 40), (1, 40, 5, 70, 30, 75))
# One request: Triton specialises an integer argument equal to 1 (num_reqs) to a constant.
SINGLE = ((7,), (20,))


@dataclass(frozen=True)
class AttentionCase:
    """One kernel configuration and one mixed prefill/decode batch."""

    dtype: str
    block_size: int
    head_size: int
    gqa: int
    tile_n: int = 16
    batch: tuple[tuple[int, ...], tuple[int, ...]] = MIXED
    seed: int = 0
    window: Optional[int] = None  # sliding window; blocks before it hold NaN (they may be freed)
    soft_cap: Optional[float] = None

    @property
    def name(self) -> str:
        extra = (f"-w{self.window}" if self.window else "") + (f"-cap{self.soft_cap:g}" if self.soft_cap else "")
        return (
            f"attn-{self.dtype}-bs{self.block_size}-d{self.head_size}-gqa{self.gqa}"
            f"-tile{self.tile_n}-q{sum(self.batch[0])}-s{self.seed}{extra}"
        )


def attention_cases(full: bool) -> list[AttentionCase]:
    """The interpreter's modest set (it runs each program in Python), or the full matrix for compiled kernels."""
    if not full:
        return [
            AttentionCase("float32", 16, 64, 1),
            AttentionCase("float32", 1, 32, 2),
            AttentionCase("float32", 32, 128, 4),
            AttentionCase("float32", 16, 32, 3),
            AttentionCase("float32", 16, 32, 4, tile_n=32, batch=MIXED_LONG, seed=7),
            AttentionCase("bfloat16", 16, 64, 2),
            AttentionCase("bfloat16", 32, 128, 1),
            AttentionCase("bfloat16", 16, 64, 4, batch=SINGLE),
            AttentionCase("float32", 16, 32, 2, batch=MIXED_LONG, window=20),
            AttentionCase("float32", 8, 32, 1, batch=MIXED_LONG, seed=3, window=7, soft_cap=0.5),
        ]
    cases = []
    tiles = (16, 32, 64)
    for i, (dtype, block_size, head_size, gqa) in enumerate(
        (dt, bs, hs, g) for dt in DTYPES for bs in (1, 16, 32) for hs in (32, 64, 96, 128) for g in (1, 2, 4, 8)
    ):
        cases.append(AttentionCase(dtype, block_size, head_size, gqa, tiles[i % 3], MIXED_LONG, seed=i))
    cases += [AttentionCase(dt, 16, 64, 4, batch=SINGLE) for dt in DTYPES]
    cases += [
        AttentionCase(dt, bs, 64, g, tiles[i % 3], MIXED_LONG, seed=i, window=w, soft_cap=cap)
        for i, (dt, bs, g, w, cap) in enumerate(
            (dt, bs, g, w, cap)
            for dt in DTYPES
            for bs in (1, 16)
            for g in (1, 4)
            for w, cap in ((1, None), (20, None), (33, 0.5), (None, 0.5))
        )
    ]
    return cases


def _to_device(device: str, query: torch.Tensor, cache: torch.Tensor, md):
    if device == "cpu":
        return query, cache, md
    md = replace(
        md,
        query_start_loc=md.query_start_loc.to(device),
        seq_lens=md.seq_lens.to(device),
        block_table=md.block_table.to(device),
        slot_mapping=md.slot_mapping.to(device),
    )
    return query.to(device), cache.to(device), md


def _close(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(out.double().cpu(), expected.double().cpu(), atol=TOL[dtype], rtol=TOL[dtype])


def check_attention(case: AttentionCase, device: str) -> None:
    """The paged-attention kernel on one mixed batch equals the float64 oracle."""
    from vllm_lite.worker.attention.triton_attn import TritonBackend

    dtype = DTYPES[case.dtype]
    query_lens, seq_lens = case.batch
    query, cache, md = random_attention_case(
        list(query_lens),
        list(seq_lens),
        NUM_KV_HEADS * case.gqa,
        NUM_KV_HEADS,
        case.head_size,
        case.block_size,
        dtype,
        seed=case.seed,
    )
    scale = 1.0 / math.sqrt(case.head_size)
    expected = reference_paged_attention(query, cache, md, scale, case.window, case.soft_cap)
    if case.window:
        cache = poison_blocks_before_window(cache, md, case.window)
    query, cache, md = _to_device(device, query, cache, md)
    out = TritonBackend(tile_n=case.tile_n).forward(query, cache, md, scale, case.window, case.soft_cap)
    assert out.shape == query.shape and out.dtype == dtype and out.device == query.device
    _close(out, expected, dtype)


def check_agrees_with_torch_ref(device: str) -> None:
    """Many query tiles for one request: the kernel agrees with the PyTorch backend as well as the oracle."""
    from vllm_lite.worker.attention.torch_ref import TorchRefBackend
    from vllm_lite.worker.attention.triton_attn import TritonBackend

    # 40 prefill tokens x 4 heads per KV head: BLOCK_M 64 -> 16 tokens per tile, 3 tiles.
    query, cache, md = random_attention_case([40, 1], [75, 50], 8, 2, 32, 16, torch.float32, seed=7)
    query, cache, md = _to_device(device, query, cache, md)
    out = TritonBackend(tile_n=32).forward(query, cache, md, 0.2)
    _close(out, reference_paged_attention(query, cache, md, 0.2), torch.float32)
    _close(out, TorchRefBackend().forward(query, cache, md, 0.2), torch.float32)


def check_write_kv(device: str) -> None:
    """The KV writer puts strided rows at their slots bit-exactly and skips negative (padding) slots."""
    from vllm_lite.worker.attention.triton_attn import TritonBackend

    g = torch.Generator().manual_seed(2)
    cache = torch.randn(2, 4, 8, 2, 32, generator=g).to(torch.bfloat16)
    fused = torch.randn(4, 3 * 64, generator=g).to(torch.bfloat16)  # strided rows, like a qkv projection
    key, value = fused[:, 64:128].view(4, 2, 32), fused[:, 128:].view(4, 2, 32)
    slots = torch.tensor([3, -1, 31, 8])
    expected = cache.clone()
    keep = slots >= 0
    expected[0].view(-1, 2, 32)[slots[keep]] = key[keep]
    expected[1].view(-1, 2, 32)[slots[keep]] = value[keep]
    cache, key, value, slots = (t.to(device) for t in (cache, key, value, slots))
    TritonBackend().write_kv(key, value, cache, slots)
    assert torch.equal(cache.cpu(), expected), "write_kv changed the cache differently from the reference"


def check_rejects_bad_shapes(device: str) -> None:
    """Heads that do not divide and a tile that is not a power of two raise ValueError, not a kernel fault."""
    from vllm_lite.worker.attention.triton_attn import TritonBackend

    query, cache, md = random_attention_case([2], [4], 3, 2, 32, 16, torch.float32)
    query, cache, md = _to_device(device, query, cache, md)
    for make, pattern in (
        (lambda: TritonBackend().forward(query, cache, md, 1.0), "num_kv_heads"),
        (lambda: TritonBackend(tile_n=24), "tile_n"),
    ):
        try:
            make()
        except ValueError as e:
            assert pattern in str(e), f"ValueError without {pattern!r}: {e}"
        else:
            raise AssertionError(f"no ValueError naming {pattern!r}")


def all_checks(device: str, full: bool) -> dict[str, Callable[[], None]]:
    """Every check by name, bound to a device."""
    checks: dict[str, Callable[[], None]] = {
        c.name: (lambda c=c: check_attention(c, device)) for c in attention_cases(full)
    }
    checks["many-query-tiles-vs-torch-ref"] = lambda: check_agrees_with_torch_ref(device)
    checks["write-kv"] = lambda: check_write_kv(device)
    checks["rejects-bad-shapes"] = lambda: check_rejects_bad_shapes(device)
    return checks


SUITES = ("attention", "lora_int4")


def suite_checks(suite: str, device: str, full: bool) -> dict[str, Callable[[], None]]:
    """The checks of one suite: "attention" (this module) or "lora_int4" (LoRA and int4 kernels)."""
    if suite == "attention":
        return all_checks(device, full)
    if suite == "lora_int4":
        from vllm_lite.testing import triton_lora_int4_cases

        return triton_lora_int4_cases.all_checks(device, full)
    raise ValueError(f"suite must be one of {SUITES}, got {suite!r}")


def run_checks(device: str, full: bool, suite: str = "attention") -> dict[str, Optional[str]]:
    """Run every check; name -> None when it passed, else its failure text (one failure never hides the rest)."""
    return run_named_checks(suite_checks(suite, device, full))


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--full", action="store_true", help="the full matrix (default: the interpreter's set)")
    parser.add_argument("--suite", default="attention", choices=SUITES, help="which kernels' checks to run")
    args = parser.parse_args(argv)
    if args.device == "cpu" and not envs.TRITON_INTERPRET:
        parser.error("--device cpu needs TRITON_INTERPRET=1 in this process's environment")
    results = run_checks(args.device, args.full, args.suite)
    import triton

    print(json.dumps({"triton": triton.__version__, "device": args.device, "suite": args.suite, "results": results}))
    return 0 if all(v is None for v in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
