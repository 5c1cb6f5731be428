"""process_outputs' one-token fast path (DELTA / FINAL_ONLY, no stop strings, logprobs or parent) against the
general path: the same RequestOutputs (text, ids, finish, metrics, stats) for every step, in the same order.

Each case runs twice over the same core outputs: as built (plain requests take the fast path) and with every
state's `fast` flag cleared (the general path). Requests that must not take it (stop strings, logprobs, n > 1,
CUMULATIVE) are mixed in so the batch interleaves both paths.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import random

import pytest

from vllm_lite.client.output_processor import OutputProcessor, RequestOutputCollector
from vllm_lite.core.messages import EngineCoreOutput, EngineCoreRequest, FinishReason
from vllm_lite.sampling_params import RequestOutputKind, SamplingParams

TEXT = "Hello wörld, 日本語 ☃ the quick brown fox. Ünïcödé ✓ done and more text here."


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from vllm_lite.testing.checkpoints import build_tokenizer

    return AutoTokenizer.from_pretrained(build_tokenizer(str(tmp_path_factory.mktemp("tok"))))


SPECS = [
    {"output_kind": RequestOutputKind.DELTA},
    {"output_kind": RequestOutputKind.DELTA, "detokenize": False},
    {"output_kind": RequestOutputKind.DELTA, "min_tokens": 3},
    {"output_kind": RequestOutputKind.FINAL_ONLY},
    {"output_kind": RequestOutputKind.DELTA, "stop": ["fox"]},
    {"output_kind": RequestOutputKind.DELTA, "logprobs": 1},
    {"output_kind": RequestOutputKind.CUMULATIVE},
]


def run(tokenizer, use_fast: bool, with_queues: bool, log_stats: bool, seed: int):
    rng = random.Random(seed)
    proc = OutputProcessor(tokenizer, log_stats=log_stats)
    text_ids = tokenizer.encode(TEXT, add_special_tokens=False)
    queues = {}
    streams = {}
    for i, spec in enumerate(SPECS):
        rid = f"r{i}"
        params = SamplingParams(max_tokens=len(text_ids), **spec)
        req = EngineCoreRequest(rid, tokenizer.encode("Say: 日"), params, tokenizer.eos_token_id, 100.0 + i)
        q = RequestOutputCollector(params.output_kind) if with_queues else None
        queues[rid] = q
        proc.add_request(req, "Say: 日", queue=q)
        start = rng.randrange(len(text_ids) // 2)
        streams[rid] = text_ids[start:] + text_ids[:start]
    if not use_fast:
        for s in proc.request_states.values():
            s.fast = 0
    else:
        assert [s.fast for s in proc.request_states.values()] == [1, 1, 1, 2, 1, 0, 0]
    got = []
    n = len(text_ids)
    for step in range(n):
        outs = []
        for rid, ids in streams.items():
            last = step == n - 1
            outs.append(
                EngineCoreOutput(
                    rid,
                    [ids[step]],
                    finish_reason=FinishReason.LENGTH if last else None,
                    queued_ts=1.0 if step == 0 else 0.0,
                    scheduled_ts=2.0 if step == 0 else 0.0,
                )
            )
        rng.shuffle(outs)
        res = proc.process_outputs(outs, engine_core_timestamp=10.0 + step)
        stats = res.iteration_stats
        got.append(
            (
                [ro_key(ro) for ro in res.request_outputs],
                None if stats is None else (stats.num_generation_tokens, len(stats.inter_token_latencies_s)),
            )
        )
        if with_queues:
            got.append([ro_key(q.get_nowait()) for q in queues.values()])
    return got


def ro_key(ro):
    if ro is None:
        return None
    m = ro.metrics
    return (
        ro.request_id,
        ro.prompt,
        list(ro.prompt_token_ids),
        ro.prompt_logprobs,
        [
            (c.index, c.text, list(c.token_ids), c.cumulative_logprob, c.finish_reason, c.stop_reason)
            for c in ro.outputs
        ],
        ro.finished,
        ro.num_cached_tokens,
        ro.error,
        (m.num_generation_tokens, m.first_token_ts, m.last_token_ts, m.queued_ts, m.scheduled_ts),
    )


@pytest.mark.parametrize("with_queues", [False, True], ids=["list", "queues"])
@pytest.mark.parametrize("log_stats", [False, True], ids=["nostats", "stats"])
def test_fast_path_outputs_equal_the_general_path(tokenizer, with_queues, log_stats):
    for seed in range(3):
        fast = run(tokenizer, True, with_queues, log_stats, seed)
        slow = run(tokenizer, False, with_queues, log_stats, seed)
        assert fast == slow
        outputs = fast[1::2] if with_queues else [k for k, _ in fast]
        assert sum(ro is not None for step in outputs for ro in step) > len(TEXT) // 2


def test_fast_path_text_is_the_whole_decode(tokenizer):
    proc = OutputProcessor(tokenizer)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    params = SamplingParams(max_tokens=len(ids), output_kind=RequestOutputKind.DELTA)
    proc.add_request(EngineCoreRequest("r", [1, 5], params, 2, 0.0), None)
    text = ""
    for i, t in enumerate(ids):
        fin = FinishReason.LENGTH if i == len(ids) - 1 else None
        (ro,) = proc.process_outputs([EngineCoreOutput("r", [t], finish_reason=fin)]).request_outputs
        assert ro.outputs[0].token_ids == [t]
        text += ro.outputs[0].text
    assert text == TEXT
