"""Single-request latency: batch 1, 128-token prompt, 128 new tokens, vs Hugging Face in the same run.

Reports milliseconds per output token (decode), time to first token, and time from `LLM(...)` to ready.
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch


def run_ours(model: str, prompt: list[int], out_len: int, dtype: str, multiprocess: bool, iters: int) -> dict:
    from vllm_lite import LLM, RequestOutputKind, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=model, dtype=dtype, multiprocess=multiprocess, max_model_len=512, max_num_seqs=8)
    ready = time.perf_counter() - t0
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    ttfts, per_tok = [], []
    for i in range(iters):
        t0 = time.perf_counter()
        engine.add_request(f"lat-{i}", {"prompt_token_ids": prompt}, params)
        first = None
        n = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                n += len(out.outputs[0].token_ids)
                if first is None and n:
                    first = time.perf_counter()
        end = time.perf_counter()
        ttfts.append(first - t0)
        per_tok.append((end - first) / max(1, n - 1))
    llm.shutdown()
    return {"ms_per_token": 1e3 * float(np.median(per_tok)), "ttft_ms": 1e3 * float(np.median(ttfts)), "startup_s": ready}


def run_hf(model: str, prompt: list[int], out_len: int, dtype: torch.dtype, iters: int) -> dict:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(max(1, (os.cpu_count() or 1) - 1))  # the engine core's thread policy
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=dtype).eval()
    ids = torch.tensor([prompt])
    per_tok, ttfts = [], []
    with torch.no_grad():
        hf.generate(input_ids=ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
        for _ in range(iters):
            t0 = time.perf_counter()
            hf.generate(input_ids=ids, max_new_tokens=1, min_new_tokens=1, do_sample=False, pad_token_id=0)
            t1 = time.perf_counter()
            hf.generate(input_ids=ids, max_new_tokens=out_len, min_new_tokens=out_len, do_sample=False, pad_token_id=0)
            t2 = time.perf_counter()
            ttfts.append(t1 - t0)
            per_tok.append(((t2 - t1) - (t1 - t0)) / (out_len - 1))
    return {"ms_per_token": 1e3 * float(np.median(per_tok)), "ttft_ms": 1e3 * float(np.median(ttfts))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the ~100M Qwen2-shaped test model)")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--inprocess", action="store_true")
    args = ap.parse_args()
    if args.model is None:
        from vllm_lite.testing.checkpoints import get_checkpoint

        args.model = get_checkpoint("qwen2", size="100m")
    with open(os.path.join(args.model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    prompt = np.random.default_rng(0).integers(10, vocab - 10, size=args.input_len).tolist()
    ours = run_ours(args.model, prompt, args.output_len, args.dtype, not args.inprocess, args.iters)
    hf = run_hf(args.model, prompt, args.output_len, getattr(torch, args.dtype), args.iters)
    print(json.dumps({
        "benchmark": "latency", "dtype": args.dtype, "input_len": args.input_len, "output_len": args.output_len,
        "vllm_lite_ms_per_token": round(ours["ms_per_token"], 2), "hf_ms_per_token": round(hf["ms_per_token"], 2),
        "vllm_lite_ttft_ms": round(ours["ttft_ms"], 1), "hf_ttft_ms": round(hf["ttft_ms"], 1),
        "vllm_lite_startup_s": round(ours["startup_s"], 2),
    }))


if __name__ == "__main__":
    main()
