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

``--lora-fused`` (CUDA only; runs nothing else) times one LoRA'd projection's BGMV delta as a decode step's CUDA
graph holds it, for the 100M Qwen2's four projections (qkv 768 -> 768|256|256, o 768 -> 768, gate_up 768 ->
3072|3072, down 3072 -> 768; 8 adapters of rank 16, bfloat16, tokens round robin over the slots) at 1, 8, 16, 32,
64 and 256 tokens: ``add_lora_bgmv`` in two launches (``two``) against the fused single launch with the module's
tiles (``fused``) and other tiles (``fused_n128`` ...), and the base projection (``base``) for scale. Each way is
captured 20 times in a row in one graph; median microseconds per call over interleaved rounds of replays. Per
token count it sums the four projections (``layer_us``, what one decoder layer adds) and suggests
FUSED_MAX_TOKENS: the largest count up to which the fused launch beats the two at every count. Under a minute:

    python benchmarks/kernels_int4_lora.py --lora-fused
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


QWEN2_100M_PROJECTIONS = {  # name: (input size, the fused sub-projections' output sizes)
    "qkv": (768, [768, 256, 256]),
    "o": (768, [768]),
    "gate_up": (768, [3072, 3072]),
    "down": (3072, [768]),
}
FUSED_TOKENS = (1, 8, 16, 32, 64, 256)
FUSED_VARIANTS = {  # add_lora_bgmv's fused tiles and warps; "fused" is the module's defaults (FUSED_*)
    "fused": {},
    "fused_n128": dict(block_n=128),
    "fused_n512": dict(block_n=512),
    "fused_k512": dict(block_k=512),
    "fused_k256_w4": dict(block_k=256, num_warps=4),
    "fused_w4": dict(num_warps=4),
}
GRAPH_CALLS = 20  # calls captured back to back in one graph


