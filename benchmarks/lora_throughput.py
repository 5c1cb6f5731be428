"""LoRA serving throughput: output tokens/s with 8 adapters mixed in every batch against the base model alone.

Workload: --num-prompts random-token prompts of --input-len tokens, --output-len greedy tokens each (ignore_eos),
all submitted at once. The base run has LoRA off; the LoRA run has enable_lora=True, max_loras=8 and gives the
prompts the 8 adapters round-robin (rank --rank, every q/k/v/o and gate/up/down projection, random weights
in PEFT's format), so every step batches all 8. Both engines live in this process (multiprocess=False) and
run interleaved --repeats times after a warm-up each, so load on the machine hits both alike; the ratio is
taken per repeat and the median is reported. ``--ops`` picks the CPU LoRA ways to time in the same
interleaving: ``auto`` (what the engine runs: ``torch_ops.add_lora``, csrc's ``lora_add_cpu`` for steps of at most
KERNEL_MAX_TOKENS tokens, else segments), ``segments`` (segments of one slot, two bmm's, for every step),
``grouped`` (one matmul per slot present, shrink then expand), ``gather`` (each token's A/B gathered, bmm), and
``none`` (no delta at all: what the wrappers and per-step slot planning cost by themselves; wrong tokens).
``--num-threads`` pins both engines' torch threads (1 is steadier on a shared host).
Target (issue 19): LoRA >= 80% of base.

``--micro`` times one projection instead (no engine): the base matmul and each way's delta, plus ``stacked``
(every slot's A as one [in, S * r] matrix, one matmul, columns masked by each token's slot, one matmul against
the stacked B: max_loras times the LoRA flops, no grouping), interleaved, median microseconds per call.
Prints the host (CPU model and capability) and one JSON line.

    python benchmarks/lora_throughput.py --num-prompts 32 --output-len 32
    python benchmarks/lora_throughput.py --micro

``--device cuda`` runs both engines on the GPU (bfloat16 unless ``--dtype`` says otherwise; each with a third of its
memory and max_num_seqs = the prompt count; ``--output-len`` 128 by default there, so decode steps, which replay
CUDA graphs in both engines, dominate); the LoRA delta is then the Triton kernels' (``--ops`` is CPU-only). The JSON
names the device and GPU. ``--quick``: 16 prompts, 2 repeats. Well under two minutes on a GPU:

    python benchmarks/lora_throughput.py --device cuda
    python benchmarks/lora_throughput.py --device cuda --quick

``--cuda-ab`` adds a third engine, a LoRA one built, captured and run with ``triton_ops.add_lora_bgmv`` off (the
launches before it: a zeroed buffer filled by atomics, then the expands), interleaved with the other two, so
``lora_pre_bgmv_over_base`` and ``lora_auto_over_lora_pre_bgmv`` are the A/B in one process (each engine then
gets a quarter of the GPU's memory instead of a third).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time
from typing import Any, Callable, Optional

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


Delta = Callable[[Any, Any, Any, list, list, Any], None]


def _per_op(shrink: Callable[..., Any], expand: Callable[..., Any]) -> Delta:
    """add_lora's signature over a shrink/expand pair (the per-op ways the engine ran before add_lora)."""

    def add(y: Any, x: Any, lora_a: Any, lora_b: list, offsets: list, slots: Any, lora_bt: Any = None) -> None:
        buf = shrink(x, lora_a, slots)
        r = lora_a.shape[1] // len(lora_b)
        for i, (b, off) in enumerate(zip(lora_b, offsets)):
            expand(y, buf if len(lora_b) == 1 else buf[:, i * r : (i + 1) * r].contiguous(), b, slots, off)

    return add


@contextlib.contextmanager
def _bgmv_off() -> Any:
    """CUDA LoRA layers take the launches before triton_ops.add_lora_bgmv while inside (ops looks it up per call)."""
    from vllm_lite.lora import triton_ops

    two_launch = triton_ops.add_lora_bgmv
    triton_ops.add_lora_bgmv = lambda *args, **kw: False
    try:
        yield
    finally:
        triton_ops.add_lora_bgmv = two_launch


def _graph_keys(llm: Any) -> Optional[str]:
    """What the engine captured (cuda_graphs.CudaDecodeGraphs.describe), or None: every step eager."""
    graphs = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner.cuda_graphs
    return None if graphs is None else graphs.describe()


def _ways() -> dict[str, Delta]:
    from vllm_lite.lora import torch_ops

    return {
        "auto": torch_ops.add_lora,
        "segments": lambda y, x, a, b, off, s, lora_bt=None: torch_ops.add_lora_segments(y, x, a, b, off, s),
        "grouped": _per_op(torch_ops.lora_shrink, torch_ops.lora_expand),
        "gather": _per_op(torch_ops.lora_shrink_gather, torch_ops.lora_expand_gather),
        "none": lambda *args, **kw: None,
    }


