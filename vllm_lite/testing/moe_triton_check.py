"""Driver: the Triton grouped-expert kernel against the torch grouped path; prints one JSON line.

Run as `python -m vllm_lite.testing.moe_triton_check --device cpu` with TRITON_INTERPRET=1 in that
process's environment only (Triton picks its interpreter when a kernel is decorated), or on CUDA compiled.
"""

from __future__ import annotations

import argparse
import json
import traceback

import torch

# (name, tokens, experts, top_k, hidden, intermediate, experts forced empty)
CASES = [
    ("shared_and_empty_experts", 9, 6, 2, 48, 40, 3),
    ("one_token", 1, 4, 2, 32, 16, 0),
    ("many_tokens_uneven_dims", 37, 8, 2, 72, 24, 0),
    ("top1", 5, 4, 1, 32, 32, 2),
]


def run_case(device: str, tokens: int, experts: int, top_k: int, hidden: int, inter: int, empty: int) -> None:
    from vllm_lite.worker.models.fused_moe import grouped_experts, route
    from vllm_lite.worker.models.fused_moe_triton import (
        align_pairs,
        triton_grouped_experts,
    )

    g = torch.Generator().manual_seed(tokens * 7 + experts)
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) * 0.2
    w2 = torch.randn(experts, hidden, inter, generator=g) * 0.2
    logits = torch.randn(tokens, experts, generator=g)
    if empty:
        logits[:, experts - empty :] -= 100.0
    weights, ids = route(logits, top_k, renormalize=True)
    x, w13, w2, weights, ids = (t.to(device) for t in (x, w13, w2, weights, ids))
    sorted_pairs, block_expert = align_pairs(ids, experts, 16)
    # Every pair appears exactly once, in its expert's blocks.
    real = sorted_pairs[sorted_pairs < tokens * top_k]
    assert sorted(real.tolist()) == list(range(tokens * top_k))
    blocks = torch.arange(sorted_pairs.numel(), device=device) // 16
    assert torch.equal(block_expert[blocks][sorted_pairs < tokens * top_k], ids.reshape(-1)[real])
    expected = grouped_experts(x, w13, w2, weights, ids)
    got = triton_grouped_experts(x, w13, w2, weights, ids)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    results: dict[str, str | None] = {}
    for name, *case in CASES:
        try:
            run_case(args.device, *case)
            results[name] = None
        except Exception:  # each case reports its own failure
            results[name] = traceback.format_exc()
    print(json.dumps({"device": args.device, "results": results}))


if __name__ == "__main__":
    main()