def _graph_of(fn: Fn) -> "torch.cuda.CUDAGraph":
    """GRAPH_CALLS calls of fn captured in one CUDA graph (compiled and warmed on a side stream first)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def graph_interleaved(fns: dict[str, Fn], rounds: int, replays: int = 10) -> dict[str, float]:
    """Median microseconds per call of each function replayed from a CUDA graph, ways alternating round by round."""
    graphs = {name: _graph_of(fn) for name, fn in fns.items()}
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, graph in graphs.items():
            samples[name].append(_cuda_seconds(graph.replay, replays) / GRAPH_CALLS)
    return {name: round(statistics.median(s) * 1e6, 2) for name, s in samples.items()}


def suggest_fused_max_tokens(layer_us: dict[int, dict[str, float]], way: str = "fused") -> int:
    """The largest token count up to which ``way`` took less time than ``two`` at every count measured (0: none)."""
    best = 0
    for t in sorted(layer_us):
        if layer_us[t][way] >= layer_us[t]["two"]:
            break
        best = t
    return best


def _fused_case(
    t: int, d_in: int, outs: list[int], slots: int, rank: int, g: torch.Generator, device: str = "cuda"
) -> tuple:
    """One projection at t tokens (round robin over the slots): its ways to time, and the fused launch's largest
    difference from the two launches relative to their largest output (bfloat16, one call each on zeros)."""
    from vllm_lite.lora import triton_ops

    dtype = torch.bfloat16
    a = (torch.randn(slots, len(outs) * rank, d_in, generator=g) / d_in**0.5).to(dtype).to(device)
    bs = [(torch.randn(slots, o, rank, generator=g) * 0.01).to(dtype).to(device) for o in outs]
    base_w = (torch.randn(sum(outs), d_in, generator=g) / d_in**0.5).to(dtype).to(device)
    x = torch.randn(t, d_in, generator=g).to(dtype).to(device)
    token_slots = (torch.arange(t, dtype=torch.int32) % slots).to(device)
    offsets = [sum(outs[:i]) for i in range(len(outs))]
    y = torch.zeros(t, sum(outs), dtype=dtype, device=device)

    def way(**kw) -> Fn:
        def run() -> None:
            assert triton_ops.add_lora_bgmv(y, x, a, bs, offsets, token_slots, **kw)

        return run

    fns: dict[str, Fn] = {"two": way(fused=False)}
    fns.update({v: way(fused=True, **kw) for v, kw in FUSED_VARIANTS.items()})
    fns["base"] = lambda: torch.nn.functional.linear(x, base_w)
    y_two, y_fused = torch.zeros_like(y), torch.zeros_like(y)
    triton_ops.add_lora_bgmv(y_two, x, a, bs, offsets, token_slots, fused=False)
    triton_ops.add_lora_bgmv(y_fused, x, a, bs, offsets, token_slots, fused=True)
    diff = float((y_two.float() - y_fused.float()).abs().max() / y_two.float().abs().max().clamp_min(1e-6))
    return fns, diff


def bench_lora_fused(rounds: int, tokens: tuple[int, ...] = FUSED_TOKENS) -> dict:
    """The fused BGMV launch against the two launches on the 100M Qwen2's projections, in CUDA graphs."""
    from vllm_lite.lora import triton_ops

    rank, slots = 16, 8
    g = torch.Generator().manual_seed(0)
    rows, layer_us = [], {}
    for t in tokens:
        layer: dict[str, float] = {}
        for name, (d_in, outs) in QWEN2_100M_PROJECTIONS.items():
            fns, diff = _fused_case(t, d_in, outs, slots, rank, g)
            us = graph_interleaved(fns, rounds)
            for k, v in us.items():
                layer[k] = round(layer.get(k, 0.0) + v, 2)
            rows.append({"tokens": t, "proj": name, "in": d_in, "outs": outs, "us": us, "fused_vs_two_rel": diff})
            print(f"lora-fused T={t} {name}: " + ", ".join(f"{k} {v} us" for k, v in us.items()), flush=True)
        layer_us[t] = layer
    lora_ways = [k for k in next(iter(layer_us.values())) if k != "base"]
    best = {t: min(lora_ways, key=lambda k: layer_us[t][k]) for t in layer_us}
    return {
        "model": "qwen2-100m projections (hidden 768, 12 heads, 4 KV heads, intermediate 3072)",
        "rank": rank,
        "slots": slots,
        "dtype": "bfloat16",
        "graph_calls": GRAPH_CALLS,
        "module_tiles": {
            "FUSED_BLOCK_N": triton_ops.FUSED_BLOCK_N,
            "FUSED_BLOCK_K": triton_ops.FUSED_BLOCK_K,
            "FUSED_NUM_WARPS": triton_ops.FUSED_NUM_WARPS,
        },
        "fused_max_tokens_now": triton_ops.FUSED_MAX_TOKENS,
        "variants": FUSED_VARIANTS,
        "rows": rows,
        "layer_us": {str(t): v for t, v in layer_us.items()},
        "fused_over_two_layer": {str(t): round(v["fused"] / v["two"], 3) for t, v in layer_us.items()},
        "best_way_layer": {str(t): v for t, v in best.items()},
        "suggested_fused_max_tokens": suggest_fused_max_tokens(layer_us),
        "suggested_fused_max_tokens_by_variant": {v: suggest_fused_max_tokens(layer_us, v) for v in FUSED_VARIANTS},
    }


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    p.add_argument("--device", default=None, help="cuda (default when present) or cpu (torch paths only)")
    p.add_argument("--quick", action="store_true", help="two shapes per kernel (a smoke run)")
    p.add_argument(
        "--lora-fused",
        action="store_true",
        help="CUDA: only the fused BGMV LoRA launch against the two launches (100M Qwen2 projections, CUDA graphs)",
    )
    args = p.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but torch sees no CUDA device")
    if args.lora_fused:
        if device != "cuda":
            p.error("--lora-fused times the Triton kernels in CUDA graphs: it needs a CUDA device")
        load_start = os.getloadavg()
        with torch.inference_mode():
            fused = bench_lora_fused(args.rounds)
        result = {"device": device, "gpu": torch.cuda.get_device_name(0), "host": describe_host()}
        result.update(loadavg_start=load_start, lora_fused=fused, loadavg_end=os.getloadavg())
        print(json.dumps(result))
        return 0
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
