"""Single-request latency: batch 1, 128-token prompt, 128 new tokens, vs Hugging Face in the same run.

Reports milliseconds per output token (decode), time to first token, and time from `LLM(...)` to ready, with the
host's load average before and after (on a shared host the load moves both sides' numbers by 10-25%).
Hugging Face runs in its own interpreter at torch's default thread count, warmed up; the JSON records
each side's dtype, warm-up, threads and batch, and the run fails if they differ without a stated
reason (vllm_lite.testing.baselines.check_fair). It also prints the host's CPU model and capability.
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


def run_ours(
    model: str, prompt: list[int], out_len: int, dtype: str, multiprocess: bool, iters: int, num_threads: int | None
) -> dict:
    from vllm_lite import LLM, RequestOutputKind, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(
        model=model, dtype=dtype, multiprocess=multiprocess, max_model_len=512, max_num_seqs=8, num_threads=num_threads
    )
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
    return {
        "ms_per_token": 1e3 * float(np.median(per_tok)),
        "ttft_ms": 1e3 * float(np.median(ttfts)),
        "startup_s": ready,
    }


def run_hf(model: str, prompt: list[int], out_len: int, dtype: torch.dtype, iters: int) -> dict:
    """HF generate at torch's default threads (this runs in its own interpreter), after a warm-up."""
    from transformers import AutoModelForCausalLM

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
    return {
        "ms_per_token": 1e3 * float(np.median(per_tok)),
        "ttft_ms": 1e3 * float(np.median(ttfts)),
        "threads": torch.get_num_threads(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the ~100M Qwen2-shaped test model)")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--inprocess", action="store_true")
    ap.add_argument("--num-threads", type=int, default=None, help="engine-core torch threads (default: its policy)")
    ap.add_argument("--hf-worker", default=None, help=argparse.SUPPRESS)  # internal: the HF subprocess
    args = ap.parse_args()
    if args.hf_worker is not None:
        a = json.loads(args.hf_worker)
        print(json.dumps(run_hf(a["model"], a["prompt"], a["output_len"], getattr(torch, a["dtype"]), a["iters"])))
        return
    from vllm_lite.testing.baselines import (
        RunConfig,
        check_fair,
        engine_core_threads,
        host_description,
        run_json_subprocess,
    )

    if args.model is None:
        from vllm_lite.testing.checkpoints import get_checkpoint

        args.model = get_checkpoint("qwen2", size="100m")
    with open(os.path.join(args.model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    prompt = np.random.default_rng(0).integers(10, vocab - 10, size=args.input_len).tolist()
    host = host_description()  # before the engine starts: this process's default torch threads
    load_before = [round(x, 2) for x in os.getloadavg()]
    ours = run_ours(args.model, prompt, args.output_len, args.dtype, not args.inprocess, args.iters, args.num_threads)
    spec = dict(model=args.model, prompt=prompt, output_len=args.output_len, dtype=args.dtype, iters=args.iters)
    hf = run_json_subprocess([os.path.abspath(__file__), "--hf-worker", json.dumps(spec)])
    core_threads = engine_core_threads(args.num_threads)
    engine_cfg = RunConfig("vllm_lite", args.dtype, warmup=True, threads=core_threads, batch=1)
    hf_cfg = RunConfig("hf_generate", args.dtype, warmup=True, threads=hf["threads"], batch=1)
    if hf["threads"] != core_threads:
        hf_cfg.declared["threads"] = (
            "HF runs at torch's default thread count in its own process; the engine core at its "
            "adaptive policy (every core it may use on an idle host, one fewer beside a busy process)"
        )
    check_fair(engine_cfg, [hf_cfg])
    print(
        json.dumps(
            {
                "benchmark": "latency",
                "host": host,
                "runs": [engine_cfg.as_json(), hf_cfg.as_json()],
                "dtype": args.dtype,
                "input_len": args.input_len,
                "output_len": args.output_len,
                "vllm_lite_ms_per_token": round(ours["ms_per_token"], 2),
                "hf_ms_per_token": round(hf["ms_per_token"], 2),
                "vllm_lite_ttft_ms": round(ours["ttft_ms"], 1),
                "hf_ttft_ms": round(hf["ttft_ms"], 1),
                "vllm_lite_startup_s": round(ours["startup_s"], 2),
                "load_avg_before": load_before,
                "load_avg_after": [round(x, 2) for x in os.getloadavg()],
            }
        )
    )


if __name__ == "__main__":
    main()
