"""Pieces of benchmarks/gpu.py that are not CUDA-specific: the model shapes, random-weight checkpoints
built on any device, the device probes (copy bandwidth, matmul rate), the per-step roofline and the
busy fraction of a profiled window. Tested on CPU (tests/test_gpu_bench_smoke.py).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable, Optional

import torch

# name -> (arch, config kwargs). Llama shapes use vocab 8000; "qwen2-100m" is the CI bench shape
# (vllm_lite.testing.checkpoints, size "100m"), with its tokenizer's vocabulary.
_LLAMA_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_attention_heads=32,
    num_key_value_heads=8,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
)
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-1b": (
        "llama",
        dict(
            hidden_size=2048,
            intermediate_size=5632,
            num_hidden_layers=22,
            num_attention_heads=32,
            num_key_value_heads=4,
            rope_theta=10000.0,
            rms_norm_eps=1e-5,
        ),
    ),
    "llama-8b-8l": ("llama", dict(_LLAMA_8B, num_hidden_layers=8)),
    "llama-8b": ("llama", dict(_LLAMA_8B, num_hidden_layers=32)),
    "qwen2-100m": ("qwen2", {}),
    # The CPU smoke shape: seconds to build and run.
    "tiny": (
        "llama",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            rms_norm_eps=1e-5,
        ),
    ),
}
SHAPE_VOCAB = {"qwen2-100m": 32000, "tiny": 512}
DEFAULT_VOCAB = 8000


def shape_vocab(name: str) -> int:
    return SHAPE_VOCAB.get(name, DEFAULT_VOCAB)


def hf_config(name: str):
    """The transformers config of shape `name` (bos 1, eos 2, pad 0, as the test checkpoints)."""
    import transformers

    from vllm_lite.testing.checkpoints import BOS_ID, EOS_ID, PAD_ID, _hf_config

    if name not in SHAPES:
        raise ValueError(f"shape must be one of {sorted(SHAPES)}, got {name!r}.")
    arch, kwargs = SHAPES[name]
    vocab = shape_vocab(name)
    if arch == "qwen2":
        return _hf_config("qwen2", "100m", vocab, None)
    return transformers.LlamaConfig(
        architectures=["LlamaForCausalLM"],
        vocab_size=vocab,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        **kwargs,
    )


def config_facts(cfg: dict[str, Any]) -> dict[str, int]:
    """Layer counts and sizes from a config.json dict, with the per-token matmul parameters
    (every projection and the LM head; the embedding is a row lookup, not counted)."""
    h, n_layers, inter = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    hd = cfg.get("head_dim") or h // heads
    attn = h * hd * (heads + 2 * kv) + heads * hd * h
    mlp = 3 * h * inter
    return {
        "hidden_size": h,
        "num_layers": n_layers,
        "intermediate_size": inter,
        "num_heads": heads,
        "num_kv_heads": kv,
        "head_dim": hd,
        "vocab_size": cfg["vocab_size"],
        "matmul_params": n_layers * (attn + mlp) + h * cfg["vocab_size"],
    }


def decode_step_cost(facts: dict[str, int], batch: float, sum_context: float, dtype_bytes: int) -> dict[str, float]:
    """Bytes a decode step must move and FLOPs it must do, at `batch` sequences whose contexts sum to
    `sum_context` tokens: every matmul weight read once, each sequence's K and V read for every layer;
    FLOPs: 2 per weight per token, plus QK^T and PV (2 x 2 x heads x head_dim per context token per layer)."""
    weight_bytes = facts["matmul_params"] * dtype_bytes
    kv_per_token = 2 * facts["num_layers"] * facts["num_kv_heads"] * facts["head_dim"] * dtype_bytes
    kv_bytes = kv_per_token * sum_context
    flops = (
        2.0 * facts["matmul_params"] * batch
        + 4.0 * facts["num_layers"] * facts["num_heads"] * facts["head_dim"] * sum_context
    )
    return {"weight_bytes": float(weight_bytes), "kv_read_bytes": float(kv_bytes), "flops": float(flops)}


def roofline(
    cost: dict[str, float], measured_ms: float, copy_bytes_per_s: float, matmul_flops_per_s: float
) -> dict[str, float]:
    """Measured step time against max(bytes / copy bandwidth, FLOPs / matmul rate)."""
    bytes_moved = cost["weight_bytes"] + cost["kv_read_bytes"]
    bytes_ms = 1e3 * bytes_moved / copy_bytes_per_s
    flops_ms = 1e3 * cost["flops"] / matmul_flops_per_s
    limit_ms = max(bytes_ms, flops_ms)
    return {
        "measured_ms": _sig(measured_ms),
        "bytes_moved": round(bytes_moved),
        "weight_bytes": round(cost["weight_bytes"]),
        "kv_read_bytes": round(cost["kv_read_bytes"]),
        "flops": cost["flops"],
        "bytes_ms": _sig(bytes_ms),
        "flops_ms": _sig(flops_ms),
        "roofline_ms": _sig(limit_ms),
        "bound": "bytes" if bytes_ms >= flops_ms else "flops",
        "fraction_of_roofline": _sig(limit_ms / measured_ms) if measured_ms > 0 else None,
    }


def _sig(x: float, digits: int = 4) -> float:
    """x to `digits` significant digits (small CPU figures keep their precision)."""
    return float(f"{x:.{digits}g}")


def busy_fraction(intervals: Iterable[tuple[float, float]], window: float) -> float:
    """Length of the union of (start, end) intervals over `window` (same unit), clamped to [0, 1]:
    overlapping kernels (several streams) count once."""
    if window <= 0:
        return 0.0
    busy, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        busy += e - max(s, end)
        end = e
    return max(0.0, min(1.0, busy / window))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_ms(fn, reps: int, device: torch.device) -> float:
    """Mean milliseconds of fn() over reps, after one warm-up call (CUDA events on CUDA)."""
    fn()
    _sync(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / reps
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return 1e3 * (time.perf_counter() - t0) / reps


def copy_bandwidth(device: torch.device, nbytes: int, reps: int) -> dict[str, float]:
    """Device-to-device copy rate, bytes read plus bytes written per second (a copy of N bytes moves 2N)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src), reps, device)
    return {"copy_bytes": nbytes, "copy_ms": round(ms, 4), "bytes_per_s": 2 * nbytes / (ms / 1e3)}


