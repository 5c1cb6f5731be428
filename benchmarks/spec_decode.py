"""Speculative decoding (n-gram prompt lookup, and a draft model): does it pay, and where.

Two workloads on a trained checkpoint (default: the bundled model, a tiny Llama trained on Python's docs):
- repetitive: a documentation passage P, the model's own greedy continuation G of it, then P again: the
  continuation repeats spans of the prompt (as code editing or summarising with quotes does), since after the
  second P the model tends to say G again;
- random: prompts of random token ids, where lookup rarely finds anything.

For each workload: batch-1 milliseconds per output token (median over the prompts, greedy, fixed length) and
batch throughput (all prompts at once), without speculation, with n-gram proposals and with a draft model
(`--draft-model`, default: the target's first `--draft-layers` layers with its embeddings, final norm and LM
head: same tokenizer, a fraction of the compute), the three timed in turn prompt by prompt (interleaved, so load
on a shared host hits them alike; `--repeats` rounds of it, medians reported), plus Hugging Face `generate` at
default settings (the baseline) and HF's own prompt-lookup decoding (`prompt_lookup_num_tokens`, the
like-for-like), both batch 1. Our runs are in-process engines (`multiprocess=False`) so the acceptance counters
can be read; HF runs in this interpreter after ours at torch's thread count. Prints one JSON line (host included).

    python benchmarks/spec_decode.py --num-prompts 4 --max-tokens 64
    python benchmarks/spec_decode.py --no-hf --draft-layers 1 --num-speculative-tokens 3
    python benchmarks/spec_decode.py --no-hf --num-threads 1 --repeats 3   # a shared, loaded 2-CPU host
    python benchmarks/spec_decode.py --no-hf --no-draft --batch 2,8 --no-gain-rule --repeats 5
        # batch-throughput sweep (2, 4, 8); the default batch rule against none (drafts at every step)

Every configuration is its own engine with its own weights: with the tiny bundled model, 5 engines (`--ngram-k`
with several values) hold ~5x its weights, more than a 32 MiB L3, so each timed request may start cold, which would
cost the configurations with fewer steps per request most (suspected, not isolated: Zen 4 bf16 n-gram k=5 measured
1.79x with 5 engines and 2.05x with 2, in separate runs). Headline numbers: the fewest engines; the k sweep:
compare within one run.

On a loaded host, prefer `--num-threads 1`: at 2 threads each small op is an OpenMP region whose barrier waits
for a preempted thread (a decode step of the bundled model measured 5-10x slower, and erratic, at load ~4).

`--device cuda` runs the same workloads on the GPU (every engine, the workload's own greedy continuation and HF),
in bfloat16 unless `--dtype` says otherwise, each engine with max_num_seqs 16 (its CUDA graphs: decode batch
sizes 1..16 and, with speculation, verify steps q = 2..1+k) and a small share of GPU memory (they share one
process); the JSON names the device and GPU. `--quick` (2 prompts, no draft model, no HF) finishes in well under
two minutes there:

    python benchmarks/spec_decode.py --device cuda --quick          # issue 20's batch-1 n-gram speed-up on a GPU
    python benchmarks/spec_decode.py --device cuda --no-hf --repeats 3

`--host-times` (CPU) measures instead what a step costs the host outside the model, plain decode steps against
n-gram verify steps: each engine step's thread CPU time (time.thread_time: a step preempted by other work on a
shared host is not charged for it) less the model's forward and LM head, per workload and batch size, medians over
the decode steps (the prefill step left out), one torch thread. On CUDA those host parts are what a step adds to
its graph replay (the engine core steps synchronously: schedule, run, sample, wait for the tokens, update), so
this is where speculation's bookkeeping shows:

    python benchmarks/spec_decode.py --host-times --batch 1,2 --repeats 2

Batch verify steps replay a CUDA graph only when every request carries the same number of drafts; n-gram drafts
are padded to one length per step where the runner captures verify graphs (spec_decode/uniform_drafts.py).
`--uniform-drafts on|off` forces that either way (on: also on the CPU, where fillers cost compute), and
`--compare-unpadded` adds the row ngram_unpadded (padding off) to the same interleaved rounds. Each n-gram row
reports its verify steps, how many had drafts of different lengths (eager on CUDA), and the padded steps and
filler tokens (the acceptance counters above count fillers as drafts):

    python benchmarks/spec_decode.py --device cuda --quick --compare-unpadded
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch

PASSAGES = [
    "The for statement is used to iterate over the elements of a sequence (such as a string, tuple or list) "
    "or other iterable object.",
    "The while statement is used for repeated execution as long as an expression is true.",
    "The try statement specifies exception handlers and/or cleanup code for a group of statements.",
    "The with statement is used to wrap the execution of a block with methods defined by a context manager.",
    "A function definition defines a user-defined function object.",
    "The import statement finds a module, loads and initializes it if necessary.",
]


# Engine options per device: on CUDA each engine (several share the process and the GPU) takes a small share of its
# memory and at most 16 sequences, so capturing its CUDA graphs takes seconds.
CUDA_ENGINE_KWARGS: dict[str, Any] = {"gpu_memory_utilization": 0.12, "max_num_seqs": 16}


UNIFORM_DRAFTS = {"auto": None, "on": True, "off": False}  # --uniform-drafts -> SpecDecodeStep.uniform_drafts


def engine_kwargs(device: str) -> dict[str, Any]:
    return {"device": device, **(CUDA_ENGINE_KWARGS if device.startswith("cuda") else {})}


def workloads(
    model: str, tokenizer: Any, num_prompts: int, max_tokens: int, vocab: int, seed: int, device: str = "cpu"
) -> dict[str, list[list[int]]]:
    from vllm_lite import LLM, SamplingParams

    passages = [tokenizer.encode(PASSAGES[i % len(PASSAGES)], add_special_tokens=False) for i in range(num_prompts)]
    llm = LLM(
        model=model,
        dtype="float32",
        multiprocess=False,
        max_model_len=512,
        disable_log_stats=True,
        **engine_kwargs(device),
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in passages], greedy, use_tqdm=False)
    llm.shutdown()
    rep = [p + list(o.outputs[0].token_ids) + p for p, o in zip(passages, outs)]
    rng = np.random.default_rng(seed)
    rand = [rng.integers(10, vocab, size=len(p)).tolist() for p in rep]
    return {"repetitive": rep, "random": rand}


def run_ours_interleaved(
    model: str,
    prompts: list[list[int]],
    max_tokens: int,
    specs: dict[str, dict | None],
    num_threads: int | None,
    repeats: int = 1,
    dtype: str = "auto",
    batch_prompts: list[list[int]] | None = None,
    batch_sizes: tuple[int, ...] = (),
    device: str = "cpu",
    uniform_drafts: bool | None = None,
) -> dict[str, dict]:
    """One in-process engine per configuration, timed in turn on each prompt (batch 1) and then on batches of the
    first b of `batch_prompts` (default: the prompts) for each b in `batch_sizes` (and len(prompts)), `repeats`
    rounds, so load changes on a shared host hit every configuration alike. Batch-1 ms/token is the median over
    prompts and rounds, throughput the median over rounds."""
    batch_prompts = prompts if batch_prompts is None else batch_prompts
    batch_sizes = tuple(sorted(set(batch_sizes) | {len(prompts)}))
    if max(batch_sizes) > len(batch_prompts):
        raise ValueError(f"batch sizes {batch_sizes} need {max(batch_sizes)} prompts, got {len(batch_prompts)}")
    from vllm_lite import LLM, SamplingParams
    from vllm_lite.worker.spec_decode_step import SpecDecodeStep

    engines = {}
    for name, spec in specs.items():
        SpecDecodeStep.gain_rule = name != "ngram_nogain"  # "ngram_nogain": drafts at every step (the rule off)
        SpecDecodeStep.uniform_drafts = False if name == "ngram_unpadded" else uniform_drafts
        try:
            engines[name] = LLM(
                model=model,
                dtype=dtype,
                multiprocess=False,
                max_model_len=512,
                speculative_config=spec,
                num_threads=num_threads,
                disable_log_stats=True,
                **engine_kwargs(device),
            )
        finally:
            SpecDecodeStep.gain_rule = True
            SpecDecodeStep.uniform_drafts = None
    steps = {name: _count_verify_steps(llm) for name, llm in engines.items()}
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    warm = SamplingParams(max_tokens=4, ignore_eos=True)
    per_tok: dict[str, list[float]] = {name: [] for name in specs}
    tput: dict[str, dict[int, list[float]]] = {name: {b: [] for b in batch_sizes} for name in specs}
    outputs: dict[str, list[list[int]]] = {name: [] for name in specs}
    for llm in engines.values():
        llm.generate([{"prompt_token_ids": prompts[0]}], warm, use_tqdm=False)
    before = {name: _spec_totals(llm) for name, llm in engines.items()}
    padding_before = {name: _padding_totals(llm) for name, llm in engines.items()}
    for counts in steps.values():
        counts.update(verify=0, mixed=0)
    for rnd in range(repeats):
        for p in prompts:  # batch 1, configurations in turn
            for name, llm in engines.items():
                t0 = time.perf_counter()
                out = llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0]
                per_tok[name].append((time.perf_counter() - t0) / len(out.outputs[0].token_ids))
                if rnd == 0:
                    outputs[name].append(list(out.outputs[0].token_ids))
        for b in batch_sizes:  # the first b prompts at once, configurations in turn
            for name, llm in engines.items():
                t0 = time.perf_counter()
                batch = llm.generate([{"prompt_token_ids": p} for p in batch_prompts[:b]], params, use_tqdm=False)
                tput[name][b].append(sum(len(o.outputs[0].token_ids) for o in batch) / (time.perf_counter() - t0))
    results: dict[str, dict] = {}
    for name, llm in engines.items():
        result: dict[str, Any] = {
            "ms_per_token_batch1": 1e3 * float(np.median(per_tok[name])),
            "throughput_tok_s": float(np.median(tput[name][len(prompts)])),
            "throughput_tok_s_by_batch": {b: float(np.median(v)) for b, v in tput[name].items()},
        }
        if specs[name] is not None:
            drafts, draft_tokens, accepted = np.subtract(_spec_totals(llm), before[name])
            result.update(
                draft_acceptance_rate=round(accepted / max(draft_tokens, 1), 3),
                mean_acceptance_length=round(1 + accepted / max(drafts, 1), 3),
                mean_draft_tokens=round(draft_tokens / max(drafts, 1), 3),
                verify_steps=steps[name]["verify"],
                verify_steps_mixed_lengths=steps[name]["mixed"],
            )
            padded_steps, fillers = np.subtract(_padding_totals(llm), padding_before[name])
            result.update(padded_steps=int(padded_steps), filler_tokens=int(fillers))
        result["outputs"] = outputs[name]
        results[name] = result
    for llm in engines.values():
        llm.shutdown()
    return results


def _count_verify_steps(llm: Any) -> dict[str, int]:
    """Counts, from now on, this in-process engine's verify steps and those whose requests run different numbers
    of tokens (drafts of different lengths: no CUDA graph fits, cuda_graphs.py; eager on CUDA)."""
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    schedule, counts = sched.schedule, {"verify": 0, "mixed": 0}

    def counting() -> Any:
        so = schedule()
        if so.scheduled_spec_decode_tokens:
            counts["verify"] += 1
            counts["mixed"] += len(set(so.num_scheduled_tokens.values())) > 1
        return so

    sched.schedule = counting
    return counts


def _padding_totals(llm: Any) -> tuple[int, int]:
    """(padded steps, filler tokens) of this in-process engine's uniform drafts (0s when padding is off)."""
    spec = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner.spec_decode
    uniform = None if spec is None else spec.uniform
    return (0, 0) if uniform is None else (uniform.num_padded_steps, uniform.num_filler_tokens)


