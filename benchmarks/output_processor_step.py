"""Frontend host cost per decode step: OutputProcessor.process_outputs over B requests, one token each.

    python benchmarks/output_processor_step.py [--batch 256] [--steps 200] [--kind delta|cumulative|final]
    [--tokenizer PATH] [--no-detokenize] [--queues] [--profile]

A byte-level BPE tokenizer (vllm_lite.testing.checkpoints.build_tokenizer, 2000 ids) unless --tokenizer; random
token ids (seeded). --queues: each request has an AsyncLLM mailbox (RequestOutputCollector; outputs go there, as in
the server, and are taken after each step, untimed). Prints one JSON line: us per step (median of steps after the
first 10) and us per request.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

from vllm_lite.testing.baselines import bench_json

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # PYTHONPATH (an A/B tree) wins


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--kind", default="delta", choices=["delta", "cumulative", "final"])
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--no-detokenize", action="store_true")
    ap.add_argument("--queues", action="store_true")
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()

    import numpy as np
    from transformers import AutoTokenizer

    from vllm_lite import RequestOutputKind, SamplingParams
    from vllm_lite.client.output_processor import OutputProcessor, RequestOutputCollector
    from vllm_lite.core.messages import EngineCoreOutput, EngineCoreRequest

    path = a.tokenizer
    if path is None:
        from vllm_lite.testing.checkpoints import build_tokenizer

        path = os.path.join(tempfile.gettempdir(), "vllm-lite-op-bench-tok")
        if not os.path.exists(os.path.join(path, "tokenizer.json")):
            build_tokenizer(path, vocab_size=2000)
    tok = AutoTokenizer.from_pretrained(path)
    kind = {"delta": RequestOutputKind.DELTA, "cumulative": RequestOutputKind.CUMULATIVE}.get(
        a.kind, RequestOutputKind.FINAL_ONLY
    )
    params = SamplingParams(
        temperature=0.0, max_tokens=a.steps + 1, ignore_eos=True, output_kind=kind, detokenize=not a.no_detokenize
    )
    rng = np.random.default_rng(0)
    vocab = min(len(tok), 2000)
    op = OutputProcessor(tok, log_stats=False)
    ids = [f"r{i}" for i in range(a.batch)]
    queues = [RequestOutputCollector(kind) for _ in ids] if a.queues else None
    for i, rid in enumerate(ids):
        prompt = rng.integers(0, vocab, 32).tolist()
        op.add_request(EngineCoreRequest(rid, prompt, params, None, time.time()), None, queue=queues and queues[i])
    toks = rng.integers(0, vocab, (a.steps, a.batch)).tolist()
    times = []
    prof = None
    if a.profile:
        import cProfile

        prof = cProfile.Profile()
    for s in range(a.steps):
        outs = [EngineCoreOutput(rid, [toks[s][i]]) for i, rid in enumerate(ids)]
        t0 = time.perf_counter()
        if prof is not None and s >= 10:
            prof.enable()
        op.process_outputs(outs)
        if prof is not None:
            prof.disable()
        times.append(time.perf_counter() - t0)
        if queues is not None:
            for q in queues:
                q.get_nowait()
    us = statistics.median(times[10:]) * 1e6
    print(
        bench_json(
            {
                "batch": a.batch,
                "kind": a.kind,
                "detokenize": not a.no_detokenize,
                "queues": a.queues,
                "us_per_step": round(us, 1),
                "us_per_request": round(us / a.batch, 2),
            }
        )
    )
    if prof is not None:
        import pstats

        pstats.Stats(prof).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
