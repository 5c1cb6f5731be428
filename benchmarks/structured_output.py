"""Structured outputs: which grammar backend, and what a JSON schema costs the throughput workload.

(a) Backends on our tokenizers (the tiny test tokenizer and the bundled default model's), through the engine's
    own backend classes: for xgrammar and llguidance, the one-off tokenizer set-up, each schema's compile time
    (cold: to a ready matcher, no cache), the first mask after it, and the steady per-token mask time over a
    seeded random walk through each schema of vllm_lite/testing/json_schemas.py (uniform among allowed tokens),
    and the batched fill of 64 rows (`fill_bitmask_batch`: the engine's per-step call), each row a step further on.
(b) The throughput workload of throughput.py (its prompt maker, same flags: random prompts of 32-256 tokens,
    --output-len new tokens, greedy; unconstrained with ignore_eos as there) on the bundled default model, one
    engine, one run: unconstrained and with every request under a JSON schema, in ABBA order --repeats times
    after a warm-up of both; the ratio of median output tok/s (target >= 0.85).
    The schema is long enough (bounded strings and arrays) that most requests still run to --output-len, so
    both sides do about the same work; the output token counts are in the JSON. --mixed-schemas adds a run
    where requests cycle through the library's schemas (each compiled once, in the timed region).
Prints one JSON line, with the host and its load (the machine is shared).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import msgspec
import torch

# benchmarks/ is this script's directory, so its sibling is importable as a module.
from throughput import make_prompts

from vllm_lite.testing.json_schemas import JSON_SCHEMAS, ConstraintCase

BACKENDS = ("xgrammar", "guidance")

# Every request of workload (b) is under this schema: bounded, but long enough to fill --output-len tokens.
# Strings are bounded by patterns, not maxLength: xgrammar does not enforce maxLength correctly (it lets control
# characters in), so the engine refuses maxLength on backend=xgrammar and sends it to guidance under auto.
THROUGHPUT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "pattern": "^[A-Za-z0-9 ,.]{0,40}$"},
        "score": {"type": "integer", "minimum": 0, "maximum": 100},
        "tags": {
            "type": "array",
            "items": {"type": "string", "pattern": "^[a-z0-9]{0,12}$"},
            "minItems": 1,
            "maxItems": 8,
        },
        "summary": {"type": "string", "pattern": "^[A-Za-z0-9 ,.;:()-]{0,400}$"},
    },
    "required": ["title", "score", "tags", "summary"],
    "additionalProperties": False,
}


def _allowed(bitmask: torch.Tensor, vocab_size: int) -> list[int]:
    """Token ids whose bit is set in row 0 of an int32 bitmask."""
    bits = bitmask[0].to(torch.int64) & 0xFFFFFFFF
    mask = ((bits.unsqueeze(1) >> torch.arange(32, dtype=torch.int64)) & 1).flatten()[:vocab_size]
    return torch.nonzero(mask).flatten().tolist()


def _backend(name: str, tokenizer: Any, vocab_size: int) -> tuple[Any, float]:
    """The engine's own backend object for `name` on this tokenizer, and its set-up time (ms)."""
    import llguidance.hf  # noqa: F401  (imports outside the timed set-up)
    import llguidance.torch  # noqa: F401
    import xgrammar  # noqa: F401

    from vllm_lite.structured_output.backend_guidance import GuidanceBackend
    from vllm_lite.structured_output.backend_xgrammar import XgrammarBackend

    cls = XgrammarBackend if name == "xgrammar" else GuidanceBackend
    t0 = time.perf_counter()
    backend = cls(tokenizer, vocab_size, [tokenizer.eos_token_id])
    return backend, (time.perf_counter() - t0) * 1e3


