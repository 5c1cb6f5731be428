"""Engine overhead, in-process core vs core in its own process, on real models.

On a tiny checkpoint the model costs almost nothing, so wall time per output token is engine
overhead (scheduling, input building, sampling, detokenizing, and for the multiprocess engine the
sockets). On the ~100M checkpoint the model dominates and the multiprocess engine should be at
least as fast, because detokenization in the frontend overlaps the model step in the core.
(`benchmarks/overhead.py` measures the transport alone, with a core that runs no model.)
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import os
import time

from vllm_lite.testing.baselines import bench_json

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np


def run(model: str, multiprocess: bool, num_prompts: int, in_len: int, out_len: int, dtype: str) -> dict:
    from vllm_lite import LLMEngine, SamplingParams
    from vllm_lite.engine_args import EngineArgs

    engine = LLMEngine.from_engine_args(
        EngineArgs(model=model, dtype=dtype, max_model_len=in_len + out_len + 8, max_num_seqs=num_prompts),
        multiprocess_mode=multiprocess,
    )
    vocab = engine.vllm_config.model_config.vocab_size
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, vocab - 10, size=in_len).tolist() for _ in range(num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    engine.add_request("warm", {"prompt_token_ids": prompts[0]}, SamplingParams(max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    dt = time.perf_counter() - t0
    engine.shutdown()
    n_out = num_prompts * out_len
    return {"steps_per_s": steps / dt, "us_per_output_token": 1e6 * dt / n_out, "tokens_per_s": n_out / dt}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--skip-100m", action="store_true")
    args = ap.parse_args()
    from vllm_lite.testing.checkpoints import get_checkpoint

    result: dict = {"benchmark": "engine_overhead", "num_prompts": args.num_prompts, "output_len": args.output_len}
    tiny = get_checkpoint("llama")
    for name, mp in (("inproc", False), ("multiproc", True)):
        r = run(tiny, mp, args.num_prompts, args.input_len, args.output_len, "float32")
        result[f"tiny_{name}_steps_per_s"] = round(r["steps_per_s"], 1)
        result[f"tiny_{name}_us_per_output_token"] = round(r["us_per_output_token"], 1)
    if not args.skip_100m:
        big = get_checkpoint("qwen2", size="100m")
        for name, mp in (("inproc", False), ("multiproc", True)):
            r = run(big, mp, args.num_prompts, 128, 64, "bfloat16")
            result[f"100m_{name}_tokens_per_s"] = round(r["tokens_per_s"], 1)
        result["100m_multiproc_over_inproc"] = round(
            result["100m_multiproc_tokens_per_s"] / result["100m_inproc_tokens_per_s"], 3
        )
    print(bench_json(result))


if __name__ == "__main__":
    main()
