"""gate_up + SiLU-and-mul at decode row counts: the plain kernel then fused_silu_and_mul (the path before issue 15's
fusion) against one fused kernel call (csrc/bf16_small_m.cpp, bf16_gate_up_small_m / bf16_gate_up_vnni over
cpu_prepack.interleave_gate_up's copy), interleaved in one process.

The bench Qwen2's MLP shape (768 -> 2 x 3072), --layers distinct weights cycled as a decode step's layers cycle
them (12: ~113 MB a layout, so the weights stream from DRAM as in the engine, not from cache). Each round times
one pass over the layers for each side in turn (alternating which goes first); prints one JSON line per row count
with each side's median microseconds a layer and the median of the per-round ratios fused / plain, plus the load
average. Checks the two sides' outputs bit for bit first.

    python benchmarks/gate_up_silu.py [--rows 1 4 12 13 32 64] [--rounds 60] [--layers 12]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from vllm_lite.testing.baselines import bench_json
from vllm_lite.worker.models import cpu_prepack


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 12, 13, 32, 64])
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--inter", type=int, default=3072)
    args = ap.parse_args()
    assert cpu_prepack.small_m_kernel_available(), "needs the AVX512-BF16 kernels"
    ops = torch.ops.vllm_lite
    d, k = args.inter, args.hidden
    g = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(args.layers):
        w = (0.05 * torch.randn(2 * d, k, generator=g)).bfloat16()
        wi = cpu_prepack.interleave_gate_up(w, d)
        layers.append(
            (
                cpu_prepack.block_weight(w),
                cpu_prepack.vnni_weight(w),
                cpu_prepack.block_weight(wi),
                cpu_prepack.vnni_weight(wi),
            )
        )

    def plain(x: torch.Tensor, lw: tuple) -> torch.Tensor:
        if x.shape[0] <= cpu_prepack.SMALL_M_MAX:
            gu = ops.bf16_linear_small_m(x, lw[0], 2 * d, None)
        else:
            gu = ops.bf16_linear_vnni(x, lw[1], 2 * d, None)
        return ops.fused_silu_and_mul(gu)

    def fused(x: torch.Tensor, lw: tuple) -> torch.Tensor:
        if x.shape[0] <= cpu_prepack.SMALL_M_MAX:
            return ops.bf16_gate_up_small_m(x, lw[2], d, None, True)
        return ops.bf16_gate_up_vnni(x, lw[3], d, None, True)

    sides = {"plain": plain, "fused": fused}
    for rows in args.rows:
        x = (2 * torch.randn(rows, k, generator=g)).bfloat16()
        assert torch.equal(plain(x, layers[0]).view(torch.int16), fused(x, layers[0]).view(torch.int16))
        times: dict[str, list[float]] = {s: [] for s in sides}
        for r in range(args.rounds + 3):
            order = list(sides) if r % 2 == 0 else list(sides)[::-1]
            for s in order:
                fn = sides[s]
                t0 = time.perf_counter()
                for lw in layers:
                    fn(x, lw)
                dt = (time.perf_counter() - t0) / len(layers) * 1e6
                if r >= 3:  # warm-up rounds
                    times[s].append(dt)
        ratios = [f / p for f, p in zip(times["fused"], times["plain"])]
        print(
            bench_json(
                {
                    "rows": rows,
                    "plain_us": round(statistics.median(times["plain"]), 1),
                    "fused_us": round(statistics.median(times["fused"]), 1),
                    "fused_over_plain": round(statistics.median(ratios), 4),
                    "threads": torch.get_num_threads(),
                    "load": [round(v, 2) for v in os.getloadavg()],
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
