"""Same-process A/B of the CPU MoE decoder paths (benchmarks/PROFILE.md, "MoE on CPU, fifth pass").

One interpreter, one in-process engine at 2 torch threads, `moe_throughput.py`'s workload (the ~25M Mixtral-shaped
moe-small, 64 random prompts of 32-256 tokens, 128 out, greedy, ignore_eos), prefix caching off, passes alternating:
A = the Python layers with the router as F.linear + fused_moe.route() (the code paths before the fifth pass),
B = the one-call C++ decoder stack with moe_cpu_route (the default). The first round of both is a warm-up (cpu_linear
checks its float32 cases there) and is not counted. Why: on a shared 2-core host separate runs swing by 20-30%,
so only passes interleaved in one process resolve a ~10% change. Prints one JSON line.

`--ab prefetch`: A = the stack with the expert ops' weight prefetch off (torch.ops.vllm_lite.moe_cpu_prefetch),
B = on (the default; csrc/moe_cpu.cpp). `--ab memory`: A = neither the prefetch nor huge pages (each layer's packed
experts copied into ordinary memory), B = both (the default: fused_moe's packed copies in huge-page-advised memory).
Neither changes a bit: greedy tokens are compared in both dtypes.

    python benchmarks/moe_cpu_ab.py [--dtype bfloat16] [--rounds 4] [--ab stack|prefetch|memory]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from throughput import make_prompts  # noqa: E402

from vllm_lite.testing.baselines import bench_json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--model", default=None)
    ap.add_argument("--ab", choices=("stack", "prefetch", "memory"), default="stack", help="what A and B differ in")
    args = ap.parse_args()
    torch.set_num_threads(2)
    from vllm_lite import LLM, SamplingParams
    from vllm_lite.testing.checkpoints import get_checkpoint
    from vllm_lite.worker import model_runner
    from vllm_lite.worker.models import cpu_decoder_stack as cds
    from vllm_lite.worker.models import fused_moe

    steps: list[tuple[int, float]] = []
    runner_cls = model_runner.GPUModelRunner if hasattr(model_runner, "GPUModelRunner") else None
    if runner_cls is None:
        runner_cls = next(c for c in vars(model_runner).values() if isinstance(c, type) and "execute_model" in vars(c))
    real = runner_cls.execute_model

    def timed(self, so, *a, **k):
        t0 = time.perf_counter()
        out = real(self, so, *a, **k)
        steps.append((so.total_num_scheduled_tokens, time.perf_counter() - t0))
        return out

    runner_cls.execute_model = timed
    route_op = fused_moe._cpu_route_op

    from vllm_lite.worker.attention.cpu_kernels import cpu_op

    prefetch = cpu_op("moe_cpu_prefetch") if args.ab != "stack" else None
    if args.ab != "stack" and prefetch is None:
        raise SystemExit("moe_cpu_prefetch: csrc's CPU kernels are not built here")
    copies: list[tuple[object, tuple, tuple]] = []  # --ab memory: (experts, huge-page (w13, w2), ordinary copies)

    def mode(new: bool) -> None:
        if prefetch is not None:  # both sides: the stack and moe_cpu_route
            prefetch(new)
            for experts, huge, plain in copies:  # the stack sees the swap and rebuilds its weights
                experts.w13, experts.w2 = huge if new else plain
            return
        cds._ON[0] = new
        fused_moe._cpu_route_op = route_op if new else (lambda: None)

    model = args.model or get_checkpoint("mixtral", size="moe-small")
    llm = LLM(
        model=model,
        dtype=args.dtype,
        multiprocess=False,
        max_model_len=512,
        max_num_seqs=64,
        enable_prefix_caching=False,
    )
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    if args.ab == "memory":  # the in-process engine's MoE layers' packed experts
        kinds = (fused_moe.KernelExperts, fused_moe.Bf16KernelExperts)
        for experts in (o for o in gc.get_objects() if isinstance(o, kinds)):
            copies.append((experts, (experts.w13, experts.w2), (experts.w13.clone(), experts.w2.clone())))
        if not copies:
            raise SystemExit("--ab memory: no C++ MoE experts in this engine")
    res: dict[str, list[dict]] = {"A": [], "B": []}
    tokens: dict[str, list] = {"A": [], "B": []}
    for r in range(args.rounds + 1):
        for m in ("A", "B"):
            mode(m == "B")
            prompts = make_prompts(64, 32, 256, 8000, seed=r % 2)
            steps.clear()
            t0 = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            dt = time.perf_counter() - t0
            n = sum(len(o.outputs[0].token_ids) for o in outs)
            tokens[m].append([list(o.outputs[0].token_ids) for o in outs])
            full = [s for rows, s in steps if rows == 64]
            if r > 0:
                res[m].append(
                    {
                        "tokens_per_s": round(n / dt, 1),
                        "decode_step_median_ms": round(statistics.median(full) * 1e3, 2) if full else None,
                        "prefill_steps_s": round(sum(s for rows, s in steps if rows > 64), 3),
                    }
                )
    mode(True)
    same = all(a == b for a, b in zip(tokens["A"], tokens["B"]))
    names = {
        "stack": ("A_python_layers_torch_routing", "B_cpp_stack_cpp_routing"),
        "prefetch": ("A_prefetch_off", "B_prefetch_on"),
        "memory": ("A_no_prefetch_4k_pages", "B_prefetch_huge_pages"),
    }[args.ab]
    summary = {
        m: {
            "tokens_per_s_median": statistics.median(x["tokens_per_s"] for x in res[m]),
            "decode_step_median_ms": statistics.median(x["decode_step_median_ms"] for x in res[m]),
        }
        for m in res
    }
    print(
        bench_json(
            {
                "benchmark": "moe_cpu_ab",
                "dtype": args.dtype,
                "model": os.path.basename(model.rstrip("/")),
                "ab": args.ab,
                names[0]: summary["A"],
                names[1]: summary["B"],
                "speedup": round(summary["B"]["tokens_per_s_median"] / summary["A"]["tokens_per_s_median"], 3),
                # The prefetch changes no bits (bf16 too); the stack's routing moves float32 sums by ~1 ulp.
                "greedy_tokens_equal": same if args.dtype == "float32" or prefetch is not None else None,
                "passes": res,
                "load_1min": round(os.getloadavg()[0], 2),
            }
        )
    )


if __name__ == "__main__":
    main()