def matmul_rate(device: torch.device, dtype: torch.dtype, n: int, reps: int) -> dict[str, Any]:
    """FLOP/s of an n x n x n matmul in dtype."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    ms = _time_ms(lambda: a @ b, reps, device)
    return {"n": n, "dtype": str(dtype).replace("torch.", ""), "ms": round(ms, 4), "flops_per_s": 2 * n**3 / (ms / 1e3)}


def _tokenizer(vocab: int, tokenizer_cache: Optional[dict[int, str]], scratch: str) -> str:
    from vllm_lite.testing.checkpoints import build_tokenizer

    if tokenizer_cache is not None and vocab in tokenizer_cache:
        return tokenizer_cache[vocab]
    path = build_tokenizer(os.path.join(scratch, f".tokenizer-{vocab}"), vocab_size=vocab)
    if tokenizer_cache is not None:
        tokenizer_cache[vocab] = path
    return path


@torch.no_grad()
def build_random_checkpoint(
    name: str,
    path: str,
    device: torch.device,
    dtype: torch.dtype,
    seed: int = 0,
    tokenizer_cache: Optional[dict[int, str]] = None,
    shard_bytes: int = 2 << 30,
) -> dict[str, Any]:
    """Write shape `name` as a Hugging Face checkpoint at path: the tensors' names and shapes come from
    the transformers model built on the meta device, their random values are drawn on `device` (matrices
    std 0.02, norm gains 1 + 0.2 noise, biases 0.1 noise) and written as safetensors shards in parallel.
    Returns the build's timings and sizes."""
    import transformers
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    config = hf_config(name)
    config.dtype = dtype
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(config)
    shapes = {k: tuple(v.shape) for k, v in meta.state_dict().items()}
    del meta
    if getattr(config, "tie_word_embeddings", False):
        shapes.pop("lm_head.weight", None)
    os.makedirs(path, exist_ok=True)
    config.save_pretrained(path)
    tok = _tokenizer(config.vocab_size, tokenizer_cache, os.path.dirname(os.path.abspath(path)))
    for f in os.listdir(tok):
        shutil.copy(os.path.join(tok, f), os.path.join(path, f))

    gen = torch.Generator(device=device).manual_seed(seed)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size, total = 0, 0
    for key in sorted(shapes):
        shape = shapes[key]
        t = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
        if len(shape) == 1 and key.endswith("weight"):
            t.mul_(0.2).add_(1.0)
        elif len(shape) == 1:
            t.mul_(0.1)
        else:
            t.mul_(0.02)
        t = t.to(dtype).cpu()
        nbytes = t.numel() * t.element_size()
        if size and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = t
        size += nbytes
        total += nbytes
    t_gen = time.perf_counter() - t0
    if len(shards) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        index = {
            "metadata": {"total_size": total},
            "weight_map": {k: n for n, shard in zip(names, shards) for k in shard},
        }
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f)
    with ThreadPoolExecutor(max_workers=min(8, len(shards))) as pool:
        list(
            pool.map(
                lambda ns: save_file(ns[1], os.path.join(path, ns[0]), metadata={"format": "pt"}), zip(names, shards)
            )
        )
    return {
        "build_s": round(time.perf_counter() - t0, 2),
        "random_init_s": round(t_gen, 2),
        "checkpoint_bytes": total,
        "shards": len(shards),
        "init_device": str(device),
    }
