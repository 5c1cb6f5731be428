"""LoRA serving throughput: output tokens/s with 8 adapters mixed in every batch against the base model alone.

Workload: --num-prompts random-token prompts of --input-len tokens, --output-len greedy tokens each (ignore_eos),
all submitted at once. The base run has LoRA off; the LoRA run has enable_lora=True, max_loras=8 and gives the
prompts the 8 adapters round-robin (rank --rank, every q/k/v/o and gate/up/down projection, random weights
in PEFT's format), so every step batches all 8. Both engines live in this process (multiprocess=False) and
run interleaved --repeats times after a warm-up each, so load on the machine hits both alike; the ratio is
taken per repeat and the median is reported. ``--ops gather`` times the gather-then-bmm shrink/expand
and ``grouped`` the grouped-by-slot one, each forced, beside ``auto`` (what the engine picks per call), in the
same interleaving. Target (issue 19): LoRA >= 80% of base.
Prints the host (CPU model and capability) and one JSON line.

    python benchmarks/lora_throughput.py --num-prompts 32 --output-len 32
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from typing import Any, Optional

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np


def _prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(10, vocab - 10, size=length).tolist() for _ in range(num)]


def _timed(llm: Any, prompts: list[list[int]], params: Any, loras: Optional[list[Any]]) -> tuple[float, float, int]:
    """(wall seconds, this process's CPU seconds, output tokens): on a shared host the CPU time moves far less
    with other processes' load than the wall time does (the engines run in this process)."""
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=loras, use_tqdm=False)
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    return dt, dc, sum(len(o.outputs[0].token_ids) for o in outs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint (default: the ~100M Qwen2 test checkpoint)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--num-adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--ops",
        nargs="+",
        choices=("auto", "grouped", "gather"),
        default=["auto"],
        help="shrink/expand ways to time: auto (what the engine runs), or forced grouped-by-slot / gather+bmm",
    )
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()

    from vllm_lite import LLM, SamplingParams
    from vllm_lite.lora import torch_ops
    from vllm_lite.lora.request import LoRARequest
    from vllm_lite.platform import describe_host
    from vllm_lite.testing.checkpoints import get_checkpoint
    from vllm_lite.testing.lora_checkpoints import AdapterSpec, build_lora_adapter

    host = describe_host()
    print(f"host: {host['cpu_model']} ({host['cpu_capability']}), torch threads {host['torch_threads']}", flush=True)
    model = a.model or get_checkpoint("qwen2", "100m")
    tmp = tempfile.mkdtemp(prefix="lora-bench-")
    loras = [
        LoRARequest(
            f"adapter{i}",
            i + 1,
            build_lora_adapter(model, os.path.join(tmp, f"a{i}"), AdapterSpec(r=a.rank, lora_alpha=2 * a.rank, seed=i)),
        )
        for i in range(a.num_adapters)
    ]
    kw = dict(dtype=a.dtype, multiprocess=False, max_model_len=a.input_len + a.output_len + 16, disable_log_stats=True)
    base = LLM(model, **kw)
    lora_llm = LLM(
        model, enable_lora=True, max_loras=a.num_adapters, max_lora_rank=a.rank, max_cpu_loras=a.num_adapters, **kw
    )
    vocab = base.llm_engine.vllm_config.model_config.vocab_size
    prompts = _prompts(a.num_prompts, a.input_len, vocab, a.seed)
    params = SamplingParams(temperature=0.0, max_tokens=a.output_len, ignore_eos=True)
    mixed = [loras[i % len(loras)] for i in range(len(prompts))]
    auto = (torch_ops.lora_shrink, torch_ops.lora_expand, torch_ops.GATHER_MAX_ELEMENTS)
    variants = {
        "auto": auto,
        "grouped": (torch_ops.lora_shrink, torch_ops.lora_expand, -1),
        "gather": (torch_ops.lora_shrink_gather, torch_ops.lora_expand_gather, -1),
    }
    chosen = list(dict.fromkeys(a.ops))

    def run_lora(ops: tuple[Any, Any, int]) -> tuple[float, float, int]:
        torch_ops.lora_shrink, torch_ops.lora_expand, torch_ops.GATHER_MAX_ELEMENTS = ops
        try:
            return _timed(lora_llm, prompts, params, mixed)
        finally:
            torch_ops.lora_shrink, torch_ops.lora_expand, torch_ops.GATHER_MAX_ELEMENTS = auto

    _timed(base, prompts[:4], params, None)  # warm-ups
    for name in chosen:
        run_lora(variants[name])
    runs: dict[str, list[float]] = {"base": [], **{f"lora_{n}": [] for n in chosen}}
    cpu_runs: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(a.repeats):
        dt, dc, n = _timed(base, prompts, params, None)
        runs["base"].append(n / dt)
        cpu_runs["base"].append(n / dc)
        for name in chosen:
            dt, dc, n = run_lora(variants[name])
            runs[f"lora_{name}"].append(n / dt)
            cpu_runs[f"lora_{name}"].append(n / dc)
    ratios = {
        f"lora_{name}_over_base": statistics.median(x / b for x, b in zip(runs[f"lora_{name}"], runs["base"]))
        for name in chosen
    }
    ratios.update(
        {
            f"lora_{name}_over_base_per_cpu_s": statistics.median(
                x / b for x, b in zip(cpu_runs[f"lora_{name}"], cpu_runs["base"])
            )
            for name in chosen
        }
    )
    result = {
        "benchmark": "lora_throughput",
        "model": model,
        "dtype": str(base.llm_engine.vllm_config.model_config.dtype).replace("torch.", ""),
        "num_prompts": a.num_prompts,
        "input_len": a.input_len,
        "output_len": a.output_len,
        "num_adapters": a.num_adapters,
        "rank": a.rank,
        "repeats": a.repeats,
        "output_tok_per_s": {k: [round(x, 1) for x in v] for k, v in runs.items()},
        "median_output_tok_per_s": {k: round(statistics.median(v), 1) for k, v in runs.items()},
        "output_tok_per_cpu_s": {k: [round(x, 1) for x in v] for k, v in cpu_runs.items()},
        **{k: round(v, 3) for k, v in ratios.items()},
        "target_ratio": 0.8,
        "load_avg": os.getloadavg(),
        "host": host,
    }
    base.shutdown()
    lora_llm.shutdown()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
