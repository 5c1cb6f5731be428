"""CPU prefill steps of vs_vllm's workload (issue #15): the model forward of each step, and with --profile each
linear's GFLOP/s in the engine.

An in-process LLM (bench Qwen2 ~128M, bf16 by the dtype policy, prefix caching off so every generate prefills)
runs vs_vllm's 32 random prompts of 32-256 tokens with max_tokens=1, so a generate is exactly the workload's
prefill steps (2,048 + 2,048 + the rest of 4,803 tokens for prompt set 0) and nothing else. Each generate's
forwards are timed by wrapping GPUModelRunner._run_model. Prints one JSON line: per generate the forwards
(rows, ms), the median 2,048-row forward, the load average, whether the native CPU kernels loaded. With
--profile, one more generate under torch.profiler: the oneDNN linears' (and other dispatched ops') time and
GFLOP/s by shape, and the decoder stack's own time (attention, norms, rotary, K/V writes, SiLU-and-mul: the
parts of cpu_decoder_layers that are not dispatched ops).

For A/B: run two trees in alternating processes under `bench` (PYTHONPATH=<tree>). --threads 1 measures the
kernels with less noise from other processes on a shared 2-core host than the default (the engine's policy).

    python benchmarks/prefill_step.py [--generates 4] [--threads N] [--budget 2048] [--profile]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from vs_vllm import make_prompts  # noqa: E402

from vllm_lite.testing.baselines import bench_json  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--generates", type=int, default=4)
    ap.add_argument("--threads", type=int, default=None, help="the engine's torch threads (default: its policy)")
    ap.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()

    from vllm_lite import LLM, SamplingParams
    from vllm_lite.testing.checkpoints import get_checkpoint
    from vllm_lite.worker import model_runner
    from vllm_lite.worker.attention.cpu_kernels import load_cpu_ops

    model = get_checkpoint("qwen2", size="100m")
    with open(os.path.join(model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    steps: list[tuple[int, float]] = []
    orig = model_runner.GPUModelRunner._run_model

    def timed(self, inputs, *a, **k):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        out = orig(self, inputs, *a, **k)
        steps.append((int(inputs.num_tokens), (time.perf_counter() - t0) * 1e3))
        return out

    model_runner.GPUModelRunner._run_model = timed  # type: ignore[method-assign]
    kw = {"num_threads": args.threads} if args.threads else {}
    llm = LLM(
        model=model,
        dtype="auto",
        max_model_len=512,
        max_num_seqs=64,
        multiprocess=False,
        enable_prefix_caching=False,
        max_num_batched_tokens=args.budget,
        **kw,
    )
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def generate(seed: int) -> float:
        prompts = [{"prompt_token_ids": p} for p in make_prompts(32, 32, 256, vocab, seed)]
        steps.clear()
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return (time.perf_counter() - t0) * 1e3

    generate(1)  # warm-up (heap, oneDNN's kernels, the stack's decision)
    runs = []
    for g in range(args.generates):
        ms = generate(g % 3)
        runs.append({"generate_ms": round(ms, 1), "forwards": [[n, round(t, 1)] for n, t in steps]})
    full = [t for r in runs for n, t in r["forwards"] if n == args.budget]
    result = {
        "benchmark": "prefill_step",
        "threads": args.threads,
        "budget": args.budget,
        "runs": runs,
        "median_full_forward_ms": round(statistics.median(full), 1) if full else None,
        "native_kernels_loaded": bool(load_cpu_ops()),
        "load_avg_at_end": os.getloadavg(),
    }
    print(bench_json(result), flush=True)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            generate(0)
        print(f"profiled generate: forwards {steps}")
        for ev in sorted(prof.key_averages(group_by_input_shape=True), key=lambda e: -e.self_cpu_time_total)[:16]:
            shapes = ev.input_shapes
            line = f"{ev.key:38s} calls {ev.count:4d} self {ev.self_cpu_time_total / 1e3:9.1f} ms  {shapes[:3]}"
            if ev.key == "mkldnn::_linear_pointwise" and len(shapes) >= 2 and shapes[0] and shapes[1]:
                (m, k), n = shapes[0], shapes[1][0]
                line += f"  {2 * m * k * n * ev.count / (ev.self_cpu_time_total * 1e3):.0f} GFLOP/s"
            print(line)
    llm.shutdown()


if __name__ == "__main__":
    main()
