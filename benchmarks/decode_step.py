"""A CPU decode step of vs_vllm's workload against the sum of its parts (issue #15).

An in-process LLM (bench Qwen2 ~128M, bf16 by the dtype policy, prefix caching off) runs vs_vllm's 32 random
prompts of 32-256 tokens (prompt set 0, as prefill_step.py does) with max_tokens=65; the last 32-row
cpu_decoder_layers call of that generate (contexts 96-314: each prompt plus 64 generated tokens) is kept, its
arguments copied, and after the generate the same call is replayed: the step, 12 layers through the real op.
Then, in the same process and in rotating order each round, its parts over the same tensors:

- linears: the 48 VNNI calls the op makes (qkv, o, gate_up with SiLU-and-mul, down; layer by layer, the model's
  own copies, the op's row rule) from Python, each on a [32, K] bf16 input; `linears_hot` runs layer 0's four 12
  times (17 MB of weights: L3) so the difference is what streaming 257 MB from DRAM costs;
- attention: paged_attention over the 12 layers' caches with the step's block table, lengths and query;
- small: per layer the two fused RMSNorms (with residual), the rotary of q and k in place and the K/V write.

Each part is a sequence of Python-level op calls, so each also pays the dispatcher: `py_call_us` (a trivial
op's round trip) times the calls is printed beside them; the op itself makes those calls from C++. Prints one
JSON line: medians (ms) of each, their sum and `step - sum` (what the op's step costs beyond its parts run
alone), the load average, whether the native CPU kernels loaded. The replay writes the same K/V to the same
slots every time, so the cache is as the engine left it.

    python benchmarks/decode_step.py [--rounds 7] [--reps 5] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from vs_vllm import make_prompts  # noqa: E402

from vllm_lite.testing.baselines import bench_json  # noqa: E402

ROWS = 32


class _Capture:
    """Stands in for torch.ops.vllm_lite.cpu_decoder_layers (run_stack calls `.default`): records the arguments
    of each ROWS-row call (copies of the per-step tensors; the weights and KV caches by reference), then runs it."""

    def __init__(self, packet: Any) -> None:
        self.packet = packet
        self.args: tuple | None = None

    def default(self, *args: Any) -> Any:
        import torch

        if args[1].shape[0] == ROWS:
            self.args = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
        return self.packet.default(*args)


def _median_ms(fn: Callable[[], Any], reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--reps", type=int, default=5, help="timed calls of each part a round (median)")
    ap.add_argument("--threads", type=int, default=None, help="the engine's torch threads (default: its policy)")
    args = ap.parse_args()

    import torch

    from vllm_lite import LLM, SamplingParams
    from vllm_lite.testing.checkpoints import get_checkpoint
    from vllm_lite.worker.attention.cpu_kernels import load_cpu_ops
    from vllm_lite.worker.models import cpu_prepack

    model_dir = get_checkpoint("qwen2", size="100m")
    with open(os.path.join(model_dir, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    kw = {"num_threads": args.threads} if args.threads else {}
    llm = LLM(
        model=model_dir,
        dtype="auto",
        max_model_len=512,
        max_num_seqs=64,
        multiprocess=False,
        enable_prefix_caching=False,
        **kw,
    )
    ops = torch.ops.vllm_lite
    packet = ops.cpu_decoder_layers
    cap = _Capture(packet)
    setattr(ops, "cpu_decoder_layers", cap)  # noqa: B010 (an _OpNamespace caches its packets as attributes)
    try:
        prompts = [{"prompt_token_ids": p} for p in make_prompts(32, 32, 256, vocab, 0)]
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=65, ignore_eos=True), use_tqdm=False)
    finally:
        setattr(ops, "cpu_decoder_layers", packet)  # noqa: B010
    if cap.args is None:
        raise SystemExit("no 32-row cpu_decoder_layers call was seen (the C++ stack did not run)")
    a = cap.args
    hidden, positions, caches = a[1], a[3], a[4]
    block_table, seq_lens, qsl, slots, impl = a[5], a[6], a[7], a[8], a[9]
    model = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner.model
    layers = list(model.model.layers)
    if not (cpu_prepack.SMALL_M_MAX < ROWS <= cpu_prepack.VNNI_MAX):
        raise SystemExit(f"{ROWS} rows do not take the VNNI kernels here (SMALL_M_MAX / VNNI_MAX changed)")

    def vnni(lin: Any) -> tuple[torch.Tensor, Any, Any]:
        return lin.__dict__[cpu_prepack._VNNI_ATTR], lin.bias, lin.__dict__.get(cpu_prepack._GATE_UP_ATTR)

    hid = hidden.shape[1]
    rng = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=rng) * 0.5).to(torch.bfloat16)

    lin_calls: list[Callable[[], Any]] = []
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            w, bias, d = vnni(lin)
            x = rand(ROWS, w.shape[1] * 2)
            if d is not None:
                lin_calls.append(lambda x=x, w=w, d=int(d), b=bias: ops.bf16_gate_up_vnni(x, w, d, b, True))
            else:
                lin_calls.append(lambda x=x, w=w, b=bias: ops.bf16_linear_vnni(x, w, w.shape[0] * 32, b))
    lin_hot = lin_calls[:4] * len(layers)

    heads, kvh, hd = layers[0].self_attn.num_heads, layers[0].self_attn.num_kv_heads, layers[0].self_attn.head_dim
    scale = float(layers[0].self_attn.attn.scale)
    q = rand(ROWS, heads, hd)
    attn_out = torch.empty_like(q)
    attn_calls = [
        lambda kv=kv: ops.paged_attention(attn_out, q, kv, block_table, seq_lens, qsl, scale, 0, 0.0, impl)
        for kv in caches
    ]

    small_calls: list[Callable[[], Any]] = []
    x0, r0 = rand(ROWS, hid), rand(ROWS, hid)
    qkv = rand(ROWS, (heads + 2 * kvh) * hd)
    qv, kv_ = qkv[:, : heads * hd], qkv[:, heads * hd : (heads + kvh) * hd]
    k3 = kv_.view(ROWS, kvh, hd)
    v3 = qkv[:, (heads + kvh) * hd :].view(ROWS, kvh, hd)
    slot_rows = slots[:ROWS]
    for layer, kv in zip(layers, caches):
        rot = layer.self_attn.rotary_emb
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            small_calls.append(lambda n=norm: ops.fused_rms_norm(x0, r0, n.weight, n.eps, False))
            if norm is layer.input_layernorm:
                cs, rd = rot.cos_sin_cache, rot.rotary_dim
                small_calls.append(lambda cs=cs, rd=rd: ops.fused_rotary_embedding(positions, qv, kv_, cs, hd, rd))
                small_calls.append(lambda kv=kv: ops.write_kv(k3, v3, kv, slot_rows))

    def seq(calls: list[Callable[[], Any]]) -> Callable[[], None]:
        def run() -> None:
            for c in calls:
                c()

        return run

    def step() -> Any:
        return packet.default(*a)

    trivial = [lambda: ops.fused_cpu_ops_vector_width()] * 1000
    parts: dict[str, Callable[[], Any]] = {
        "step": step,
        "linears": seq(lin_calls),
        "linears_hot": seq(lin_hot),
        "attention": seq(attn_calls),
        "small": seq(small_calls),
    }
    for fn in parts.values():  # warm: first touches, the heap
        fn()
    res: dict[str, list[float]] = {k: [] for k in parts}
    py_call = []
    names = list(parts)
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            res[name].append(_median_ms(parts[name], args.reps))
        py_call.append(_median_ms(seq(trivial), 3))  # ms for 1,000 calls = us a call
    med = {k: round(statistics.median(v), 3) for k, v in res.items()}
    parts_sum = med["linears"] + med["attention"] + med["small"]
    ctx = (seq_lens[:ROWS]).tolist()
    result = {
        "benchmark": "decode_step",
        "threads": torch.get_num_threads(),
        "rows": ROWS,
        "contexts": [min(ctx), max(ctx)],
        "rounds": args.rounds,
        "reps": args.reps,
        "median_ms": med,
        "sum_of_parts_ms": round(parts_sum, 3),
        "step_minus_parts_ms": round(med["step"] - parts_sum, 3),
        "cold_minus_hot_linears_ms": round(med["linears"] - med["linears_hot"], 3),
        "calls": {"linears": len(lin_calls), "attention": len(attn_calls), "small": len(small_calls)},
        "py_call_us": round(statistics.median(py_call), 2),
        "rounds_ms": {k: [round(x, 3) for x in v] for k, v in res.items()},
        "native_kernels_loaded": bool(load_cpu_ops()),
        "load_avg_at_end": os.getloadavg(),
    }
    print(bench_json(result), flush=True)
    llm.shutdown()


if __name__ == "__main__":
    main()
