"""Where a CUDA step's time goes, for the LoRA and speculative-decoding engines against their base engines.

    python3 scripts/gpu_kernel_profile.py lora   # qwen2-100m, 16 prompts, 8 adapters rank 16 vs LoRA off
    python3 scripts/gpu_kernel_profile.py spec   # bundled model, batch 1, n-gram k=5 vs no speculation

Each engine (in-process, bfloat16, the engine's defaults otherwise) is warmed up, then one generate call runs
under torch.profiler. Printed per engine: wall time, output tokens, the summed kernel time, the kernel count, and
the top kernels and top host ops by self time: kernel time against wall time tells a GPU-bound step from a
host-bound one, and the tables say which launches or host ops to cut. A GPU-lease tool (benchmarks/ hold the
figures that count); without CUDA it runs on CPU (a dry run: host ops only).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _profile(name: str, run: Any, top: int) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    run()  # warm
    sync()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        t0 = time.perf_counter()
        toks = run()
        sync()
        wall = time.perf_counter() - t0
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_us = sum(e.self_device_time_total for e in kernels)
    launches = sum(e.count for e in kernels)
    print(
        f"### {name}: wall {wall * 1e3:.1f} ms (profiled), {toks} tokens, kernels {gpu_us / 1e3:.1f} ms "
        f"({100 * gpu_us / 1e6 / wall:.0f}% of wall), {launches} kernel runs",
        flush=True,
    )
    print(events.table(sort_by="self_device_time_total", row_limit=top, max_name_column_width=70))
    print(events.table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=70), flush=True)


def lora(top: int) -> None:
    import numpy as np

    from vllm_lite import LLM, SamplingParams
    from vllm_lite.lora.request import LoRARequest
    from vllm_lite.testing.checkpoints import get_checkpoint
    from vllm_lite.testing.lora_checkpoints import AdapterSpec, build_lora_adapter

    model = get_checkpoint("qwen2", "100m")
    tmp = tempfile.mkdtemp(prefix="lora-prof-")
    loras = [
        LoRARequest(
            f"a{i}",
            i + 1,
            build_lora_adapter(model, os.path.join(tmp, f"a{i}"), AdapterSpec(r=16, lora_alpha=32, seed=i)),
        )
        for i in range(8)
    ]
    kw: dict[str, Any] = dict(dtype="bfloat16", multiprocess=False, max_model_len=256, disable_log_stats=True)
    if _cuda():
        kw.update(gpu_memory_utilization=0.3, max_num_seqs=16)
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(10, 5000, size=64).tolist()} for _ in range(16)]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    for name, extra, reqs in (
        ("base", {}, None),
        ("lora", dict(enable_lora=True, max_loras=8, max_lora_rank=16, max_cpu_loras=8), "mixed"),
    ):
        llm = LLM(model, **extra, **kw)
        mixed = [loras[i % 8] for i in range(16)] if reqs else None

        def run(llm: Any = llm, mixed: Any = mixed) -> int:
            outs = llm.generate(prompts, params, lora_request=mixed, use_tqdm=False)
            return sum(len(o.outputs[0].token_ids) for o in outs)

        _profile(name, run, top)
        llm.shutdown()


def spec(top: int) -> None:
    from spec_decode import workloads  # benchmarks/spec_decode.py: the repetitive prompts
    from transformers import AutoTokenizer

    from vllm_lite import LLM, SamplingParams
    from vllm_lite.default_model import resolve_model

    model = resolve_model(None)
    tok = AutoTokenizer.from_pretrained(model)
    prompts = workloads(model, tok, 2, 64, tok.vocab_size, 0, device="cuda" if _cuda() else "cpu")["repetitive"]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    ngram = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    for name, extra in (
        ("plain_async", {}),
        ("plain_sync", {"async_scheduling": False}),
        ("ngram", {"speculative_config": ngram}),
    ):
        llm = LLM(
            model,
            dtype="bfloat16",
            multiprocess=False,
            max_model_len=512,
            disable_log_stats=True,
            **({"gpu_memory_utilization": 0.12, "max_num_seqs": 16} if _cuda() else {}),
            **extra,
        )

        def run(llm: Any = llm) -> int:
            out = llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
            return len(out[0].outputs[0].token_ids)

        _profile(name, run, top)
        llm.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=("lora", "spec"))
    ap.add_argument("--top", type=int, default=18)
    a = ap.parse_args()
    {"lora": lora, "spec": spec}[a.what](a.top)


if __name__ == "__main__":
    main()
