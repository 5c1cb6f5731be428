"""The engine's decode steps with gate_up + SiLU-and-mul fused into one kernel call against the path before it
(the plain gate_up copies, then SiLU-and-mul), interleaved round by round in one process on one model.

One in-process `LLM` (bf16, the bench Qwen2 ~128M). Its gated MLPs' gate_up modules carry both copy sets, and
each round swaps them in (cpu_prepack's interleaved copies + `gate_up_interleaved`, or plain copies rebuilt from
them); the C++ decoder stack notices the swap by identity and rebuilds its weights. Workloads, each timed per
round on both sides (alternating which goes first):
- step32: --batch random prompts of 16 tokens, --output-len greedy tokens each: the 32-row decode step;
- step1: one such prompt: the batch-1 decode step.
Reports ms per step (elapsed / output tokens per request, so a round's one prefill step is spread over it),
medians per side, the median of the per-round ratios fused / plain, whether the sides' tokens were identical,
and the load average, as one JSON line.

    python benchmarks/gate_up_silu_engine.py [--rounds 6] [--batch 32] [--output-len 64]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from vllm_lite import LLM, SamplingParams
from vllm_lite.testing.baselines import bench_json
from vllm_lite.testing.checkpoints import get_checkpoint
from vllm_lite.worker.models import cpu_prepack


def copy_sets(model: torch.nn.Module) -> list[tuple[torch.nn.Module, dict, dict]]:
    """(gate_up module, its fused attributes, plain attributes) for every interleaved gate_up."""
    out = []
    for m in model.modules():
        d = m.__dict__.get(cpu_prepack._GATE_UP_ATTR)
        if d is None:
            continue
        fused = {a: m.__dict__[a] for a in (cpu_prepack._SMALL_ATTR, cpu_prepack._VNNI_ATTR, cpu_prepack._GATE_UP_ATTR)}
        blocked = fused[cpu_prepack._SMALL_ATTR]  # [N/4, K/32, 4, 32] of the interleaved rows
        k = blocked.shape[1] * blocked.shape[3]
        wi = blocked.permute(0, 2, 1, 3).reshape(-1, k)
        blocks = wi.view(-1, 2, cpu_prepack.GATE_UP_BLOCK, k)
        w = torch.cat([blocks[:, 0].reshape(-1, k)[:d], blocks[:, 1].reshape(-1, k)[:d]])
        assert torch.equal(cpu_prepack.interleave_gate_up(w, d), wi)
        plain = {
            cpu_prepack._SMALL_ATTR: cpu_prepack.block_weight(w),
            cpu_prepack._VNNI_ATTR: cpu_prepack.vnni_weight(w),
        }
        out.append((m, fused, plain))
    return out


def use(sets: list, side: str) -> None:
    for m, fused, plain in sets:
        for a in fused:
            m.__dict__.pop(a, None)
        m.__dict__.update(fused if side == "fused" else plain)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    args = ap.parse_args()
    llm = LLM(model=get_checkpoint("qwen2", size="100m"), dtype="bfloat16", max_model_len=512, multiprocess=False)
    model = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner.model
    sets = copy_sets(model)
    assert sets, "no interleaved gate_up copies: are the AVX512-BF16 kernels built?"
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(100, 20000, (16,), generator=g).tolist()} for _ in range(args.batch)]
    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    work = {"step32": prompts, "step1": prompts[:1]}
    times: dict[str, dict[str, list[float]]] = {w: {"fused": [], "plain": []} for w in work}
    tokens: dict[str, dict[str, list]] = {w: {} for w in work}
    for r in range(args.rounds + 1):
        for side in ("fused", "plain") if r % 2 == 0 else ("plain", "fused"):
            use(sets, side)
            for w, ps in work.items():
                t0 = time.perf_counter()
                outs = llm.generate(ps, sp, use_tqdm=False)
                dt = time.perf_counter() - t0
                if r == 0:  # warm-up round (the stack rebuilds, caches fill)
                    tokens[w][side] = [o.outputs[0].token_ids for o in outs]
                    continue
                times[w][side].append(dt / args.output_len * 1e3)
    use(sets, "fused")
    res = {}
    for w in work:
        f, p = times[w]["fused"], times[w]["plain"]
        res[w] = {
            "fused_ms": round(statistics.median(f), 3),
            "plain_ms": round(statistics.median(p), 3),
            "fused_over_plain": round(statistics.median(a / b for a, b in zip(f, p)), 4),
            "rounds_fused_ms": [round(v, 2) for v in f],
            "rounds_plain_ms": [round(v, 2) for v in p],
            "same_tokens": tokens[w]["fused"] == tokens[w]["plain"],
        }
    res["threads"] = torch.get_num_threads()
    res["load"] = [round(v, 2) for v in os.getloadavg()]
    print(bench_json(res), flush=True)


if __name__ == "__main__":
    main()