def _time_projection(d_in: int, outs: list[int], t: int, a: argparse.Namespace) -> dict[str, float]:
    """Median microseconds per call of the base matmul and each way's delta, one [t, d_in] input."""
    import torch

    from vllm_lite.lora import torch_ops

    g = torch.Generator().manual_seed(a.seed)
    s, r, n = a.num_adapters, a.rank, len(outs)
    w = torch.randn(sum(outs), d_in, generator=g) / d_in**0.5
    lora_a = torch.randn(s, n * r, d_in, generator=g) / d_in**0.5
    lora_b = [torch.randn(s, o, r, generator=g) / r for o in outs]
    offsets = [sum(outs[:i]) for i in range(n)]
    lora_bt = torch.cat([b.transpose(1, 2) for b in lora_b], dim=2).contiguous()  # what CPU layers keep
    # stacked: columns ordered (sub, slot, rank), so sub i's are one block for its expand
    a_st = lora_a.view(s, n, r, d_in).permute(3, 1, 0, 2).reshape(d_in, n * s * r).contiguous()
    b_st = [b.permute(0, 2, 1).reshape(s * r, -1).contiguous() for b in lora_b]
    x = torch.randn(t, d_in, generator=g)
    y = torch.zeros(t, sum(outs))
    slots = (torch.arange(t) % s).to(torch.int32)
    mask = torch.nn.functional.one_hot(slots.long(), s).float().repeat_interleave(r, 1).repeat(1, n)

    def stacked() -> None:
        h = (x @ a_st).mul_(mask)
        for i, (b, off) in enumerate(zip(b_st, offsets)):
            y.narrow(1, off, b.shape[1]).addmm_(h[:, i * s * r : (i + 1) * s * r], b)

    fns: dict[str, Callable[[], Any]] = {"base": lambda: torch.nn.functional.linear(x, w)}
    for way, fn in _ways().items():
        fns[way] = lambda fn=fn: fn(y, x, lora_a, lora_b, offsets, slots, lora_bt=lora_bt)
    fns["stacked"] = stacked
    times: dict[str, list[float]] = {k: [] for k in fns}
    torch_ops.set_step_slots(slots)  # the engine plans once per step; every timed call reuses it
    try:
        for _ in range(a.micro_rounds):
            for k, fn in fns.items():
                t0 = time.perf_counter()
                fn()
                times[k].append(time.perf_counter() - t0)
    finally:
        torch_ops.set_step_slots(None)
    return {k: round(statistics.median(v) * 1e6, 1) for k, v in times.items()}


