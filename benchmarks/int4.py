"""int4 (AWQ / GPTQ) against bfloat16 and float32 on the benchmark checkpoint: throughput and batch-1 latency.

Workload: throughput.py's offline one, smaller (default 16 prompts, input lengths uniform in [32, 256],
32 output tokens, greedy, ignore_eos), and batch-1 decode: one 32-token prompt, ms per output token
measured as (time for 1 + N tokens - time for 1 token) / N, so prefill is left out. The int4 checkpoint is
the ~100M Qwen2-shaped test model quantized by vllm_lite/testing/quantize.py (AWQ GEMM, group 128, by
default). Every engine runs in this process (`multiprocess=False`) at the engine core's thread policy;
the variants run interleaved, --rounds times, and the best round of each is reported, so the ratios come
from the same run. Also reported: resident bytes of the linear layers' weights (int4: bits per weight).
Prints one JSON line with the host's CPU model and capability (and GPU when --device cuda).
Off CPU every engine first runs the whole timed workload and the batch-1 runs once, untimed (each variant's
``warmup`` says what ran), so Triton's JIT compilation of each kernel specialisation stays out of the timings;
batch-1 takes the fastest of B1_REPEATS (1-token, 1+N-token) pairs, and a difference <= 0 is reported as null.

On CPU, int4 forwards of at most SMALL_M_MAX rows (batch-1 decode) run csrc's direct kernel; the variant
`int4-dequant:DTYPE` sets SMALL_M_MAX to 0 for its engine so every forward dequantizes + F.linear, as
before the kernel existed. The per-layer table (also alone with --layers-only) times, for each layer shape
of the model and each row count in --layer-rows, interleaved: the direct kernel, dequantize + F.linear, and
F.linear over float32 and bfloat16 copies of the weight; it is how SMALL_M_MAX was chosen.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch

B1_REPEATS = 3  # batch-1 timings: the fastest of this many (1-token, 1+N-token) pairs


def make_prompts(num: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    lens = rng.integers(lo, hi + 1, size=num)
    return [rng.integers(10, vocab - 10, size=int(n)).tolist() for n in lens]


def weight_bytes(model_dir: str, dtype: torch.dtype, device: str) -> dict[str, float]:
    """Resident bytes of the decoder's linear-layer weights as the engine loads them, and bits per weight."""
    from vllm_lite.engine_args import EngineArgs
    from vllm_lite.quantization.int4_linear import quantized_weight_bytes
    from vllm_lite.worker.model_loader import load_model

    mc = EngineArgs(model=model_dir, device=device, dtype=str(dtype).replace("torch.", "")).create_engine_config()
    model = load_model(mc.model_config, torch.device(device))
    held, weights = quantized_weight_bytes(model)
    if not weights:  # a float model: its parallel linear layers' weights
        for m in model.modules():
            if hasattr(m, "quant_method") and m.weight is not None:
                weights += m.weight.numel()
                held += m.weight.numel() * m.weight.element_size()
    del model
    return {"linear_weight_mb": round(held / 2**20, 1), "bits_per_weight": round(8 * held / weights, 3)}


def _int4_dequant_linear(x: torch.Tensor, layer: torch.nn.Module) -> torch.Tensor:
    from vllm_lite.quantization.int4_linear import dequantize_nk

    return torch.nn.functional.linear(x, dequantize_nk(layer, x.dtype))


