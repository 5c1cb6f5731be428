"""End-to-end A/B of the CPU speed levers in one engine, interleaved: attention key loop and sliced linear.

One in-process `LLM` (float32, the bench checkpoint), so every configuration runs on the same
weights, KV cache and threads; rounds alternate the configurations (A, B, C, A, B, C, ...) and
medians are reported, which is what survives a shared, loaded host. Configurations:

- before: the portable C++ attention loop, F.linear everywhere (the code before issue 15's levers);
- attention: the fastest built attention loop (AVX2 on AVX2 hosts), F.linear;
- attention+linear: that loop and cpu_linear's sliced wide linears (the default).

Workload: --num-prompts random-token prompts of 32-256 tokens (fixed seed), --output-len greedy
tokens each (ignore_eos). Prints one JSON line with output tok/s per configuration and round, the
medians, the ratios to `before`, whether outputs were identical across configurations, the host and
the load average.

    python benchmarks/cpu_levers.py [--num-prompts 32] [--output-len 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import torch

from vllm_lite import LLM, SamplingParams
from vllm_lite.platform import describe_host
from vllm_lite.testing.checkpoints import get_checkpoint
from vllm_lite.worker.attention.cpu_native import CpuNativeBackend
from vllm_lite.worker.models import cpu_linear

CONFIGS = {"before": ("portable", False), "attention": ("auto", False), "attention+linear": ("auto", True)}


def set_levers(attention_impl: str, slices: bool) -> None:
    """Switches the live engine's attention loop and the sliced linear (in-process engine only)."""
    backends = [o for o in gc.get_objects() if isinstance(o, CpuNativeBackend)]
    if not backends:
        raise RuntimeError("no CpuNativeBackend in this process: the C++ kernels did not load")
    for b in backends:
        b.impl = attention_impl
    cpu_linear._on = slices


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the ~128M Qwen2-shaped bench model)")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the in-process engine (its core's count)")
    args = ap.parse_args()
    model = args.model or get_checkpoint("qwen2", size="100m")
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(32, 257, (args.num_prompts,), generator=g).tolist()
    prompts = [torch.randint(100, 30000, (n,), generator=g).tolist() for n in lens]
    result: dict[str, object] = {
        "benchmark": "cpu_levers",
        "host": describe_host(),
        "load_avg_at_start": [round(x, 2) for x in os.getloadavg()],
        "model": os.path.basename(model.rstrip("/")),
        "num_prompts": args.num_prompts,
        "prompt_tokens": sum(lens),
        "output_len": args.output_len,
        "rounds": args.rounds,
    }
    llm = LLM(model=model, dtype="float32", multiprocess=False, max_model_len=512, max_num_seqs=64)
    torch.set_num_threads(args.threads)  # after LLM(), which applies its own thread policy
    result["threads"] = args.threads
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    requests = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(requests[:2], params, use_tqdm=False)  # warm-up
    rates: dict[str, list[float]] = {name: [] for name in CONFIGS}
    tokens: dict[str, list[list[int]]] = {}
    for _ in range(args.rounds):
        for name, (impl, slices) in CONFIGS.items():
            set_levers(impl, slices)
            t0 = time.perf_counter()
            outs = llm.generate(requests, params, use_tqdm=False)
            dt = time.perf_counter() - t0
            rates[name].append(round(sum(len(o.outputs[0].token_ids) for o in outs) / dt, 2))
            print(f"{name}: {rates[name][-1]} tok/s ({dt:.1f} s)", file=sys.stderr, flush=True)
            tokens.setdefault(name, [list(o.outputs[0].token_ids) for o in outs])
    set_levers("auto", True)
    llm.shutdown()
    med = {name: statistics.median(r) for name, r in rates.items()}
    result["output_tok_per_s"] = rates
    result["median_output_tok_per_s"] = med
    result["ratio_to_before"] = {name: round(m / med["before"], 2) for name, m in med.items()}
    result["same_tokens_as_before"] = {name: t == tokens["before"] for name, t in tokens.items()}
    result["load_avg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
