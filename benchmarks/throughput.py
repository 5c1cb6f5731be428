"""Offline throughput: vllm-lite vs Hugging Face generate on the same ~100M checkpoint, same run.

Workload: 64 prompts with input lengths uniform in [32, 256] (fixed seed), 128 output tokens each,
greedy, ignore_eos. Hugging Face runs in its own interpreter at torch's default thread count, warmed
up, with static left-padded batches swept over --hf-batch (16, 32, 64: the best is reported, every
size is in the JSON). The JSON records each side's dtype, warm-up, threads and batch, and the run
fails if the baseline differs from the engine in any of these without saying why
(vllm_lite.testing.baselines.check_fair). It also prints the host's CPU model and capability.
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch

from vllm_lite.testing.baselines import hf_generate_left_padded


def make_prompts(num: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    lens = rng.integers(lo, hi + 1, size=num)
    return [rng.integers(10, vocab - 10, size=int(n)).tolist() for n in lens]


def matmul_tflops(dtype: torch.dtype, threads: int, n: int = 1024, reps: int = 10) -> float:
    """Measured matmul rate of this machine (TFLOP/s), the compute limit we compare against."""
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    a @ b
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    dt = time.perf_counter() - t0
    torch.set_num_threads(prev)
    return 2 * n**3 * reps / dt / 1e12


def run_ours(
    model: str,
    prompts: list[list[int]],
    out_len: int,
    dtype: str,
    multiprocess: bool,
    num_threads: int | None,
    compilation_config: str | None = None,
) -> dict:
    from vllm_lite import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(
        model=model,
        dtype=dtype,
        multiprocess=multiprocess,
        max_model_len=512,
        max_num_seqs=64,
        num_threads=num_threads,
        compilation_config=compilation_config,
    )
    ready = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    t0 = time.perf_counter()
    # Warm-up (with compilation_config: the compile), at two batch sizes so the timed run meets no new graph.
    llm.generate([{"prompt_token_ids": [1, 2, 3]}] * 2, SamplingParams(max_tokens=2), use_tqdm=False)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2), use_tqdm=False)
    warmup = time.perf_counter() - t0
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    dt = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    llm.shutdown()
    return {"tokens_per_s": n_out / dt, "elapsed_s": dt, "output_tokens": n_out, "startup_s": ready, "warmup_s": warmup}


def run_hf(model: str, prompts: list[list[int]], out_len: int, dtype: torch.dtype, batches: list[int]) -> dict:
    """HF generate at torch's default threads, warmed up, for each batch size; the best size's rate on top."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=dtype).eval()

    def generate(chunk: list[list[int]], new_tokens: int) -> int:
        return hf_generate_left_padded(hf, chunk, new_tokens)

    per_batch = {}
    with torch.no_grad():
        for batch in batches:
            generate(prompts[:batch], 4)  # warm-up at this batch shape (allocator, oneDNN primitives)
            n_out = 0
            t0 = time.perf_counter()
            for i in range(0, len(prompts), batch):
                n_out += generate(prompts[i : i + batch], out_len)
            per_batch[batch] = n_out / (time.perf_counter() - t0)
    best = max(per_batch, key=per_batch.__getitem__)
    return {
        "tokens_per_s": per_batch[best],
        "best_batch": best,
        "threads": torch.get_num_threads(),
        "tokens_per_s_by_batch": {str(b): round(v, 1) for b, v in per_batch.items()},
    }


def hf_worker(spec: str) -> None:
    """`--hf-worker JSON`: run the HF side alone in this fresh interpreter and print its JSON line."""
    a = json.loads(spec)
    prompts = make_prompts(a["num_prompts"], 32, 256, a["vocab"], seed=0)
    print(json.dumps(run_hf(a["model"], prompts, a["output_len"], getattr(torch, a["dtype"]), a["batches"])))


