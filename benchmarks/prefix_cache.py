"""Prefix caching on vs off.

Shared workload: 64 requests sharing a 1024-token prefix with distinct 32-token suffixes.
Unshared workload: 64 requests with no common prefix (caching should cost almost nothing).
Reports mean time to first token and output throughput for each. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from vllm_lite.testing.baselines import bench_json

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np


def run(model: str, prompts: list[list[int]], out_len: int, dtype: str, caching: bool) -> dict:
    from vllm_lite import LLM, SamplingParams

    llm = LLM(
        model=model, dtype=dtype, enable_prefix_caching=caching, max_model_len=1024 + 32 + out_len + 16, max_num_seqs=64
    )
    llm.generate([{"prompt_token_ids": [7, 8, 9]}], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    dt = time.perf_counter() - t0
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs]
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    cached = sum(o.num_cached_tokens for o in outs)
    llm.shutdown()
    return {"ttft_ms": 1e3 * float(np.mean(ttft)), "tokens_per_s": n_out / dt, "cached_tokens": cached}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the ~100M Qwen2-shaped test model)")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prefix-len", type=int, default=1024)
    ap.add_argument("--suffix-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved runs of the unshared workload per side")
    args = ap.parse_args()
    if args.model is None:
        from vllm_lite.testing.checkpoints import get_checkpoint

        args.model = get_checkpoint("qwen2", size="100m")
    with open(os.path.join(args.model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    rng = np.random.default_rng(0)
    prefix = rng.integers(10, vocab - 10, size=args.prefix_len).tolist()
    shared = [prefix + rng.integers(10, vocab - 10, size=args.suffix_len).tolist() for _ in range(args.num_requests)]
    unshared = [rng.integers(10, vocab - 10, size=256).tolist() for _ in range(args.num_requests)]

    on = run(args.model, shared, args.output_len, args.dtype, True)
    off = run(args.model, shared, args.output_len, args.dtype, False)
    # The unshared cost is small: interleave repeats (alternating order) and keep each side's best run,
    # so machine noise does not swamp it.
    u_on = u_off = None
    for i in range(args.repeats):
        # Alternate which side runs first, so run order does not bias the comparison.
        if i % 2:
            b = run(args.model, unshared, args.output_len, args.dtype, False)
            a = run(args.model, unshared, args.output_len, args.dtype, True)
        else:
            a = run(args.model, unshared, args.output_len, args.dtype, True)
            b = run(args.model, unshared, args.output_len, args.dtype, False)
        u_on = a if u_on is None or a["tokens_per_s"] > u_on["tokens_per_s"] else u_on
        u_off = b if u_off is None or b["tokens_per_s"] > u_off["tokens_per_s"] else u_off
    print(
        bench_json(
            {
                "benchmark": "prefix_cache",
                "dtype": args.dtype,
                "shared_ttft_ms_on": round(on["ttft_ms"], 1),
                "shared_ttft_ms_off": round(off["ttft_ms"], 1),
                "ttft_speedup": round(off["ttft_ms"] / on["ttft_ms"], 2),
                "shared_tokens_per_s_on": round(on["tokens_per_s"], 1),
                "shared_tokens_per_s_off": round(off["tokens_per_s"], 1),
                "shared_cached_tokens_on": on["cached_tokens"],
                "unshared_tokens_per_s_on": round(u_on["tokens_per_s"], 1),
                "unshared_tokens_per_s_off": round(u_off["tokens_per_s"], 1),
                "unshared_cost_pct": round(100 * (1 - u_on["tokens_per_s"] / u_off["tokens_per_s"]), 2),
            }
        )
    )


if __name__ == "__main__":
    main()
