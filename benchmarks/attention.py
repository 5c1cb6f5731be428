"""Microbenchmark: paged attention per call, PyTorch reference vs the native CPU kernel.

Prints one JSON line. Two batches: decode-heavy (64 sequences x ~300 context, one token each)
and prefill (a few long prompts from scratch). 12 query heads / 4 KV heads, head 64, bf16.

    python benchmarks/attention.py [--threads N] [--dtype bfloat16|float32] [--block-size 16]
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

from vllm_lite.testing.paged import make_attention_metadata, random_block_tables
from vllm_lite.worker.attention.backend import AttentionBackend, AttentionMetadata
from vllm_lite.worker.attention.cpu_native import CpuNativeBackend
from vllm_lite.worker.attention.torch_ref import TorchRefBackend


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


def time_us(
    backend: AttentionBackend, query: torch.Tensor, cache: torch.Tensor, md: AttentionMetadata, min_seconds: float = 1.0
) -> float:
    """Median-free simple mean over enough calls to fill min_seconds, after warm-up."""
    scale = 1.0 / math.sqrt(query.shape[-1])
    for _ in range(3):
        backend.forward(query, cache, md, scale)
    calls, start = 0, time.perf_counter()
    while True:
        backend.forward(query, cache, md, scale)
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds and calls >= 5:
            return elapsed / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=1.0, help="minimum timed duration per measurement")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    heads, kv_heads, head_size = 12, 4, 64

    gen = torch.Generator().manual_seed(1)
    decode_ctx = (280 + torch.randint(0, 41, (64,), generator=gen)).tolist()
    batches = {
        "decode_64x300": ([1] * 64, decode_ctx),
        "prefill_4x512": ([512] * 4, [512] * 4),
    }
    backends: dict[str, AttentionBackend] = {"torch_ref": TorchRefBackend(), "cpu_native": CpuNativeBackend()}
    result: dict[str, object] = {
        "benchmark": "attention",
        "dtype": args.dtype,
        "threads": args.threads,
        "block_size": args.block_size,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_size": head_size,
    }
    for batch_name, (qlens, slens) in batches.items():
        query, cache, md = build_batch(qlens, slens, heads, kv_heads, head_size, args.block_size, dtype)
        times = {name: time_us(b, query, cache, md, args.seconds) for name, b in backends.items()}
        for name, us in times.items():
            result[f"{batch_name}_{name}_us"] = round(us, 1)
        result[f"{batch_name}_speedup"] = round(times["torch_ref"] / times["cpu_native"], 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