def hf_baseline(args: argparse.Namespace, vocab: int, core_threads: int) -> tuple[dict, object]:
    """Sweep HF generate over --hf-batch in a fresh interpreter (this script's --hf-worker); its result and RunConfig.

    Shared with moe_throughput.py, which runs the same workload on another checkpoint.
    """
    from vllm_lite.testing.baselines import RunConfig, run_json_subprocess

    batches = [int(b) for b in args.hf_batch.split(",") if b.strip()]
    spec = dict(
        model=args.model,
        num_prompts=args.num_prompts,
        vocab=vocab,
        output_len=args.output_len,
        dtype=args.dtype,
        batches=batches,
    )
    hf = run_json_subprocess([os.path.abspath(__file__), "--hf-worker", json.dumps(spec)])
    hf_cfg = RunConfig("hf_generate", args.dtype, warmup=True, threads=hf["threads"], batch=batches)
    if hf["threads"] != core_threads:
        hf_cfg.declared["threads"] = (
            "HF runs at torch's default thread count in its own process; the engine core at its "
            "adaptive policy (every core it may use on an idle host, one fewer beside a busy process)"
        )
    return hf, hf_cfg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the ~100M Qwen2-shaped test model)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--hf-batch", default="16,32,64", help="HF batch sizes to sweep (comma-separated); best reported")
    ap.add_argument("--inprocess", action="store_true", help="run the engine core in this process")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--num-threads", type=int, default=None, help="engine-core torch threads (default: its policy)")
    ap.add_argument(
        "--compilation-config", "-O", default=None, help="vLLM's compilation_config for the engine: a mode (3) or JSON"
    )
    ap.add_argument("--hf-worker", default=None, help=argparse.SUPPRESS)  # internal: the HF subprocess
    args = ap.parse_args()
    if args.hf_worker is not None:
        hf_worker(args.hf_worker)
        return
    from vllm_lite.testing.baselines import RunConfig, check_fair, engine_core_threads, host_description

    if args.model is None:
        from vllm_lite.testing.checkpoints import get_checkpoint

        args.model = get_checkpoint("qwen2", size="100m")
    with open(os.path.join(args.model, "config.json")) as f:
        cfg = json.load(f)
    prompts = make_prompts(args.num_prompts, 32, 256, cfg["vocab_size"], seed=0)

    host = host_description()  # before the engine starts: this process's default torch threads
    ours = run_ours(
        args.model, prompts, args.output_len, args.dtype, not args.inprocess, args.num_threads, args.compilation_config
    )
    core_threads = engine_core_threads(args.num_threads)
    engine_cfg = RunConfig("vllm_lite", args.dtype, warmup=True, threads=core_threads, batch=64)
    result: dict = {
        "benchmark": "throughput",
        "host": host,
        "model": os.path.basename(args.model.rstrip("/")),
        "dtype": args.dtype,
        "num_prompts": args.num_prompts,
        "output_len": args.output_len,
        "vllm_lite_tokens_per_s": round(ours["tokens_per_s"], 1),
        "vllm_lite_startup_s": round(ours["startup_s"], 2),
        "vllm_lite_warmup_s": round(ours["warmup_s"], 2),
        "compilation_config": args.compilation_config,
    }
    baselines = []
    if not args.skip_hf:
        hf, hf_cfg = hf_baseline(args, cfg["vocab_size"], core_threads)
        baselines.append(hf_cfg)
        result["hf_tokens_per_s"] = round(hf["tokens_per_s"], 1)
        result["hf_best_batch"] = hf["best_batch"]
        result["hf_tokens_per_s_by_batch"] = hf["tokens_per_s_by_batch"]
        result["ratio"] = round(ours["tokens_per_s"] / hf["tokens_per_s"], 2)
    check_fair(engine_cfg, baselines)
    result["runs"] = [engine_cfg.as_json()] + [b.as_json() for b in baselines]
    # Fraction of the compute limit: 2 * params FLOPs per token against the measured matmul rate.
    n_params = _count_params(cfg)
    achieved = 2 * n_params * ours["tokens_per_s"] / 1e12
    limit = matmul_tflops(getattr(torch, args.dtype), threads=core_threads)
    result["model_params_m"] = round(n_params / 1e6, 1)
    result["achieved_tflops"] = round(achieved, 4)
    result["matmul_tflops_limit"] = round(limit, 3)
    result["fraction_of_limit"] = round(achieved / limit, 3)
    result["core_threads"] = core_threads
    result["peak_rss_mb_this_process"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    result["peak_rss_mb_children"] = round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, 1)
    print(json.dumps(result))


def _count_params(cfg: dict) -> int:
    """Matmul parameters touched per token (embeddings lookups excluded, LM head included)."""
    h, n_layers, inter = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    hd = cfg.get("head_dim") or h // heads
    attn = h * hd * (heads + 2 * kv) + heads * hd * h
    mlp = 3 * h * inter
    return n_layers * (attn + mlp) + h * cfg["vocab_size"]


if __name__ == "__main__":
    main()
