"""Mixture-of-experts throughput: vllm-lite vs Hugging Face generate on a small Mixtral-shaped checkpoint.

Same method as throughput.py (whose prompt maker, engine runner and HF baseline sweep it reuses): random prompts with input
lengths uniform in [32, 256] (fixed seed), greedy, ignore_eos; HF in its own interpreter at torch's default
threads, warmed up, static left-padded batches swept (best reported, all in the JSON); each side's dtype,
warm-up, threads and batch recorded and checked by vllm_lite.testing.baselines.check_fair. Default model:
Mixtral's layout (8 experts, top-2, GQA) at ~25M parameters (~8M active per token) (`get_checkpoint("mixtral", "moe-small")`).

Both sides swing run to run on a small shared host (HF's rate 780-1,100 tok/s within minutes on a 2-core Zen 4), so
the two sides run `--repeats` interleaved rounds (ours, HF, ours, HF, ...; each a fresh engine / fresh interpreter):
the first HF round sweeps --hf-batch, later ones run its best batch only. The headline `ratio` is the median of the
rounds' same-round ratios; each round, the medians and the min/max are in the JSON. Prints one JSON line with the host.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# benchmarks/ is this script's directory, so its sibling is importable as a module.
from throughput import hf_baseline, make_prompts, run_ours


def moe_params(cfg: dict) -> tuple[int, int]:
    """(all matmul parameters, those one token touches: attention, top-k experts, router, LM head)."""
    h, n_layers, inter = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    hd = cfg.get("head_dim") or h // heads
    experts, top_k = cfg["num_local_experts"], cfg["num_experts_per_tok"]
    attn = h * hd * (heads + 2 * kv) + heads * hd * h
    expert = 3 * h * inter
    head = h * cfg["vocab_size"]
    total = n_layers * (attn + experts * expert + experts * h) + head
    active = n_layers * (attn + top_k * expert + experts * h) + head
    return total, active


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the ~25M Mixtral-shaped test model)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--hf-batch", default="16,32,64", help="HF batch sizes to sweep (comma-separated); best reported")
    ap.add_argument("--inprocess", action="store_true", help="run the engine core in this process")
    ap.add_argument("--num-threads", type=int, default=None, help="engine-core torch threads (default: its policy)")
    ap.add_argument(
        "--repeats", type=int, default=3, help="interleaved rounds of both sides (default 3); medians reported"
    )
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    from vllm_lite import envs
    from vllm_lite.testing.baselines import RunConfig, check_fair, engine_core_threads, host_description

    if args.model is None:
        from vllm_lite.testing.checkpoints import get_checkpoint

        args.model = get_checkpoint("mixtral", size="moe-small")
    with open(os.path.join(args.model, "config.json")) as f:
        cfg = json.load(f)
    prompts = make_prompts(args.num_prompts, 32, 256, cfg["vocab_size"], seed=0)

    host = host_description()
    core_threads = engine_core_threads(args.num_threads)
    rounds, hf_first, hf_cfg = [], None, None
    hf_args = copy.copy(args)
    for _ in range(args.repeats):
        ours = run_ours(args.model, prompts, args.output_len, args.dtype, not args.inprocess, args.num_threads)
        load_ours = os.getloadavg()[0]
        hf, cfg_i = hf_baseline(hf_args, cfg["vocab_size"], core_threads)
        if hf_first is None:  # the sweep: later rounds run HF's best batch only
            hf_first, hf_cfg = hf, cfg_i
            hf_args.hf_batch = str(hf["best_batch"])
        rounds.append(
            {
                "vllm_lite_tokens_per_s": round(ours["tokens_per_s"], 1),
                "hf_tokens_per_s": round(hf["tokens_per_s"], 1),
                "ratio": round(ours["tokens_per_s"] / hf["tokens_per_s"], 2),
                "load_1min": [round(load_ours, 2), round(os.getloadavg()[0], 2)],
            }
        )
    engine_cfg = RunConfig("vllm_lite", args.dtype, warmup=True, threads=core_threads, batch=64)
    check_fair(engine_cfg, [hf_cfg])
    total, active = moe_params(cfg)
    ours_med = statistics.median(r["vllm_lite_tokens_per_s"] for r in rounds)
    hf_med = statistics.median(r["hf_tokens_per_s"] for r in rounds)
    ratios = [r["ratio"] for r in rounds]
    print(
        json.dumps(
            {
                "benchmark": "moe_throughput",
                "host": host,
                "model": os.path.basename(args.model.rstrip("/")),
                "architecture": (cfg.get("architectures") or ["?"])[0],
                "experts": cfg["num_local_experts"],
                "top_k": cfg["num_experts_per_tok"],
                "params_m": round(total / 1e6, 1),
                "active_params_m": round(active / 1e6, 1),
                "dtype": args.dtype,
                "num_prompts": args.num_prompts,
                "output_len": args.output_len,
                "repeats": args.repeats,
                "vllm_lite_tokens_per_s": round(ours_med, 1),  # medians over the rounds
                "vllm_lite_startup_s": round(ours["startup_s"], 2),
                "hf_tokens_per_s": round(hf_med, 1),
                "hf_best_batch": hf_first["best_batch"],
                "hf_tokens_per_s_by_batch": hf_first["tokens_per_s_by_batch"],  # the first round's sweep
                "ratio": round(statistics.median(ratios), 2),  # median of the rounds' same-round ratios
                "ratio_min": min(ratios),
                "ratio_max": max(ratios),
                "ratio_of_medians": round(ours_med / hf_med, 2),
                "rounds": rounds,
                "core_threads": core_threads,
                # Which CPU expert path the engine was allowed: the C++ op (float32) or oneDNN per expert.
                "cpu_moe_kernel": envs.VLLM_LITE_CPU_MOE_KERNEL,
                "cpu_moe_pack": envs.VLLM_LITE_CPU_MOE_PACK,
                "runs": [engine_cfg.as_json(), hf_cfg.as_json()],
            }
        )
    )


if __name__ == "__main__":
    main()