def _batch_fill_us(backend: Any, width: int, vocab_size: int, eos: int, seed: int, rows: int) -> float:
    """Median time of one batched fill (the engine's per-step call) over `rows` matchers cycling the schemas;
    between fills every row advances one random allowed token (a fresh state each step, as in decoding)."""
    from vllm_lite.sampling_params import StructuredOutputsParams
    from vllm_lite.structured_output.spec import spec_from_params

    cases = [c for c in JSON_SCHEMAS if backend.name in c.backends]
    compiled = [
        backend.compile(spec_from_params(StructuredOutputsParams(json=c.spec, disable_any_whitespace=True)))
        for c in cases
    ]
    bitmask = torch.zeros((rows, width), dtype=torch.int32)
    matchers = [backend.new_matcher(compiled[i % len(compiled)]) for i in range(rows)]
    pairs = list(zip(matchers, range(rows)))
    rng, times = random.Random(seed), []
    for _ in range(32):
        t0 = time.perf_counter()
        type(matchers[0]).fill_bitmask_batch(pairs, bitmask)
        times.append((time.perf_counter() - t0) * 1e6)
        for m, row in pairs:
            allowed = [t for t in _allowed(bitmask[row : row + 1], vocab_size) if t != eos]
            if not allowed or not m.accept_tokens([rng.choice(allowed)]) or m.is_terminated():
                m.reset()  # finished: start the schema again
    return statistics.median(times)


def backend_costs(
    tokenizer_path: str, vocab_size: int, walk_tokens: int, seed: int, batch_rows: int = 64
) -> dict[str, Any]:
    """Per backend on this tokenizer, through the engine's backend classes: set-up; per schema the cold compile
    to a ready matcher (no cache) and its first mask; then the steady per-token mask time along a seeded
    uniform random walk through each schema (each backend its own walk: their compact JSON differs, ", " vs ",").
    """
    from transformers import AutoTokenizer

    from vllm_lite.sampling_params import StructuredOutputsParams
    from vllm_lite.structured_output.manager import bitmask_width
    from vllm_lite.structured_output.spec import spec_from_params

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    eos = tokenizer.eos_token_id
    result: dict[str, Any] = {"vocab_size": vocab_size}
    for name in BACKENDS:
        backend, setup_ms = _backend(name, tokenizer, vocab_size)
        bitmask = torch.zeros((1, bitmask_width(vocab_size)), dtype=torch.int32)
        compile_ms: dict[str, float] = {}
        first_mask_us: list[float] = []
        mask_us: list[float] = []
        for case in (c for c in JSON_SCHEMAS if name in c.backends):
            spec = spec_from_params(StructuredOutputsParams(json=case.spec, disable_any_whitespace=True))
            t0 = time.perf_counter()
            matcher = backend.new_matcher(backend.compile(spec))
            compile_ms[case.name] = round((time.perf_counter() - t0) * 1e3, 2)
            rng = random.Random(seed)
            for step in range(walk_tokens):
                t0 = time.perf_counter()
                matcher.fill_bitmask(bitmask, 0)
                (first_mask_us if step == 0 else mask_us).append((time.perf_counter() - t0) * 1e6)
                token = rng.choice(_allowed(bitmask, vocab_size))
                if token == eos or not matcher.accept_tokens([token]) or matcher.is_terminated():
                    break
        ms = sorted(compile_ms.values())
        batch_us = _batch_fill_us(backend, bitmask_width(vocab_size), vocab_size, eos, seed, batch_rows)
        result[name] = {
            "tokenizer_setup_ms": round(setup_ms, 1),
            "compile_ms_median": round(statistics.median(ms), 2),
            "compile_ms_max": round(ms[-1], 2),
            "first_mask_us_median": round(statistics.median(first_mask_us), 1),
            "mask_us_mean": round(statistics.fmean(mask_us), 1),
            "mask_us_p99": round(_quantile(mask_us, 0.99), 1),
            "masked_tokens": len(mask_us),
            f"batch_fill_us_{batch_rows}_rows": round(batch_us, 1),
            "compile_ms": compile_ms,
        }
    return result


