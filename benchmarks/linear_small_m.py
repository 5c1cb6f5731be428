"""Microbenchmark: bf16 linear at 1-16 rows -- oneDNN's prepacked GEMM against vllm-lite's AVX512-BF16 kernel.

What a decode step of the bench Qwen2 model (hidden 768, 12 layers) runs: its 49 weight shapes
(12 x qkv 1280x768, o_proj 768x768, gate_up 6144x768, down 768x3072, plus the 32000x768 LM head), each a
distinct random tensor (256 MB in all), so nothing stays in cache between calls, as in a real step.
One "sweep" runs all 49 linears at the given row count; per row count and thread count the two paths
are timed in interleaved rounds and the median sweep time is kept:

- onednn: torch.ops.mkldnn._linear_pointwise over mkldnn._reorder_linear_weight (what cpu_prepack
  runs for bf16 without the kernel);
- kernel: torch.ops.vllm_lite.bf16_linear_small_m over cpu_prepack.block_weight (csrc/bf16_small_m.cpp).

Prints one JSON line: the host, load averages, and per thread count and row count both times (ms per
sweep), the speed-up (onednn / kernel) and the weight bandwidth (GB/s), plus `wins_up_to`, the largest row
count up to which the kernel won at every row count. Where the kernel is not built (no AVX512-BF16) only
oneDNN is timed.

    python benchmarks/linear_small_m.py [--rows 1-16] [--threads 1,2] [--rounds 5] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Callable

import torch

from vllm_lite.platform import describe_host
from vllm_lite.worker.models import cpu_prepack

# (out_features N, in_features K) of one layer of the bench checkpoint; 12 layers, then the LM head.
LAYER = [(1280, 768), (768, 768), (6144, 768), (768, 3072)]
SHAPES = LAYER * 12 + [(32000, 768)]


def parse_rows(spec: str) -> list[int]:
    rows: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        rows.extend(range(int(lo), int(hi or lo) + 1))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1-16", help="row counts: 1-16 or 1,2,4,8")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=3, help="sweeps per timed sample")
    args = ap.parse_args()

    kernel = cpu_prepack.small_m_kernel_available()
    g = torch.Generator().manual_seed(0)
    weights = []
    for n, k in SHAPES:
        w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 64)
        weights.append((n, k, packed, cpu_prepack.block_weight(w) if kernel else None))
    bytes_per_sweep = sum(2 * n * k for n, k in SHAPES)

    def onednn(xs: list[torch.Tensor]) -> None:
        for (_, _, packed, _), x in zip(weights, xs):
            torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

    def own(xs: list[torch.Tensor]) -> None:
        for (n, _, _, blocked), x in zip(weights, xs):
            torch.ops.vllm_lite.bf16_linear_small_m(x, blocked, n, None)

    paths: dict[str, Callable[[list[torch.Tensor]], None]] = {"onednn": onednn}
    if kernel:
        paths["kernel"] = own
    result: dict[str, object] = {
        "benchmark": "linear_small_m_bf16",
        "host": describe_host(),
        "kernel_built": kernel,
        "load_avg_at_start": [round(x, 2) for x in os.getloadavg()],
        "weights_mb": round(bytes_per_sweep / 1e6),
        "rounds": args.rounds,
        "reps": args.reps,
    }
    before = torch.get_num_threads()
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        per_rows: dict[str, object] = {}
        wins_up_to = 0
        for rows in parse_rows(args.rows):
            by_k = {k: torch.randn(rows, k, generator=g).bfloat16() for k in {k for _, k in SHAPES}}
            xs = [by_k[k] for _, k in SHAPES]
            samples: dict[str, list[float]] = {name: [] for name in paths}
            for fn in paths.values():
                fn(xs)  # warm-up
            for _ in range(args.rounds):
                for name, fn in paths.items():
                    start = time.perf_counter()
                    for _ in range(args.reps):
                        fn(xs)
                    samples[name].append((time.perf_counter() - start) / args.reps)
            row: dict[str, object] = {}
            for name, s in samples.items():
                sec = statistics.median(s)
                row[f"{name}_ms"] = round(sec * 1e3, 2)
                row[f"{name}_gbs"] = round(bytes_per_sweep / sec / 1e9, 1)
            if kernel:
                row["speedup"] = round(row["onednn_ms"] / row["kernel_ms"], 2)
                if row["speedup"] > 1.0 and wins_up_to == rows - 1:
                    wins_up_to = rows
            per_rows[str(rows)] = row
        result[f"threads_{threads}"] = {"rows": per_rows, "wins_up_to": wins_up_to if kernel else None}
    torch.set_num_threads(before)
    result["load_avg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
