"""Sampler cost per call: batch 64, vocab 32000, everything on vs greedy only. Prints one JSON line.

python benchmarks/sampler.py [--batch 64] [--vocab 32000] [--iters 50] [--threads 1]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from vllm_lite.platform import resolve_device
from vllm_lite.sampling_params import SamplingParams
from vllm_lite.testing.baselines import bench_json
from vllm_lite.worker.sampler import Sampler
from vllm_lite.worker.sampling_state import SamplingState


def _state(params: list[SamplingParams], vocab: int, device: torch.device) -> tuple[SamplingState, np.ndarray]:
    state = SamplingState(len(params), vocab, 4096, device)
    rng = np.random.default_rng(0)
    for row, p in enumerate(params):
        prompt = rng.integers(0, vocab, 200).tolist()
        out = rng.integers(0, vocab, 50).tolist()
        state.add_request(row, p, prompt, out, eos_token_id=2)
    return state, np.arange(len(params), dtype=np.int64)


def _time_us(state: SamplingState, rows: np.ndarray, logits: torch.Tensor, iters: int) -> float:
    """Per call: make_metadata + sampler forward + append_token_ids, i.e. everything a decode step pays."""
    sampler = Sampler()
    for _ in range(3):  # warm-up
        out = sampler(logits, state.make_metadata(rows))
    t0 = time.perf_counter()
    for _ in range(iters):
        out = sampler(logits, state.make_metadata(rows))
        state.append_token_ids(rows, out.sampled_token_ids.cpu().numpy())
    if logits.is_cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default=resolve_device("auto").type)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    logits = torch.randn(args.batch, args.vocab, device=device) * 3

    full = SamplingParams(
        temperature=0.8,
        top_k=50,
        top_p=0.9,
        min_p=0.05,
        repetition_penalty=1.1,
        presence_penalty=0.5,
        frequency_penalty=0.3,
    )
    greedy_us = _time_us(
        *_state([SamplingParams(temperature=0.0)] * args.batch, args.vocab, device), logits, args.iters
    )
    full_us = _time_us(*_state([full] * args.batch, args.vocab, device), logits, args.iters)
    seeded = [SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=i) for i in range(args.batch)]
    seeded_us = _time_us(*_state(seeded, args.vocab, device), logits, args.iters)
    print(
        bench_json(
            {
                "benchmark": "sampler",
                "device": str(device),
                "threads": args.threads,
                "batch": args.batch,
                "vocab": args.vocab,
                "greedy_us_per_call": round(greedy_us, 1),
                "all_features_us_per_call": round(full_us, 1),
                "all_seeded_top_k_top_p_us_per_call": round(seeded_us, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
