"""Microbenchmark: float32 linear on CPU -- F.linear against the alternatives cpu_linear.py weighs.

For the bench checkpoint's projection shapes (qkv, o_proj, gate_up, down, LM head) and batch rows
m, times interleaved in one process (rounds alternate the variants, the median is kept):

- f_linear: torch.nn.functional.linear (MKL sgemm here), what every layer runs today;
- cols{B}: F.linear over blocks of B output features (rows of the weight), concatenated;
- mm_t: x @ W^T with W^T stored contiguous once; mm_t_cols{B}: the same over contiguous blocks of W^T;
- onednn: oneDNN with the weight reordered once (mkldnn._reorder_linear_weight + _linear_pointwise).

Prints one JSON line: GFLOP/s per variant, each variant's speed-up over f_linear, its max abs
difference from f_linear and whether it is bit-identical, plus the host and the load average.

    python benchmarks/linear.py [--threads 1] [--rows 1,16,32,64] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

from vllm_lite.platform import describe_host

# (name, in_features, out_features) of the bench checkpoint (hidden 768, 12/4 heads of 64, MLP 3072).
SHAPES = [
    ("qkv", 768, 1280),
    ("o_proj", 768, 768),
    ("gate_up", 768, 6144),
    ("down", 3072, 768),
    ("lm_head", 768, 32000),
]


BLOCKS = (384, 512, 768, 1536, 3072, 4096)


def variants(w: torch.Tensor, rows: int) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    out: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"f_linear": lambda x: F.linear(x, w)}
    n = w.shape[0]
    for b in BLOCKS:
        if b < n:
            parts = list(w.split(b, 0))
            out[f"cols{b}"] = lambda x, parts=parts: torch.cat([F.linear(x, p) for p in parts], dim=-1)
    wt = w.t().contiguous()
    out["mm_t"] = lambda x: torch.mm(x, wt)
    for b in BLOCKS:
        if b < n:
            tparts = [p.t().contiguous() for p in w.split(b, 0)]
            out[f"mm_t_cols{b}"] = lambda x, tparts=tparts: torch.cat([torch.mm(x, p) for p in tparts], dim=-1)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w, rows)
        out["onednn"] = lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    except RuntimeError:
        pass
    return out


def time_call(fn: Callable[[], object], min_seconds: float) -> float:
    calls, start = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds and calls >= 3:
            return elapsed / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="1,16,32,64")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=0.2)
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES))
    ap.add_argument("--variants", default=None, help="comma-separated subset (default: all)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    wanted = set(args.shapes.split(","))
    result: dict[str, object] = {
        "benchmark": "linear_float32",
        "host": describe_host(),
        "load_avg_at_start": [round(x, 2) for x in os.getloadavg()],
        "threads": args.threads,
        "rounds": args.rounds,
    }
    g = torch.Generator().manual_seed(0)
    for name, k, n in SHAPES:
        if name not in wanted:
            continue
        w = torch.randn(n, k, generator=g) / k**0.5
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, generator=g)
            fns = variants(w, m)
            if args.variants:
                keep = set(args.variants.split(",")) | {"f_linear"}
                fns = {v: fn for v, fn in fns.items() if v in keep}
            ref = fns["f_linear"](x)
            samples: dict[str, list[float]] = {v: [] for v in fns}
            for _ in range(args.rounds):
                for v, fn in fns.items():
                    samples[v].append(time_call(lambda fn=fn, x=x: fn(x), args.seconds))
            base = statistics.median(samples["f_linear"])
            flop = 2.0 * m * k * n
            row: dict[str, object] = {}
            for v, fn in fns.items():
                sec = statistics.median(samples[v])
                y = fn(x)
                row[v] = {
                    "gflops": round(flop / sec / 1e9, 1),
                    "speedup": round(base / sec, 2),
                    "max_abs_diff": float((y - ref).abs().max()),
                    "bit_identical": bool(torch.equal(y, ref)),
                }
            result[f"{name}_{k}x{n}_m{m}"] = row
    result["load_avg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
