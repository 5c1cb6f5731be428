"""Microbenchmark: the int4 (AWQ/GPTQ) and LoRA (SGMV/BGMV) Triton kernels against their torch paths.

On CUDA, per shape and implementation, the median microseconds of a call (CUDA events around a
burst of calls, implementations alternating round by round so clocks and load hit them alike):

- int4 x @ W for a Llama-7B-like projection (K=4096, N=4096 and N=11008, group 128) at M = 1, 16,
  128, 1024: ``awq_gemm`` (and with ``wide_load=False``: one packed word gathered per weight),
  ``gptq_gemm`` (g_idx=None; desc_act g_idx; desc_act rows sorted by group at load time, x's columns
  gathered per call), the reference path
  (``dequantize_awq`` into a half-precision weight, then matmul) and the dense half-precision matmul
  (the bf16/fp16 model this replaces), with the weight bytes each reads per call and GB/s.
- LoRA shrink+expand with 8 adapters (rank 16, hidden 4096 -> 4096), tokens spread over the slots and
  some without an adapter, at T = 1, 16, 64, 256, 2048: the default dispatch, SGMV and BGMV forced,
  ``torch_ops`` (the CPU path), and the base projection x @ W alone for scale. BGMV_MAX_TOKENS in
  vllm_lite/lora/triton_ops.py is where SGMV and BGMV cross: read it off these rows.

Without CUDA only the torch paths run (Triton kernels run on CPU only under the interpreter, which
says nothing about speed), on smaller shapes, and the JSON says so. The last line is the JSON.

    python benchmarks/kernels_int4_lora.py [--rounds 5] [--dtype float16|bfloat16] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Callable, Optional

import torch

from vllm_lite.platform import describe_host
from vllm_lite.testing.lora_int4_oracle import random_awq_case, random_gptq_case

Fn = Callable[[], object]


def _cuda_seconds(fn: Fn, calls: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000.0 / calls


def _cpu_seconds(fn: Fn, min_seconds: float) -> float:
    calls, t0 = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= min_seconds and calls >= 3:
            return elapsed / calls


def interleaved(fns: dict[str, Fn], rounds: int, cuda: bool) -> dict[str, float]:
    """Median microseconds per call of each function, alternating A, B, C, A, B, C, ..."""
    for fn in fns.values():  # warm-up: compiles the Triton kernels, fills allocator caches
        fn()
    calls: dict[str, int] = {}
    if cuda:
        torch.cuda.synchronize()
        for name, fn in fns.items():  # size each burst to about 20 ms
            once = _cuda_seconds(fn, 3)
            calls[name] = max(3, min(2000, int(0.02 / max(once, 1e-7))))
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            samples[name].append(_cuda_seconds(fn, calls[name]) if cuda else _cpu_seconds(fn, 0.05))
    return {name: round(statistics.median(s) * 1e6, 2) for name, s in samples.items()}


def _int4_fns(x: torch.Tensor, awq, gptq, dense: torch.Tensor, device: str) -> dict[str, Fn]:
    from vllm_lite.quantization.packing import dequantize_awq

    to = lambda t: t.to(device)  # noqa: E731
    aq, az, as_ = to(awq.qweight), to(awq.qzeros), to(awq.scales)
    gq, gz, gs, gi = to(gptq.qweight), to(gptq.qzeros), to(gptq.scales), to(gptq.g_idx)
    fns: dict[str, Fn] = {}
    if device == "cuda":
        from vllm_lite.quantization.triton_int4 import awq_gemm, gptq_gemm, sort_gptq_act_order

        sorted_rows = sort_gptq_act_order(gq, gi, gs.shape[0])
        assert sorted_rows is not None
        gq_sorted, perm = sorted_rows
        fns["triton_awq"] = lambda: awq_gemm(x, aq, az, as_, 128)
        fns["triton_awq_gather"] = lambda: awq_gemm(x, aq, az, as_, 128, wide_load=False)
        fns["triton_gptq"] = lambda: gptq_gemm(x, gq, gz, gs, None, group_size=128)
        fns["triton_gptq_desc_act"] = lambda: gptq_gemm(x, gq, gz, gs, gi)
        fns["triton_gptq_desc_act_sorted"] = lambda: gptq_gemm(
            x.index_select(1, perm), gq_sorted, gz, gs, None, group_size=128
        )
    xd = x.to(dense.dtype)
    fns["torch_dequant_then_matmul"] = lambda: xd @ dequantize_awq(aq, az, as_, 128, dtype=dense.dtype)
    fns["torch_dense_matmul"] = lambda: xd @ dense
    return fns


def bench_int4(device: str, dtype: torch.dtype, rounds: int, quick: bool) -> list[dict]:
    cuda = device == "cuda"
    k = 4096 if cuda else 1024
    shapes = [(m, n) for n in ((4096, 11008) if cuda else (1024,)) for m in ((1, 16, 128, 1024) if cuda else (1, 16))]
    if quick:
        shapes = shapes[:2]
    rows = []
    for m, n in shapes:
        awq = random_awq_case(m, k, n, 128, dtype, seed=m)
        gptq = random_gptq_case(m, k, n, 128, dtype, desc_act=True, seed=m)
        dense = awq.weight.to(dtype if cuda else torch.float32).to(device)
        us = interleaved(_int4_fns(awq.x.to(device), awq, gptq, dense, device), rounds, cuda)
        int4_bytes = awq.qweight.numel() * 4 + awq.qzeros.numel() * 4 + awq.scales.numel() * awq.scales.element_size()
        dense_bytes = dense.numel() * dense.element_size()
        row: dict = {"m": m, "k": k, "n": n, "group_size": 128, "us": us}
        row["weight_mb"] = {"int4": round(int4_bytes / 2**20, 2), "dense": round(dense_bytes / 2**20, 2)}
        row["weight_gb_per_s"] = {
            name: round((dense_bytes if name == "torch_dense_matmul" else int4_bytes) / (t * 1e-6) / 1e9, 2)
            for name, t in us.items()
        }
        row["speedup_vs_dense"] = {name: round(us["torch_dense_matmul"] / t, 3) for name, t in us.items()}
        rows.append(row)
        print(f"int4 m={m} k={k} n={n}: " + ", ".join(f"{a} {b} us" for a, b in us.items()), flush=True)
    return rows


def _lora_fns(x, a, b, base_w, token_slots, y, device: str) -> dict[str, Fn]:
    from vllm_lite.lora import torch_ops

    def torch_path() -> None:
        torch_ops.lora_expand(y, torch_ops.lora_shrink(x, a, token_slots), b, token_slots)

    fns: dict[str, Fn] = {}
    if device == "cuda":
        from vllm_lite.lora import triton_ops

        def triton_path(method: Optional[str]) -> Fn:
            def run() -> None:
                buf = triton_ops.lora_shrink(x, a, token_slots, method=method)
                triton_ops.lora_expand(y, buf, b, token_slots, method=method)

            return run

        fns = {"triton_auto": triton_path(None), "triton_sgmv": triton_path("sgmv"), "triton_bgmv": triton_path("bgmv")}
    fns["torch_ops"] = torch_path
    fns["base_projection_only"] = lambda: x @ base_w.T
    return fns


def bench_lora(device: str, dtype: torch.dtype, rounds: int, quick: bool) -> list[dict]:
    cuda = device == "cuda"
    hidden, out, rank, slots = (4096, 4096, 16, 8) if cuda else (1024, 1024, 16, 8)
    token_counts = (1, 16, 64, 256, 2048) if cuda else (1, 16, 256)
    if quick:
        token_counts = token_counts[:2]
    wdtype = dtype if cuda else torch.float32
    g = torch.Generator().manual_seed(0)
    a = (torch.randn(slots, rank, hidden, generator=g) / hidden**0.5).to(wdtype).to(device)
    b = (torch.randn(slots, out, rank, generator=g) * 0.01).to(wdtype).to(device)
    base_w = (torch.randn(out, hidden, generator=g) / hidden**0.5).to(wdtype).to(device)
    rows = []
    for t in token_counts:
        x = torch.randn(t, hidden, generator=g).to(wdtype).to(device)
        token_slots = torch.randint(-1, slots, (t,), generator=g, dtype=torch.int32).to(device)
        y = torch.zeros(t, out, dtype=wdtype, device=device)
        us = interleaved(_lora_fns(x, a, b, base_w, token_slots, y, device), rounds, cuda)
        rows.append({"tokens": t, "hidden": hidden, "out": out, "rank": rank, "slots": slots, "us": us})
        print(f"lora T={t}: " + ", ".join(f"{k} {v} us" for k, v in us.items()), flush=True)
    return rows


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    p.add_argument("--device", default=None, help="cuda (default when present) or cpu (torch paths only)")
    p.add_argument("--quick", action="store_true", help="two shapes per kernel (a smoke run)")
    args = p.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but torch sees no CUDA device")
    dtype = getattr(torch, args.dtype)
    load_start = os.getloadavg()
    result = {
        "device": device,
        "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None,
        "dtype": args.dtype,
        "note": None
        if device == "cuda"
        else "no CUDA: torch paths only (Triton kernels run on CPU only under the interpreter), float32, small shapes",
        "host": describe_host(),
        "loadavg_start": load_start,
    }
    with torch.inference_mode():
        result["int4"] = bench_int4(device, dtype, args.rounds, args.quick)
        result["lora"] = bench_lora(device, dtype, args.rounds, args.quick)
    result["loadavg_end"] = os.getloadavg()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