def micro(a: argparse.Namespace) -> dict[str, Any]:
    """One projection of the 100M Qwen2's shapes at several token counts (8 slots round-robin)."""
    shapes = {"qkv_proj": (768, [768, 256, 256]), "gate_up_proj": (768, [3072, 3072]), "down_proj": (3072, [768])}
    out: dict[str, Any] = {}
    for name, (d_in, outs) in shapes.items():
        for t in a.micro_tokens:
            out[f"{name}/T={t}"] = _time_projection(d_in, outs, t, a)
            print(name, t, out[f"{name}/T={t}"], flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint (default: the ~100M Qwen2 test checkpoint)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=None, help="default 32 on CPU, 128 on CUDA")
    ap.add_argument("--num-adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--ops",
        nargs="+",
        choices=("auto", "segments", "grouped", "gather", "none"),
        default=["auto"],
        help="CPU LoRA ways: auto (what the engine runs), segments (bmm only), per-op grouped / gather+bmm, or none",
    )
    ap.add_argument("--num-threads", type=int, default=None, help="torch threads of both engines (default: policy)")
    ap.add_argument("--micro", action="store_true", help="time one projection per way instead of the engine")
    ap.add_argument("--micro-tokens", type=int, nargs="+", default=[8, 32, 256, 2048])
    ap.add_argument("--micro-rounds", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--device", default="cpu", help="cpu (default) or cuda / cuda:N: both engines there, bfloat16 unless --dtype"
    )
    ap.add_argument("--quick", action="store_true", help="16 prompts, 2 repeats")
    ap.add_argument(
        "--cuda-ab", action="store_true", help="CUDA: also a LoRA engine without add_lora_bgmv (A/B, one process)"
    )
    a = ap.parse_args()
    on_cuda = a.device.startswith("cuda")
    if a.output_len is None:
        a.output_len = 128 if on_cuda else 32
    if on_cuda:
        if a.dtype == "auto":
            a.dtype = "bfloat16"
        if a.micro or a.ops != ["auto"]:
            ap.error("--micro and --ops time the CPU LoRA ways; on CUDA the engine runs the Triton kernels")
    elif a.cuda_ab:
        ap.error("--cuda-ab compares the CUDA LoRA launches; it needs --device cuda")
    if a.quick:
        a.num_prompts, a.repeats = 16, 2

    import torch

    if a.num_threads is not None:  # both engines run in this process (multiprocess=False): its threads are theirs
        torch.set_num_threads(a.num_threads)

    from vllm_lite import LLM, SamplingParams
    from vllm_lite.lora import torch_ops
    from vllm_lite.lora.request import LoRARequest
    from vllm_lite.platform import describe_host
    from vllm_lite.testing.checkpoints import get_checkpoint
    from vllm_lite.testing.lora_checkpoints import AdapterSpec, build_lora_adapter

    host = describe_host()
    print(f"host: {host['cpu_model']} ({host['cpu_capability']}), torch threads {host['torch_threads']}", flush=True)
    if a.micro:
        res = micro(a)
        print(json.dumps({"benchmark": "lora_projection_us", **res, "load_avg": os.getloadavg(), "host": host}))
        return
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
    kw: dict[str, Any] = dict(
        dtype=a.dtype,
        multiprocess=False,
        max_model_len=a.input_len + a.output_len + 16,
        disable_log_stats=True,
        device=a.device,
    )
    if on_cuda:  # two (three) engines in one process share the GPU; their CUDA graphs cover the whole batch
        kw.update(gpu_memory_utilization=0.25 if a.cuda_ab else 0.3, max_num_seqs=max(a.num_prompts, 1))
    lora_kw = dict(enable_lora=True, max_loras=a.num_adapters, max_lora_rank=a.rank, max_cpu_loras=a.num_adapters)
    base = LLM(model, **kw)
    lora_llm = LLM(model, **lora_kw, **kw)
    pre_bgmv = None
    if a.cuda_ab:
        with _bgmv_off():  # its graphs are captured with the old launches
            pre_bgmv = LLM(model, **lora_kw, **kw)
    vocab = base.llm_engine.vllm_config.model_config.vocab_size
    prompts = _prompts(a.num_prompts, a.input_len, vocab, a.seed)
    params = SamplingParams(temperature=0.0, max_tokens=a.output_len, ignore_eos=True)
    mixed = [loras[i % len(loras)] for i in range(len(prompts))]
    variants = _ways()
    chosen = list(dict.fromkeys(a.ops))

    def run_lora(way: Delta) -> tuple[float, float, int]:
        auto = torch_ops.add_lora
        torch_ops.add_lora = way  # ops.add_lora looks it up per call
        try:
            return _timed(lora_llm, prompts, params, mixed)
        finally:
            torch_ops.add_lora = auto

    def run_pre_bgmv() -> tuple[float, float, int]:
        with _bgmv_off():
            return _timed(pre_bgmv, prompts, params, mixed)

    _timed(base, prompts[:4], params, None)  # warm-ups
    for name in chosen:
        run_lora(variants[name])
    if pre_bgmv is not None:
        run_pre_bgmv()
    runs: dict[str, list[float]] = {"base": [], **{f"lora_{n}": [] for n in chosen}}
    if pre_bgmv is not None:
        runs["lora_pre_bgmv"] = []
    cpu_runs: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(a.repeats):
        dt, dc, n = _timed(base, prompts, params, None)
        runs["base"].append(n / dt)
        cpu_runs["base"].append(n / dc)
        for name in chosen:
            dt, dc, n = run_lora(variants[name])
            runs[f"lora_{name}"].append(n / dt)
            cpu_runs[f"lora_{name}"].append(n / dc)
        if pre_bgmv is not None:
            dt, dc, n = run_pre_bgmv()
            runs["lora_pre_bgmv"].append(n / dt)
            cpu_runs["lora_pre_bgmv"].append(n / dc)
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
    if pre_bgmv is not None:
        ratios["lora_pre_bgmv_over_base"] = statistics.median(
            x / b for x, b in zip(runs["lora_pre_bgmv"], runs["base"])
        )
        ratios["lora_auto_over_lora_pre_bgmv"] = statistics.median(
            x / b for x, b in zip(runs["lora_auto"], runs["lora_pre_bgmv"])
        )
    result = {
        "benchmark": "lora_throughput",
        "model": model,
        "device": a.device,
        "gpu": torch.cuda.get_device_name(torch.device(a.device)) if on_cuda else None,
        "cuda_graphs": {
            name: _graph_keys(llm)
            for name, llm in (("base", base), ("lora", lora_llm), ("lora_pre_bgmv", pre_bgmv))
            if llm is not None
        },
        "dtype": str(base.llm_engine.vllm_config.model_config.dtype).replace("torch.", ""),
        "num_prompts": a.num_prompts,
        "input_len": a.input_len,
        "output_len": a.output_len,
        "num_adapters": a.num_adapters,
        "rank": a.rank,
        "repeats": a.repeats,
        "torch_threads": torch.get_num_threads(),
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
    if pre_bgmv is not None:
        pre_bgmv.shutdown()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
