"""Microbenchmark: paged attention per call -- the C++ kernel's key loops (portable, AVX2, AVX-512
where built) against the PyTorch reference backend, interleaved in one process.

Prints one JSON line: per batch and implementation the median microseconds of a call, GFLOP/s
(4 * head_size flops per visible (query head, key) pair: QK^T and PV), and each implementation's
speed-up over the portable loop and over the torch reference, plus the KV write (write_kv) per call.
Rounds alternate the implementations (A, B, C, A, B, C, ...), so load on a shared host hits them
alike: read the ratios, and the load average printed at start and end.

Batches (the bench checkpoint's attention: 12 query heads / 4 KV heads, head 64):
decode_32x300 (32 sequences of 280-320 tokens, one new token each: the offline workload's decode
step), prefill_4x512 (four 512-token prompts from scratch) and prefill_NxM (N prompts of 32-256 tokens, M on
average, up to 2,048 tokens from scratch: a vs_vllm.py prefill step).
--shape moe: moe_throughput.py's checkpoint (8 query heads / 2 KV heads, head 32) at its decode step,
decode_64x240 (64 sequences of 160-320 tokens), and the prefill batches.

    python benchmarks/attention.py [--threads 1] [--dtype float32|bfloat16] [--block-size 16] [--rounds 7]
        [--shape bench|moe] [--impls avx512,portable]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from typing import Callable

import torch

from vllm_lite.platform import describe_host
from vllm_lite.testing.paged import make_attention_metadata, random_block_tables
from vllm_lite.worker.attention.backend import AttentionBackend, AttentionMetadata
from vllm_lite.worker.attention.cpu_native import CpuNativeBackend
from vllm_lite.worker.attention.torch_ref import TorchRefBackend

HEADS, KV_HEADS, HEAD_SIZE = 12, 4, 64  # the bench checkpoint's attention
# (heads, KV heads, head size) per --shape: the bench checkpoint's, and moe_throughput.py's moe-small Mixtral.
SHAPES = {"bench": (HEADS, KV_HEADS, HEAD_SIZE), "moe": (8, 2, 32)}


def build_batch(
    query_lens: list[int],
    seq_lens: list[int],
    heads: int,
    kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    tables, num_blocks = random_block_tables(seq_lens, block_size, seed=0)
    md = make_attention_metadata(query_lens, seq_lens, tables, block_size)
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_size, generator=g).to(dtype)
    query = torch.randn(md.num_actual_tokens, heads, head_size, generator=g).to(dtype)
    return query, cache, md


def attention_gflop(query_lens: list[int], seq_lens: list[int], heads: int, head_size: int) -> float:
    """Flops of causal attention over the visible keys: 2*D for QK^T and 2*D for PV per (head, key)."""
    pairs = 0
    for q, s in zip(query_lens, seq_lens):
        ctx = s - q
        pairs += q * ctx + q * (q + 1) // 2  # query token i sees ctx + i + 1 keys
    return 4.0 * head_size * heads * pairs / 1e9


_EVICT = torch.zeros(0)


def evict_caches() -> None:
    """Writes a 64 MiB buffer, so the next call reads its KV cache from DRAM as in an engine step (whose expert
    and linear weights pass through the caches between two attention calls)."""
    global _EVICT
    if _EVICT.numel() == 0:
        _EVICT = torch.empty(16 << 20, dtype=torch.float32)
    _EVICT.fill_(1.0)


def time_call(fn: Callable[[], object], min_seconds: float, cold: bool = False) -> float:
    """Mean seconds per call over enough calls to fill min_seconds (at least 3); cold: caches evicted before
    each call, outside the timed span."""
    calls, total, start = 0, 0.0, time.perf_counter()
    while True:
        if cold:
            evict_caches()
        t0 = time.perf_counter()
        fn()
        total += time.perf_counter() - t0
        calls += 1
        if time.perf_counter() - start >= min_seconds and calls >= 3:
            return total / calls


def interleaved(
    fns: dict[str, Callable[[], object]], rounds: int, min_seconds: float, cold: bool = False
) -> dict[str, float]:
    """Median seconds per call of each function, the functions alternating round by round."""
    for fn in fns.values():  # warm-up
        fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            samples[name].append(time_call(fn, min_seconds, cold))
    return {name: statistics.median(s) for name, s in samples.items()}


def bench_batch(
    batch_name: str,
    qlens: list[int],
    slens: list[int],
    backends: dict[str, AttentionBackend],
    native: dict[str, CpuNativeBackend],
    args: argparse.Namespace,
    dtype: torch.dtype,
) -> dict[str, float]:
    """Times one batch on every backend (interleaved) and its KV write; returns the JSON fields."""
    heads, kv_heads, head_size = SHAPES[args.shape]
    query, cache, md = build_batch(qlens, slens, heads, kv_heads, head_size, args.block_size, dtype)
    scale = 1.0 / math.sqrt(head_size)
    gflop = attention_gflop(qlens, slens, heads, head_size)
    fns = {name: (lambda b=b: b.forward(query, cache, md, scale)) for name, b in backends.items()}
    times = interleaved(fns, args.rounds, args.seconds, args.cold)
    out: dict[str, float] = {}
    for name, sec in times.items():
        out[f"{batch_name}_{name}_us"] = round(sec * 1e6, 1)
        out[f"{batch_name}_{name}_gflops"] = round(gflop / sec, 2)
    for name in (n for n in native if n != "portable"):
        if "portable" in times:
            out[f"{batch_name}_{name}_vs_portable"] = round(times["portable"] / times[name], 2)
        if "torch_ref" in times:
            out[f"{batch_name}_{name}_vs_torch_ref"] = round(times["torch_ref"] / times[name], 2)
    if "torch_ref" in times and "portable" in times:
        out[f"{batch_name}_portable_vs_torch_ref"] = round(times["torch_ref"] / times["portable"], 2)
    # The KV write of this batch's new tokens (what a step writes before attending).
    n = query.shape[0]
    key = torch.randn(n, kv_heads, head_size).to(dtype)
    value = torch.randn(n, kv_heads, head_size).to(dtype)
    slots = torch.randperm(cache.shape[1] * args.block_size)[:n]
    write = next(iter(native.values()))
    sec = interleaved({"write_kv": lambda: write.write_kv(key, value, cache, slots)}, args.rounds, args.seconds)
    out[f"{batch_name}_write_kv_us"] = round(sec["write_kv"] * 1e6, 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="float32")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds (the median is reported)")
    ap.add_argument("--seconds", type=float, default=0.3, help="minimum timed duration per round and implementation")
    ap.add_argument("--skip-torch", action="store_true", help="leave out the (slow) torch reference")
    ap.add_argument("--cold", action="store_true", help="evict the caches before each timed call (KV from DRAM)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="bench", help="attention shape and decode batch")
    ap.add_argument("--impls", default=None, help="comma-separated key loops to time (default: every one built)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    heads, kv_heads, head_size = SHAPES[args.shape]

    gen = torch.Generator().manual_seed(1)
    if args.shape == "moe":
        decode_name, decode_ctx = "decode_64x240", (160 + torch.randint(0, 161, (64,), generator=gen)).tolist()
    else:
        decode_name, decode_ctx = "decode_32x300", (280 + torch.randint(0, 41, (32,), generator=gen)).tolist()
    # A vs_vllm.py prefill step: 2,048 prompt tokens of 32-256-token prompts from scratch.
    mix: list[int] = []
    for n in (32 + torch.randint(0, 225, (32,), generator=gen)).tolist():
        if sum(mix) + n > 2048:
            break
        mix.append(n)
    batches = {
        decode_name: ([1] * len(decode_ctx), decode_ctx),
        "prefill_4x512": ([512] * 4, [512] * 4),
        f"prefill_{len(mix)}x{sum(mix) // len(mix)}": (mix, mix),
    }
    built = CpuNativeBackend().built_impls()
    impls = [i for i in built if args.impls is None or i in args.impls.split(",")]
    native = {impl: CpuNativeBackend(impl) for impl in impls}
    backends: dict[str, AttentionBackend] = {**native}
    if not args.skip_torch:
        backends["torch_ref"] = TorchRefBackend()
    result: dict[str, object] = {
        "benchmark": "attention",
        "host": describe_host(),
        "load_avg_at_start": [round(x, 2) for x in os.getloadavg()],
        "dtype": args.dtype,
        "threads": args.threads,
        "shape": args.shape,
        "cold": args.cold,
        "block_size": args.block_size,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_size": head_size,
        "rounds": args.rounds,
        "key_loops": {impl: b.key_loop(head_size) for impl, b in native.items()},
    }
    for batch_name, (qlens, slens) in batches.items():
        result.update(bench_batch(batch_name, qlens, slens, backends, native, args, dtype))
    result["load_avg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
