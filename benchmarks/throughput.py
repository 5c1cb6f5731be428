"""Offline throughput: vllm-lite vs Hugging Face generate on the same ~100M checkpoint, same run.

Workload: 64 prompts with input lengths uniform in [32, 256] (fixed seed), 128 output tokens each,
greedy, ignore_eos. Hugging Face runs static batches of 16, left-padded.
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
    model: str, prompts: list[list[int]], out_len: int, dtype: str, multiprocess: bool, num_threads: int | None
) -> dict:
    from vllm_lite import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=model, dtype=dtype, multiprocess=multiprocess, max_model_len=512, max_num_seqs=64,
              num_threads=num_threads)
    ready = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    dt = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    llm.shutdown()
    return {"tokens_per_s": n_out / dt, "elapsed_s": dt, "output_tokens": n_out, "startup_s": ready}


def run_hf(model: str, prompts: list[list[int]], out_len: int, dtype: torch.dtype, batch: int, threads: int) -> dict:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=dtype).eval()
    pad = 0
    n_out = 0
    t0 = time.perf_counter()
    with torch.no_grad():
        for i in range(0, len(prompts), batch):
            chunk = prompts[i : i + batch]
            width = max(len(p) for p in chunk)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
            out = hf.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=out_len, min_new_tokens=out_len,
                do_sample=False, pad_token_id=pad,
            )
            n_out += (out.shape[1] - width) * len(chunk)
    dt = time.perf_counter() - t0
    return {"tokens_per_s": n_out / dt, "elapsed_s": dt, "output_tokens": n_out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the ~100M Qwen2-shaped test model)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--inprocess", action="store_true", help="run the engine core in this process")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--num-threads", type=int, default=None, help="engine-core torch threads (default: its policy)")
    ap.add_argument("--hf-threads", type=int, default=None,
                    help="torch threads for Hugging Face (default: the engine core's policy, all cores but one)")
    args = ap.parse_args()
    if args.model is None:
        from vllm_lite.testing.checkpoints import get_checkpoint

        args.model = get_checkpoint("qwen2", size="100m")
    with open(os.path.join(args.model, "config.json")) as f:
        cfg = json.load(f)
    prompts = make_prompts(args.num_prompts, 32, 256, cfg["vocab_size"], seed=0)

    ours = run_ours(args.model, prompts, args.output_len, args.dtype, not args.inprocess, args.num_threads)
    result: dict = {"benchmark": "throughput", "model": os.path.basename(args.model.rstrip("/")), "dtype": args.dtype,
                    "num_prompts": args.num_prompts, "output_len": args.output_len,
                    "vllm_lite_tokens_per_s": round(ours["tokens_per_s"], 1),
                    "vllm_lite_startup_s": round(ours["startup_s"], 2)}
    if not args.skip_hf:
        hf_threads = args.hf_threads or args.num_threads or max(1, (os.cpu_count() or 1) - 1)
        hf = run_hf(args.model, prompts, args.output_len, getattr(torch, args.dtype), args.hf_batch, hf_threads)
        result["hf_threads"] = hf_threads
        result["hf_tokens_per_s"] = round(hf["tokens_per_s"], 1)
        result["ratio"] = round(ours["tokens_per_s"] / hf["tokens_per_s"], 2)
    # Fraction of the compute limit: 2 * params FLOPs per token against the measured matmul rate.
    n_params = _count_params(cfg)
    achieved = 2 * n_params * ours["tokens_per_s"] / 1e12
    core_threads = args.num_threads or max(1, (os.cpu_count() or 1) - 1)
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