def _quantile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def throughput_ratio(args: argparse.Namespace, backend: str) -> dict[str, Any]:
    """Workload (b) on one engine: unconstrained vs every request under THROUGHPUT_SCHEMA, interleaved."""
    from vllm_lite import LLM, SamplingParams
    from vllm_lite.sampling_params import StructuredOutputsParams

    with open(os.path.join(args.model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    prompts = [{"prompt_token_ids": p} for p in make_prompts(args.num_prompts, 32, 256, vocab, seed=0)]
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        multiprocess=not args.inprocess,
        max_model_len=512,
        max_num_seqs=64,
        num_threads=args.num_threads,
        structured_outputs_config={"backend": backend},
    )
    free = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)  # as throughput.py
    constrained = SamplingParams(
        temperature=0.0, max_tokens=args.output_len, structured_outputs=StructuredOutputsParams(json=THROUGHPUT_SCHEMA)
    )
    for params in (free, constrained):  # warm-up: the batch's shapes, the backend's set-up, the schema's compile
        llm.generate(prompts, msgspec.structs.replace(params, max_tokens=4), use_tqdm=False)

    def run(params: Any) -> dict[str, Any]:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        stopped = sum(o.outputs[0].finish_reason == "stop" for o in outs)
        return {"tokens_per_s": n_out / dt, "output_tokens": n_out, "elapsed_s": dt, "finished_stop": stopped}

    runs: dict[str, list[dict[str, Any]]] = {"unconstrained": [], "json_schema": []}
    for r in range(args.repeats):  # ABBA order, so drift in the machine's load hits both sides alike
        order = [("unconstrained", free), ("json_schema", constrained)]
        for name, params in order if r % 2 == 0 else order[::-1]:
            runs[name].append(run(params))
    mixed = None
    if args.mixed_schemas:
        params = [_schema_params(JSON_SCHEMAS[i % len(JSON_SCHEMAS)], args.output_len) for i in range(len(prompts))]
        mixed = run(params)
    llm.shutdown()
    med = {k: statistics.median(r["tokens_per_s"] for r in v) for k, v in runs.items()}
    result: dict[str, Any] = {
        "backend": backend,
        "unconstrained_tokens_per_s": round(med["unconstrained"], 1),
        "json_schema_tokens_per_s": round(med["json_schema"], 1),
        "ratio": round(med["json_schema"] / med["unconstrained"], 3),
        "runs": {
            k: [{f: round(x, 2) if isinstance(x, float) else x for f, x in r.items()} for r in v]
            for k, v in runs.items()
        },
    }
    if mixed is not None:
        result["mixed_schemas"] = {k: round(x, 2) if isinstance(x, float) else x for k, x in mixed.items()}
    return result


def _schema_params(case: ConstraintCase, max_tokens: int) -> Any:
    from vllm_lite import SamplingParams
    from vllm_lite.sampling_params import StructuredOutputsParams

    return SamplingParams(
        temperature=0.0, max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(json=case.spec)
    )


def main() -> None:
    from vllm_lite.default_model import default_model_path

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint dir for (b) (default: the bundled default model)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--inprocess", action="store_true", help="run the engine core in this process")
    ap.add_argument("--num-threads", type=int, default=None, help="engine-core torch threads (default: its policy)")
    ap.add_argument("--backends", default="xgrammar,guidance", help="backends for (b), comma-separated")
    ap.add_argument("--repeats", type=int, default=2, help="interleaved unconstrained/constrained pairs in (b)")
    ap.add_argument("--mixed-schemas", action="store_true", help="(b) also with requests cycling the schema library")
    ap.add_argument("--walk-tokens", type=int, default=64, help="(a) random-walk length per schema")
    ap.add_argument("--skip-backend-costs", action="store_true")
    ap.add_argument("--skip-throughput", action="store_true")
    args = ap.parse_args()
    from vllm_lite.testing.baselines import host_description
    from vllm_lite.testing.checkpoints import get_checkpoint

    args.model = args.model or default_model_path()
    result: dict[str, Any] = {"benchmark": "structured_output", "host": host_description()}
    result["load_avg_at_start"] = os.getloadavg()
    if not args.skip_backend_costs:
        result["backend_costs"] = {}
        for name, path in (("tiny_test", get_checkpoint("llama")), ("default_model", default_model_path())):
            with open(os.path.join(path, "config.json")) as f:
                vocab = json.load(f)["vocab_size"]
            result["backend_costs"][name] = backend_costs(path, vocab, args.walk_tokens, seed=0)
    if not args.skip_throughput:
        result["throughput"] = {
            "model": os.path.basename(args.model.rstrip("/")),
            "dtype": args.dtype,
            "num_prompts": args.num_prompts,
            "output_len": args.output_len,
            "schema": THROUGHPUT_SCHEMA,
            "by_backend": [throughput_ratio(args, b) for b in args.backends.split(",") if b.strip()],
        }
    result["load_avg_at_end"] = os.getloadavg()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