def layer_timings(model_dir: str, rows: tuple[int, ...] = (1, 4, 16), reps: int = 20) -> dict[str, Any]:
    """Median ms per call of each int4 layer shape of the model, the paths interleaved in one loop: the direct
    int4 kernel, int4 dequantize + F.linear (native dequantization), and F.linear over float32 and bfloat16
    copies of the weight; plus the direct kernel's speed-up over the other two."""
    import statistics

    import torch.nn.functional as F

    from vllm_lite.engine_args import EngineArgs
    from vllm_lite.quantization import int4_linear
    from vllm_lite.quantization.int4_linear import dequantize_nk
    from vllm_lite.worker.model_loader import load_model, load_native_int4

    mc = EngineArgs(model=model_dir, device="cpu", dtype="float32").create_engine_config().model_config
    model = load_model(mc, torch.device("cpu"))
    native = load_native_int4()
    direct = int4_linear._SMALL_M[0]
    layers = {}
    for name, m in model.named_modules():
        if getattr(m, "quant_method", None) is not None:
            layers.setdefault(name.rsplit(".", 1)[1], m)  # one layer per shape (layer 0's)
    out: dict[str, Any] = {"native_kernel": native, "direct_kernel": direct is not None}
    for short, layer in layers.items():
        w32 = dequantize_nk(layer, torch.float32).clone()
        w16 = w32.to(torch.bfloat16)
        act_order = layer.g_idx_k is not None
        for m in rows:
            x = torch.randn(m, layer.in_features)
            xb = x.to(torch.bfloat16)
            paths = {"int4_dequant_f32": functools.partial(_int4_dequant_linear, x, layer)}
            if direct is not None and not act_order:
                paths["int4_direct_f32"] = functools.partial(
                    direct, x, layer.qweight_nk, layer.zeros_ng, layer.scales_ng, None
                )
            paths["float32"] = functools.partial(F.linear, x, w32)
            paths["bfloat16"] = functools.partial(F.linear, xb, w16)
            for fn in paths.values():  # warm-up (buffers, thread pool)
                fn()
            times: dict[str, list[float]] = {k: [] for k in paths}
            for _ in range(reps):
                for k, fn in paths.items():
                    t = time.perf_counter()
                    fn()
                    times[k].append(1000 * (time.perf_counter() - t))
            row: dict[str, Any] = {k: round(statistics.median(v), 3) for k, v in times.items()}
            if "int4_direct_f32" in row:
                for other in ("int4_dequant_f32", "float32"):
                    row[f"direct_speedup_vs_{other}"] = round(row[other] / row["int4_direct_f32"], 2)
            out[f"{short}[{layer.out_features}x{layer.in_features}] m={m}"] = row
    return out


def run_variant(
    model: str,
    dtype: str,
    device: str,
    prompts: list[list[int]],
    out_len: int,
    b1_len: int,
    direct: bool = True,
    num_threads: int | None = None,
) -> dict:
    """One engine in this process; direct=False: int4 forwards never take the direct kernel (SMALL_M_MAX=0)."""
    from vllm_lite.quantization import int4_linear

    saved = int4_linear.SMALL_M_MAX
    if not direct:
        int4_linear.SMALL_M_MAX = 0
    try:
        return _run_variant(model, dtype, device, prompts, out_len, b1_len, num_threads)
    finally:
        int4_linear.SMALL_M_MAX = saved