def _spec_totals(llm: Any) -> tuple[int, int, int]:
    """(drafts, draft tokens, accepted tokens) verified so far by this in-process engine (0s without speculation)."""
    total = llm.llm_engine.engine_core.engine_core.scheduler.spec.total
    if total is None:
        return 0, 0, 0
    return total.num_drafts, total.num_draft_tokens, total.num_accepted_tokens


def run_hf(
    model: str,
    prompts: list[list[int]],
    max_tokens: int,
    lookup: int | None,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> dict:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, torch_dtype=dtype).eval().to(device)
    kw: dict[str, Any] = dict(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
    if lookup is not None:
        kw["prompt_lookup_num_tokens"] = lookup
    per_tok, outputs = [], []
    with torch.inference_mode():
        hf.generate(torch.tensor([prompts[0]], device=device), max_new_tokens=4, do_sample=False)  # warm-up
        for p in prompts:
            t0 = time.perf_counter()
            out = hf.generate(torch.tensor([p], device=device), **kw)[0, len(p) :].cpu()
            per_tok.append((time.perf_counter() - t0) / len(out))
            outputs.append(out.tolist())
    return {"ms_per_token_batch1": 1e3 * float(np.median(per_tok)), "outputs": outputs}


def phase_times(
    model: str,
    sets: dict[str, list[list[int]]],
    spec: dict,
    max_tokens: int,
    batch_sizes: tuple[int, ...],
    repeats: int,
    dtype: str,
    *,
    host_cpu: bool,
    device: str = "cpu",
    uniform_drafts: bool | None = None,
    temperature: float = 0.0,
) -> dict[str, Any]:
    """Per decode step, microseconds of the whole step ("step") and its phases, split by engine (plain, ngram) and
    step kind (plain decode, verify), medians over `repeats` rounds after a warm-up round (the prefill step left
    out). One harness, two clocks:

    ``host_cpu=True`` (``--host-times``, CPU): the engine thread's CPU time (time.thread_time: a step preempted by
    other work on a shared host is not charged for it), one torch thread; phases forward and lm_head (the model),
    sample, schedule, propose, update (the scheduler's `update_from_output`), frontend_outputs, and "host" = step -
    forward - lm_head; verify steps also "verify" (`SpecDecodeStep.verify` or `verify_greedy`, inside sample: on
    the CPU it includes the argmax over the verified rows) and "sample_rest" (sample - lm_head - verify: the
    runner's layout and bookkeeping around verification); plus, per workload and batch, the n-gram verify steps
    whose drafts had different lengths (no CUDA graph fits them, eager there) against all verify steps.

    ``host_cpu=False`` (``--step-times``, CPU or CUDA): wall-clock time (perf_counter); phases schedule,
    update_states (the runner's batch diff), forward (`_run_model`: on CUDA the graph replay's launch, or the eager
    forward's launches), sample (`_sample`: the LM head, sampling or verification, the one sync with the device,
    recording; for verify steps also "verify" (`SpecDecodeStep.verify` or `verify_greedy`) and "lm_head"), propose,
    update and frontend (`process_outputs`). On CUDA also, from CUDA events (recorded, never waited on inside a step: read after
    each request finishes), "forward_gpu": the GPU-side span of `_run_model`, and "gpu_step": the span of the whole
    step. A verify step's host parts against a plain step's, next to their GPU spans, tell host work from GPU work
    per step kind. Both engines schedule synchronously (speculation does not run with async scheduling; the plain
    engine is held to the same, so each of its steps is one step's work, not an overlapped pipeline)."""
    from collections import defaultdict

    from vllm_lite import LLM, SamplingParams
    from vllm_lite.worker.spec_decode_step import SpecDecodeStep

    if host_cpu and device != "cpu":
        raise ValueError(f"host_cpu=True times the CPU engine (thread CPU time); got device={device!r}")
    cuda_events = not host_cpu and device.startswith("cuda")
    clock = time.thread_time if host_cpu else time.perf_counter
    if host_cpu:  # the CPU engine pinned: the engine's default is CUDA wherever a GPU is visible
        engine_kw: dict[str, Any] = {"num_threads": 1, "device": "cpu"}
    else:  # plain steps synchronous too, as verify steps are: one step's parts each
        engine_kw = {**engine_kwargs(device), "async_scheduling": False}
    engines: dict[str, Any] = {}
    for name, sc in (("plain", None), ("ngram", spec)):
        SpecDecodeStep.uniform_drafts = uniform_drafts
        try:
            llm = LLM(
                model=model,
                dtype=dtype,
                multiprocess=False,
                max_model_len=512,
                speculative_config=sc,
                disable_log_stats=True,
                **engine_kw,
            )
        finally:
            SpecDecodeStep.uniform_drafts = None
        core = llm.llm_engine.engine_core.engine_core
        runner = core.executor.worker.model_runner
        acc: dict[str, float] = defaultdict(float)
        # ev: this step's CUDA events (step start, forward start, forward end, step end)
        state: dict[str, Any] = {"verify": False, "nonuniform": 0, "verify_steps": 0, "ev": None}

        def timed(obj: Any, attr: str, key: str, acc: dict = acc, state: dict = state) -> None:
            fn = getattr(obj, attr)
            forward = key == "forward" and cuda_events

            def wrapper(*a: Any, **kw: Any) -> Any:
                if forward and state["ev"] is not None:
                    state["ev"][1].record()
                t0 = clock()
                try:
                    return fn(*a, **kw)
                finally:
                    acc[key] += clock() - t0
                    if forward and state["ev"] is not None:
                        state["ev"][2].record()

            setattr(obj, attr, wrapper)

        if not host_cpu:
            timed(runner, "_update_states", "update_states")
        timed(runner, "_run_model", "forward")
        timed(runner.model, "compute_logits", "lm_head")
        timed(runner, "_sample", "sample")
        timed(core.scheduler, "update_from_output", "update")
        timed(llm.llm_engine.output_processor, "process_outputs", "frontend_outputs" if host_cpu else "frontend")
        if runner.spec_decode is not None:
            timed(runner.spec_decode, "propose", "propose")
        schedule = core.scheduler.schedule

        def scheduled(schedule: Any = schedule, state: dict = state, acc: dict = acc) -> Any:
            t0 = clock()
            so = schedule()
            acc["schedule"] += clock() - t0
            state["verify"] = bool(so.scheduled_spec_decode_tokens)
            if state["verify"]:  # drafts of different lengths: no CUDA graph fits (cuda_graphs.py), eager there
                state["verify_steps"] += 1
                state["nonuniform"] += len(set(so.num_scheduled_tokens.values())) > 1
            return so

        core.scheduler.schedule = scheduled
        engines[name] = (llm, acc, state)
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True)
    out: dict[str, Any] = {}
    # The runner calls both verify forms through the class (verify_greedy: a few all-greedy rows, as lists): timed
    # into the stepping engine's acc as "verify".
    real_verify, real_greedy = SpecDecodeStep.verify, SpecDecodeStep.verify_greedy
    # The class's own entries (staticmethod objects) go back afterwards, not the functions read through it.
    saved = {name: SpecDecodeStep.__dict__[name] for name in ("verify", "verify_greedy")}
    current: dict[str, Any] = {"acc": None}

    def timed_verify(fn: Any) -> Any:
        def run(*a: Any, **kw: Any) -> Any:
            t0 = clock()
            try:
                return fn(*a, **kw)
            finally:
                current["acc"]["verify"] += clock() - t0

        return staticmethod(run)

    SpecDecodeStep.verify = timed_verify(real_verify)  # type: ignore[method-assign]
    SpecDecodeStep.verify_greedy = timed_verify(real_greedy)  # type: ignore[method-assign]
    try:
        for wl, prompts in sets.items():
            for b in batch_sizes:
                per: dict[tuple[str, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
                nonuniform = {name: [0, 0] for name in engines}
                for rnd in range(repeats + 1):  # round 0 warms up
                    for name, (llm, acc, state) in engines.items():
                        current["acc"] = acc
                        eng = llm.llm_engine
                        for i in range(0, len(prompts) - b + 1, b):
                            for j, p in enumerate(prompts[i : i + b]):
                                eng.add_request(f"{wl}-{b}-{rnd}-{i}-{j}", {"prompt_token_ids": p}, params)
                            first = True
                            state["verify_steps"] = state["nonuniform"] = 0
                            pending: list[tuple[str, Any]] = []
                            while eng.has_unfinished_requests():
                                acc.clear()
                                if cuda_events:
                                    state["ev"] = tuple(torch.cuda.Event(enable_timing=True) for _ in range(4))
                                    state["ev"][0].record()
                                t0 = clock()
                                eng.step()
                                dt = clock() - t0
                                if cuda_events:
                                    state["ev"][3].record()
                                if first or not rnd:
                                    first = False
                                    continue
                                kind = "verify" if state["verify"] else "plain"
                                d = per[(name, kind)]
                                d["step"].append(dt)
                                if host_cpu:
                                    d["host"].append(dt - acc["forward"] - acc["lm_head"])
                                    if "verify" in acc:
                                        d["sample_rest"].append(acc["sample"] - acc["lm_head"] - acc["verify"])
                                for key, v in acc.items():
                                    d[key].append(v)
                                if cuda_events:
                                    pending.append((kind, state["ev"]))
                            if rnd:
                                nonuniform[name][0] += state["nonuniform"]
                                nonuniform[name][1] += state["verify_steps"]
                            if cuda_events:  # read the GPU spans once the request's steps are done
                                torch.cuda.synchronize()
                                for kind, ev in pending:
                                    d = per[(name, kind)]
                                    d["gpu_step"].append(ev[0].elapsed_time(ev[3]) / 1e3)
                                    if ev[1].query() and ev[2].query():
                                        try:
                                            d["forward_gpu"].append(ev[1].elapsed_time(ev[2]) / 1e3)
                                        except RuntimeError:  # not recorded (a step without a forward)
                                            pass
                            state["ev"] = None
                for (name, kind), d in sorted(per.items()):
                    row = {"steps": len(d["step"])}
                    row.update({k: round(1e6 * float(np.median(v)), 1) for k, v in d.items()})
                    out[f"{wl}/batch{b}/{name}/{kind}_step_us"] = row
                if host_cpu:
                    out[f"{wl}/batch{b}/ngram/verify_steps_with_mixed_draft_lengths"] = nonuniform["ngram"]
    finally:
        SpecDecodeStep.verify = saved["verify"]  # type: ignore[method-assign]
        SpecDecodeStep.verify_greedy = saved["verify_greedy"]  # type: ignore[method-assign]
        for llm, _, _ in engines.values():
            llm.shutdown()
    return out


def _param_count(model_dir: str) -> int:
    """Parameters in a checkpoint's safetensors files (read from their headers only)."""
    from safetensors import safe_open

    total = 0
    for name in os.listdir(model_dir):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(model_dir, name), framework="pt") as f:
                for key in f.keys():
                    total += int(np.prod(f.get_slice(key).get_shape()))
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the bundled model)")
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    # vLLM's documented n-gram example: 5 tokens, prompt_lookup_max 4. On CPU a verified step costs about the same
    # for 2..9 query rows (a gemm instead of a gemv), so tokens per step decide: k=4 gave 1.77x, k=8 2.13x batch-1
    # on the repetitive workload (interleaved, idle 2-CPU host).
    ap.add_argument("--num-speculative-tokens", type=int, default=5)
    ap.add_argument("--prompt-lookup-min", type=int, default=2)
    ap.add_argument("--prompt-lookup-max", type=int, default=4)
    ap.add_argument("--draft-model", default=None, help="draft checkpoint (same vocabulary as the target)")
    ap.add_argument("--draft-layers", type=int, default=1, help="layers of the default draft (the target's first)")
    ap.add_argument(
        "--synthetic-pair",
        default=None,
        metavar="ARCH:SIZE",
        help="target and draft from vllm_lite.testing.draft_checkpoints.get_target_and_draft (e.g. qwen2:100m): "
        "a random checkpoint with its later layers damped and its one-layer draft, which agree by construction "
        "(measures what the draft passes cost at that size; the n-gram rows then run on it too)",
    )
    ap.add_argument("--no-hf", action="store_true", help="skip the Hugging Face baselines")
    ap.add_argument("--no-draft", action="store_true", help="skip the draft-model configuration")
    ap.add_argument(
        "--ngram-k",
        default="",
        help="comma-separated further n-gram num_speculative_tokens, each its own engine timed in the same "
        "interleaved rounds (rows ngram_k<k>), e.g. 2,3,4",
    )
    ap.add_argument(
        "--dtype",
        default="auto",
        help="engine dtype (auto: the dtype policy, bfloat16 on a CPU with AVX-512 BF16); HF runs in the same",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--no-gain-rule",
        action="store_true",
        help="also n-gram without the batch rule (drafts at every step; row ngram_nogain)",
    )
    ap.add_argument(
        "--batch",
        default="",
        help="comma-separated batch sizes for the throughput sweep (the first b prompts of each workload at once; "
        "prompts are generated for the largest); the --num-prompts batch is always measured",
    )
    ap.add_argument(
        "--disable-by-batch-size", type=int, default=None, help="also n-gram with this disable_by_batch_size"
    )
    ap.add_argument("--num-threads", type=int, default=None, help="torch threads, ours and HF's (default: policy)")
    ap.add_argument("--repeats", type=int, default=1, help="interleaved rounds over the prompts and the batch")
    ap.add_argument(
        "--device",
        default="cpu",
        help="cpu (default) or cuda / cuda:N: every engine and HF there, bfloat16 unless --dtype is given",
    )
    ap.add_argument("--quick", action="store_true", help="2 prompts, no draft model, no HF (a GPU check)")
    ap.add_argument(
        "--uniform-drafts",
        choices=sorted(UNIFORM_DRAFTS),
        default="auto",
        help="pad n-gram drafts to one length per batch step (auto: where the runner captures verify CUDA graphs)",
    )
    ap.add_argument(
        "--compare-unpadded", action="store_true", help="also n-gram with the padding off (row ngram_unpadded)"
    )
    ap.add_argument(
        "--host-times",
        action="store_true",
        help="CPU: host time per plain decode step vs n-gram verify step, model forward and LM head left out "
        "(batch sizes from --batch, default 1)",
    )
    ap.add_argument(
        "--step-times",
        action="store_true",
        help="CPU or CUDA: wall-clock us per plain decode step vs n-gram verify step and their phases (host parts, "
        "and on CUDA the GPU spans of the forward and the step); batch sizes from --batch, default 1",
    )
    ap.add_argument(
        "--temperature", type=float, default=0.0, help="--step-times: the requests' temperature (0: greedy)"
    )
    args = ap.parse_args()
    on_cuda = args.device.startswith("cuda")
    if on_cuda and args.dtype == "auto":
        args.dtype = "bfloat16"
    if args.quick:
        args.num_prompts, args.no_draft, args.no_hf = 2, True, True
    if args.host_times or args.step_times:
        args.no_draft, args.no_hf = True, True

    from transformers import AutoConfig, AutoTokenizer

    from vllm_lite.default_model import resolve_model
    from vllm_lite.dtype_policy import resolve_dtype
    from vllm_lite.platform import describe_host

    model = resolve_model(args.model)
    if args.synthetic_pair is not None:
        from vllm_lite.testing.draft_checkpoints import get_target_and_draft

        arch, size = args.synthetic_pair.split(":")
        model, args.draft_model = get_target_and_draft(arch, size=size)
    if args.num_threads is not None:
        torch.set_num_threads(args.num_threads)
    tokenizer = AutoTokenizer.from_pretrained(model)
    cfg = AutoConfig.from_pretrained(model)
    config_dtype = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None)
    dtype = resolve_dtype(args.dtype, None if config_dtype is None else str(config_dtype), torch.device(args.device))

    def ngram(k: int) -> dict:
        return {
            "method": "ngram",
            "num_speculative_tokens": k,
            "prompt_lookup_min": args.prompt_lookup_min,
            "prompt_lookup_max": args.prompt_lookup_max,
        }

    spec = ngram(args.num_speculative_tokens)
    specs: dict[str, dict | None] = {"plain": None, "ngram": spec}
    for k in (int(x) for x in args.ngram_k.split(",") if x.strip()):
        specs[f"ngram_k{k}"] = ngram(k)
    if args.no_gain_rule:
        specs["ngram_nogain"] = spec
    if args.compare_unpadded:
        specs["ngram_unpadded"] = spec
    batch_sizes = tuple(int(x) for x in args.batch.split(",") if x.strip())
    if args.disable_by_batch_size is not None:
        specs["ngram_dbbs"] = {**spec, "disable_by_batch_size": args.disable_by_batch_size}
    draft_spec = None
    if not args.no_draft:
        if args.draft_model is None:
            from vllm_lite.testing.draft_checkpoints import get_layer_skip_draft

            args.draft_model = get_layer_skip_draft(model, args.draft_layers)
        draft_spec = {"model": args.draft_model, "num_speculative_tokens": args.num_speculative_tokens}
        specs["draft"] = draft_spec
    result: dict[str, Any] = {
        "model": model,
        "dtype": str(dtype).replace("torch.", ""),
        "max_tokens": args.max_tokens,
        "speculative_config": spec,
        "draft_speculative_config": draft_spec,
        "num_threads": args.num_threads or torch.get_num_threads(),
        "host": describe_host(),
        "device": args.device,
        "gpu": torch.cuda.get_device_name(torch.device(args.device)) if on_cuda else None,
        "repeats": args.repeats,
        "uniform_drafts": args.uniform_drafts,
        "load_avg_1m_start": os.getloadavg()[0],
    }
    if draft_spec is not None:
        result["draft_params_ratio"] = _param_count(args.draft_model) / _param_count(model)
    num_sets = max((args.num_prompts, *batch_sizes))
    sets = workloads(model, tokenizer, num_sets, args.max_tokens, len(tokenizer), args.seed, args.device)
    if args.host_times or args.step_times:
        if not args.step_times and on_cuda:
            raise SystemExit("--host-times measures the CPU engine (thread CPU time); use a profiler on CUDA")
        times = phase_times(
            model,
            sets,
            spec,
            args.max_tokens,
            batch_sizes or (1,),
            max(1, args.repeats),
            args.dtype,
            host_cpu=not args.step_times,
            device=args.device,
            uniform_drafts=UNIFORM_DRAFTS[args.uniform_drafts],
            temperature=args.temperature if args.step_times else 0.0,
        )
        if args.step_times:
            result.update(times, temperature=args.temperature, load_avg_1m_end=os.getloadavg()[0])
        else:
            result.update(times, num_threads=1, load_avg_1m_end=os.getloadavg()[0])
        print(json.dumps(result))
        return
    for name, all_prompts in sets.items():
        prompts = all_prompts[: args.num_prompts]
        runs = run_ours_interleaved(
            model,
            prompts,
            args.max_tokens,
            specs,
            args.num_threads,
            args.repeats,
            dtype=args.dtype,
            batch_prompts=all_prompts,
            batch_sizes=batch_sizes,
            device=args.device,
            uniform_drafts=UNIFORM_DRAFTS[args.uniform_drafts],
        )
        plain = runs["plain"]
        row: dict[str, Any] = {
            "num_prompts": len(prompts),
            "mean_prompt_tokens": float(np.mean([len(p) for p in prompts])),
            "no_spec": {k: v for k, v in plain.items() if k != "outputs"},
        }
        for cfg, run in runs.items():
            if cfg == "plain":
                continue
            key = {"ngram": "ngram_spec", "draft": "draft_spec"}.get(cfg, cfg)
            prefix = {"ngram": "", "draft": "draft_"}.get(cfg, cfg + "_")
            row[key] = {k: v for k, v in run.items() if k != "outputs"}
            row[prefix + "speedup_batch1"] = plain["ms_per_token_batch1"] / run["ms_per_token_batch1"]
            row[prefix + "speedup_throughput"] = run["throughput_tok_s"] / plain["throughput_tok_s"]
            row[prefix + "speedup_throughput_by_batch"] = {
                b: tps / plain["throughput_tok_s_by_batch"][b] for b, tps in run["throughput_tok_s_by_batch"].items()
            }
        # Exact in float32; in bfloat16 a verified step's rows may round differently from a decode step's.
        row["greedy_outputs_equal"] = all(run["outputs"] == plain["outputs"] for run in runs.values())
        row["greedy_prompts_differing"] = {
            cfg: sum(a != b for a, b in zip(run["outputs"], plain["outputs"]))
            for cfg, run in runs.items()
            if cfg != "plain"
        }
        if not args.no_hf:
            hf = run_hf(model, prompts, args.max_tokens, None, dtype, args.device)
            hf_lookup = run_hf(model, prompts, args.max_tokens, args.num_speculative_tokens, dtype, args.device)
            row["hf_generate"] = {"ms_per_token_batch1": hf["ms_per_token_batch1"]}
            row["hf_prompt_lookup"] = {"ms_per_token_batch1": hf_lookup["ms_per_token_batch1"]}
        result[name] = row
    result["load_avg_1m_end"] = os.getloadavg()[0]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