def _run_variant(
    model: str, dtype: str, device: str, prompts: list[list[int]], out_len: int, b1_len: int, num_threads: int | None
) -> dict:
    from vllm_lite import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(
        model=model,
        dtype=dtype,
        device=device,
        multiprocess=False,
        max_model_len=512,
        max_num_seqs=64,
        num_threads=num_threads,
    )
    startup = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    one = [{"prompt_token_ids": prompts[0][:32]}]

    def timed(n: int) -> float:
        t = time.perf_counter()
        llm.generate(one, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - t

    full_warmup = device != "cpu"
    try:
        warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], warm, use_tqdm=False)
        if full_warmup:
            # Untimed, the exact shapes timed below: on CUDA the first call of each Triton kernel specialisation
            # (block config / split per row count) JIT-compiles, which must not land in the timed runs.
            llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            timed(1)
            timed(1 + b1_len)
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        dt = time.perf_counter() - t0
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        # Batch 1: (1 + N tokens) - (1 token), each the fastest of B1_REPEATS interleaved pairs, so one slow
        # 1-token run cannot make the difference negative; a difference <= 0 is reported as None, never as a number.
        t1s, tns = [], []
        for _ in range(B1_REPEATS):
            t1s.append(timed(1))
            tns.append(timed(1 + b1_len))
        t1, tn = min(t1s), min(tns)
        first_tokens = outs[0].outputs[0].token_ids[:8]
    finally:
        llm.shutdown()
    b1 = 1000 * (tn - t1) / b1_len
    return {
        "tokens_per_s": n_out / dt,
        "batch1_ms_per_token": b1 if b1 > 0 else None,
        "startup_s": startup,
        "warmup": (
            "untimed: 4 prompts x 4 tokens, then the whole timed workload and the 1 and 1+N token batch-1 runs"
            if full_warmup
            else "untimed: 4 prompts x 4 tokens"
        ),
        "first_tokens": list(first_tokens),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None, help="float checkpoint (default: the ~100M Qwen2-shaped test model)")
    ap.add_argument("--method", default="awq", choices=("awq", "gptq"))
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--desc-act", action="store_true", help="GPTQ act order")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--batch1-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--variants",
        default="int4:float32,int4-dequant:float32,bfloat16,float32",
        help="comma list of DTYPE, int4:DTYPE (direct kernel for small forwards) or int4-dequant:DTYPE (never)",
    )
    ap.add_argument("--layers-only", action="store_true", help="only the per-layer timings (CPU)")
    ap.add_argument("--layer-rows", default="1,4,16", help="row counts (m) of the per-layer timings")
    ap.add_argument(
        "--num-threads",
        type=int,
        default=None,
        help="torch threads for the engines and the layer timings (default: the engine core's policy); "
        "1 on a loaded shared host, where every 2-thread OpenMP region waits on its barrier",
    )
    args = ap.parse_args()

    from vllm_lite.platform import describe_host
    from vllm_lite.testing.checkpoints import get_checkpoint
    from vllm_lite.testing.quantize import get_quantized_checkpoint, quantize_checkpoint

    host = describe_host()
    import transformers  # fully imported before any engine starts (engines may import it from a thread)

    transformers.AutoConfig  # noqa: B018 -- resolve the lazy attribute now
    if args.model is None:
        base = get_checkpoint("qwen2", size="100m")
        quant = get_quantized_checkpoint(
            "qwen2", args.method, group_size=args.group_size, desc_act=args.desc_act, size="100m"
        )
    else:
        base = args.model
        quant = os.path.join(os.path.dirname(os.path.abspath(base)), os.path.basename(base) + f"-{args.method}")
        if not os.path.isfile(os.path.join(quant, "config.json")):
            quantize_checkpoint(base, quant, args.method, args.group_size, args.desc_act)
    with open(os.path.join(base, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    layer_rows = tuple(int(r) for r in args.layer_rows.split(","))
    if args.num_threads is not None:
        torch.set_num_threads(args.num_threads)
    if args.layers_only:
        print(
            json.dumps(
                {
                    "benchmark": "int4_layers",
                    "host": host,
                    "load_avg": os.getloadavg()[0],
                    "torch_threads": torch.get_num_threads(),
                    "layers": layer_timings(quant, layer_rows),
                    "load_avg_end": os.getloadavg()[0],
                }
            )
        )
        return
    load_start = os.getloadavg()[0]
    prompts = make_prompts(args.num_prompts, 32, 256, vocab, seed=0)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    best: dict[str, dict[str, Any]] = {}
    for _ in range(args.rounds):  # interleaved: each round runs every variant once
        for v in variants:
            is_int4 = v.startswith("int4")
            dtype = v.split(":", 1)[1] if is_int4 else v
            r = run_variant(
                quant if is_int4 else base,
                dtype,
                args.device,
                prompts,
                args.output_len,
                args.batch1_tokens,
                direct=not v.startswith("int4-dequant"),
                num_threads=args.num_threads,
            )
            b = best.setdefault(v, dict(r))
            b["tokens_per_s"] = max(b["tokens_per_s"], r["tokens_per_s"])
            valid = [x for x in (b["batch1_ms_per_token"], r["batch1_ms_per_token"]) if x is not None]
            b["batch1_ms_per_token"] = min(valid) if valid else None
    for v in variants:
        is_int4 = v.startswith("int4")
        dtype = getattr(torch, v.split(":", 1)[1] if is_int4 else v)
        best[v].update(weight_bytes(quant if is_int4 else base, dtype, args.device))
        best[v]["tokens_per_s"] = round(best[v]["tokens_per_s"], 1)
        if best[v]["batch1_ms_per_token"] is not None:
            best[v]["batch1_ms_per_token"] = round(best[v]["batch1_ms_per_token"], 2)
        best[v]["startup_s"] = round(best[v]["startup_s"], 2)
    result: dict[str, Any] = {
        "benchmark": "int4",
        "host": host,
        "device": args.device,
        "model": os.path.basename(base.rstrip("/")),
        "quantization": {"method": args.method, "group_size": args.group_size, "desc_act": args.desc_act},
        "num_prompts": args.num_prompts,
        "output_len": args.output_len,
        "rounds": args.rounds,
        "torch_threads": torch.get_num_threads(),
        "load_avg_start": load_start,
        "load_avg": os.getloadavg()[0],
        "variants": best,
    }
    if args.device == "cpu":
        result["layers"] = layer_timings(quant, layer_rows)
    result["load_avg_end"] = os.getloadavg()[0]
    int4 = next((v for v in variants if v.startswith("int4:")), None)
    if int4:
        for v in variants:
            if v != int4:
                a, b = best[int4]["batch1_ms_per_token"], best[v]["batch1_ms_per_token"]
                result[f"{int4}_vs_{v}"] = {
                    "throughput_ratio": round(best[int4]["tokens_per_s"] / best[v]["tokens_per_s"], 3),
                    "batch1_latency_ratio": round(a / b, 3) if a is not None and b is not None else None,
                }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
