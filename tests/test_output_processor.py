"""OutputProcessor: hand-made EngineCoreOutput sequences in, RequestOutputs out (no engine)."""

from __future__ import annotations

import asyncio
import math
import os
import threading

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from vllm_lite.client.output_processor import OutputProcessor, RequestOutputCollector
from vllm_lite.client.parallel_sampling import ParentRequest
from vllm_lite.core.messages import EngineCoreOutput, EngineCoreRequest, FinishReason, LogprobsTensors
from vllm_lite.sampling_params import RequestOutputKind, SamplingParams

torch.set_num_threads(1)

CUM, DELTA, FINAL = RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from vllm_lite.testing.checkpoints import build_tokenizer

    return AutoTokenizer.from_pretrained(build_tokenizer(str(tmp_path_factory.mktemp("tok"))))


def ids_of(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def make_request(tok, rid: str = "r0", prompt: str = "Q:", **params) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id=rid,
        prompt_token_ids=tok.encode(prompt, add_special_tokens=True),
        sampling_params=SamplingParams(**params),
        eos_token_id=tok.eos_token_id,
        arrival_time=100.0,
    )


def run_stream(proc: OutputProcessor, rid: str, ids: list[int], finish=FinishReason.LENGTH, **extra):
    """Feed ids one per step, the last step finished; return (all RequestOutputs, all reqs_to_abort)."""
    outs, aborts = [], []
    for i, t in enumerate(ids):
        last = i == len(ids) - 1
        eco = EngineCoreOutput(request_id=rid, new_token_ids=[t], finish_reason=finish if last else None, **extra)
        res = proc.process_outputs([eco])
        outs += res.request_outputs
        aborts += res.reqs_to_abort
    return outs, aborts


def test_cumulative_outputs_grow_and_end_with_full_text(tokenizer):
    proc = OutputProcessor(tokenizer)
    text = "Hello there, wörld."
    ids = ids_of(tokenizer, text)
    proc.add_request(make_request(tokenizer, output_kind=CUM), "Q:")
    outs, aborts = run_stream(proc, "r0", ids)
    assert len(outs) == len(ids) and not aborts
    for i, ro in enumerate(outs):
        assert ro.request_id == "r0" and ro.prompt == "Q:"
        assert ro.outputs[0].token_ids == ids[: i + 1]
        assert text.startswith(ro.outputs[0].text)
        assert ro.finished == (i == len(ids) - 1)
    final = outs[-1].outputs[0]
    assert final.text == text and final.finish_reason == "length" and final.stop_reason is None
    assert final.cumulative_logprob is None and final.logprobs is None  # not requested, as vLLM
    assert not proc.has_unfinished_requests()


def test_delta_pieces_concatenate_to_final_text_and_ids(tokenizer):
    text = "Streaming piece by piece: 日本語 ✓ ok."
    ids = ids_of(tokenizer, text)
    proc = OutputProcessor(tokenizer)
    proc.add_request(make_request(tokenizer, "d", output_kind=DELTA), None)
    proc.add_request(make_request(tokenizer, "f", output_kind=FINAL), None)
    deltas, finals = [], []
    for i, t in enumerate(ids):
        fin = FinishReason.LENGTH if i == len(ids) - 1 else None
        res = proc.process_outputs(
            [EngineCoreOutput("d", [t], finish_reason=fin), EngineCoreOutput("f", [t], finish_reason=fin)]
        )
        deltas += [r for r in res.request_outputs if r.request_id == "d"]
        finals += [r for r in res.request_outputs if r.request_id == "f"]
    assert len(finals) == 1 and finals[0].finished
    assert "".join(d.outputs[0].text for d in deltas) == finals[0].outputs[0].text == text
    assert sum((d.outputs[0].token_ids for d in deltas), []) == finals[0].outputs[0].token_ids == ids
    assert [d.finished for d in deltas].count(True) == 1 and deltas[-1].finished


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("kind", [CUM, DELTA, FINAL])
def test_stop_string_ends_request_and_asks_core_to_abort(tokenizer, include, kind):
    ids = ids_of(tokenizer, "abc def STOP ghi jkl")
    proc = OutputProcessor(tokenizer)
    proc.add_request(make_request(tokenizer, stop=["STOP"], include_stop_str_in_output=include, output_kind=kind), None)
    outs, aborts = [], []
    for t in ids:
        res = proc.process_outputs([EngineCoreOutput("r0", [t])])
        outs += res.request_outputs
        aborts += res.reqs_to_abort
    assert aborts == ["r0"]
    assert not proc.has_unfinished_requests()  # later core outputs for r0 were dropped
    assert outs[-1].finished and sum(o.finished for o in outs) == 1
    expected = "abc def STOP" if include else "abc def "
    text = "".join(o.outputs[0].text for o in outs) if kind == DELTA else outs[-1].outputs[0].text
    assert text == expected
    c = outs[-1].outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == "STOP"
    # Token ids still flow up to the token that completed the stop string.
    got_ids = sum((o.outputs[0].token_ids for o in outs), []) if kind == DELTA else c.token_ids
    n = next(i for i in range(1, len(ids) + 1) if "STOP" in tokenizer.decode(ids[:i]))
    assert got_ids == ids[:n]


def test_streamed_text_never_shows_a_stop_string_start_that_is_later_cut(tokenizer):
    ids = ids_of(tokenizer, "one two ##END## three")
    proc = OutputProcessor(tokenizer)
    proc.add_request(make_request(tokenizer, stop=["##END##"], output_kind=CUM), None)
    outs, _ = run_stream(proc, "r0", ids)
    final = outs[-1].outputs[0].text
    assert final == "one two "
    for o in outs:
        assert final.startswith(o.outputs[0].text)
        assert "#" not in o.outputs[0].text


def test_core_finish_on_stop_token_reports_stop_and_no_abort(tokenizer):
    ids = ids_of(tokenizer, "xy")
    proc = OutputProcessor(tokenizer)
    proc.add_request(make_request(tokenizer, output_kind=FINAL), None)
    outs, aborts = run_stream(proc, "r0", ids + [tokenizer.eos_token_id], finish=FinishReason.STOP)
    assert not aborts and len(outs) == 1
    c = outs[0].outputs[0]
    assert c.text == "xy" and c.finish_reason == "stop" and c.token_ids == ids + [tokenizer.eos_token_id]


def _lp_tensors(rows: list[tuple[int, float, int, list[tuple[int, float]]]]) -> LogprobsTensors:
    """rows of (chosen id, chosen logprob, chosen rank, top-k [(id, logprob)])."""
    ids = torch.tensor([[r[0]] + [t for t, _ in r[3]] for r in rows], dtype=torch.int64)
    lps = torch.tensor([[r[1]] + [lp for _, lp in r[3]] for r in rows], dtype=torch.float32)
    ranks = torch.tensor([r[2] for r in rows], dtype=torch.int64)
    return LogprobsTensors(ids, lps, ranks)


def test_logprobs_become_dicts_trimmed_to_request_and_decoded(tokenizer):
    a, b, c, d = (
        ids_of(tokenizer, "a")[0],
        ids_of(tokenizer, "b")[0],
        ids_of(tokenizer, "c")[0],
        ids_of(tokenizer, "d")[0],
    )
    proc = OutputProcessor(tokenizer)
    proc.add_request(make_request(tokenizer, logprobs=1, output_kind=FINAL), None)
    # The batch computed 3 candidates; this request asked for 1.
    step1 = _lp_tensors([(a, -0.5, 1, [(a, -0.5), (b, -1.5), (c, -2.0)])])
    step2 = _lp_tensors([(d, -3.0, 4, [(b, -0.1), (c, -2.5), (a, -2.7)])])
    proc.process_outputs([EngineCoreOutput("r0", [a], new_logprobs=step1)])
    res = proc.process_outputs([EngineCoreOutput("r0", [d], new_logprobs=step2, finish_reason=FinishReason.LENGTH)])
    out = res.request_outputs[0].outputs[0]
    assert len(out.logprobs) == 2
    pos0, pos1 = out.logprobs
    assert list(pos0) == [a]  # sampled token is also the top-1: one entry
    assert pos0[a].rank == 1 and pos0[a].logprob == pytest.approx(-0.5) and pos0[a].decoded_token == "a"
    assert list(pos1) == [d, b]  # sampled first, then the top-1 candidate
    assert pos1[d].rank == 4 and pos1[b].rank == 1 and pos1[b].decoded_token == "b"
    assert pos1[b].logprob == pytest.approx(-0.1)
    assert out.cumulative_logprob == pytest.approx(-3.5)


def test_delta_logprobs_come_per_piece(tokenizer):
    a, b = ids_of(tokenizer, "a")[0], ids_of(tokenizer, "b")[0]
    proc = OutputProcessor(tokenizer)
    proc.add_request(make_request(tokenizer, logprobs=0, output_kind=DELTA), None)
    r1 = proc.process_outputs([EngineCoreOutput("r0", [a], new_logprobs=_lp_tensors([(a, -1.0, 2, [(b, -0.4)])]))])
    r2 = proc.process_outputs(
        [
            EngineCoreOutput(
                "r0", [b], new_logprobs=_lp_tensors([(b, -0.2, 1, [(b, -0.2)])]), finish_reason=FinishReason.LENGTH
            )
        ]
    )
    o1, o2 = r1.request_outputs[0].outputs[0], r2.request_outputs[0].outputs[0]
    assert [list(d) for d in o1.logprobs] == [[a]] and [list(d) for d in o2.logprobs] == [[b]]
    assert o1.cumulative_logprob == pytest.approx(-1.0) and o2.cumulative_logprob == pytest.approx(-1.2)


def test_prompt_logprobs_start_with_none_and_accumulate_over_chunks(tokenizer):
    req = make_request(tokenizer, prompt="one two three four", prompt_logprobs=1, output_kind=FINAL)
    p = req.prompt_token_ids
    proc = OutputProcessor(tokenizer)
    proc.add_request(req, None)
    rows = [(p[i], -float(i), i, [(p[0], -0.01)]) for i in range(1, len(p))]
    half = len(rows) // 2
    # Chunked prefill: prompt logprobs arrive in two pieces, the second with the first token.
    assert (
        proc.process_outputs(
            [EngineCoreOutput("r0", [], new_prompt_logprobs_tensors=_lp_tensors(rows[:half]))]
        ).request_outputs
        == []
    )
    res = proc.process_outputs(
        [
            EngineCoreOutput(
                "r0", [5], new_prompt_logprobs_tensors=_lp_tensors(rows[half:]), finish_reason=FinishReason.LENGTH
            )
        ]
    )
    pl = res.request_outputs[0].prompt_logprobs
    assert len(pl) == len(p) and pl[0] is None
    for i in range(1, len(p)):
        assert p[i] in pl[i] and pl[i][p[i]].logprob == pytest.approx(-float(i)) and pl[i][p[i]].rank == i
        assert p[0] in pl[i] and pl[i][p[0]].decoded_token == tokenizer.decode([p[0]])
    assert res.request_outputs[0].outputs[0].logprobs is None


def _add_parent(proc, tok, n, kind, queue=None, **params):
    params = SamplingParams(n=n, output_kind=kind, seed=7, **params)
    parent, children = ParentRequest.make_child_requests("p", params)
    for idx, (cid, cparams) in enumerate(children):
        req = make_request(tok, cid)
        req.sampling_params = cparams
        proc.add_request(req, "Q:", parent_req=parent, request_index=idx, queue=queue)
    return parent, children


def test_make_child_requests_gives_n1_children_with_distinct_seeds():
    parent, children = ParentRequest.make_child_requests("req", SamplingParams(n=3, seed=10, temperature=0.8))
    assert [cid for cid, _ in children] == ["0_req", "1_req", "2_req"]
    assert [p.seed for _, p in children] == [10, 11, 12]
    assert all(p.n == 1 and p.temperature == 0.8 for _, p in children)
    _, unseeded = ParentRequest.make_child_requests("u", SamplingParams(n=2))
    assert [p.seed for _, p in unseeded] == [None, None]
    with pytest.raises(ValueError, match="n"):
        ParentRequest("x", SamplingParams(n=1))


def test_n_gt_1_final_only_returns_once_all_children_finished_sorted(tokenizer):
    proc = OutputProcessor(tokenizer)
    _, children = _add_parent(proc, tokenizer, 3, FINAL)
    texts = {"0_p": "zero", "1_p": "one!", "2_p": "two."}
    # Child 2 finishes first, then 0, then 1.
    order = ["2_p", "0_p", "1_p"]
    emitted = []
    for cid in order:
        res = proc.process_outputs(
            [EngineCoreOutput(cid, ids_of(tokenizer, texts[cid]), finish_reason=FinishReason.LENGTH)]
        )
        emitted += res.request_outputs
    assert len(emitted) == 1
    ro = emitted[0]
    assert ro.request_id == "p" and ro.finished
    assert [c.index for c in ro.outputs] == [0, 1, 2]
    assert [c.text for c in ro.outputs] == ["zero", "one!", "two."]
    assert not proc.has_unfinished_requests() and not proc.parent_requests


def test_n_gt_1_cumulative_emits_one_snapshot_per_step_with_all_children(tokenizer):
    proc = OutputProcessor(tokenizer)
    _add_parent(proc, tokenizer, 2, CUM)
    a, b = ids_of(tokenizer, "a")[0], ids_of(tokenizer, "b")[0]
    r1 = proc.process_outputs([EngineCoreOutput("1_p", [b]), EngineCoreOutput("0_p", [a])]).request_outputs
    assert len(r1) == 1 and [c.text for c in r1[0].outputs] == ["a", "b"] and not r1[0].finished
    r2 = proc.process_outputs([EngineCoreOutput("0_p", [a], finish_reason=FinishReason.LENGTH)]).request_outputs
    assert [c.text for c in r2[0].outputs] == ["aa", "b"] and not r2[0].finished
    assert r2[0].outputs[0].finish_reason == "length" and r2[0].outputs[1].finish_reason is None
    r3 = proc.process_outputs([EngineCoreOutput("1_p", [b], finish_reason=FinishReason.LENGTH)]).request_outputs
    assert [c.text for c in r3[0].outputs] == ["aa", "bb"] and r3[0].finished


def test_n_gt_1_delta_pieces_rebuild_each_child(tokenizer):
    proc = OutputProcessor(tokenizer)
    _add_parent(proc, tokenizer, 2, DELTA)
    steps = [
        [EngineCoreOutput("0_p", ids_of(tokenizer, "x")), EngineCoreOutput("1_p", ids_of(tokenizer, "y"))],
        [EngineCoreOutput("1_p", ids_of(tokenizer, "z"), finish_reason=FinishReason.LENGTH)],
        [EngineCoreOutput("0_p", ids_of(tokenizer, "w"), finish_reason=FinishReason.LENGTH)],
    ]
    texts = {0: "", 1: ""}
    outs = []
    for s in steps:
        outs += proc.process_outputs(s).request_outputs
    assert len(outs) == 3 and [o.finished for o in outs] == [False, False, True]
    assert [c.index for c in outs[1].outputs] == [1]  # only the child that moved
    for o in outs:
        for c in o.outputs:
            texts[c.index] += c.text
    assert texts == {0: "xw", 1: "yz"}


def test_abort_parent_returns_child_ids_and_queue_gets_abort_output(tokenizer):
    proc = OutputProcessor(tokenizer)
    q = RequestOutputCollector(CUM)
    _add_parent(proc, tokenizer, 2, CUM, queue=q)
    proc.process_outputs([EngineCoreOutput("0_p", ids_of(tokenizer, "hi"))])
    assert q.get_nowait().outputs[0].text == "hi"
    assert sorted(proc.abort_requests(["p"])) == ["0_p", "1_p"]
    assert not proc.has_unfinished_requests()
    final = q.get_nowait()
    assert final.finished and {c.finish_reason for c in final.outputs} == {"abort"}
    assert proc.abort_requests(["p", "nope"]) == []


def test_abort_single_request_and_late_outputs_are_ignored(tokenizer):
    proc = OutputProcessor(tokenizer)
    proc.add_request(make_request(tokenizer), None)
    assert proc.get_num_unfinished_requests() == 1
    assert proc.abort_requests(["r0"]) == ["r0"]
    res = proc.process_outputs([EngineCoreOutput("r0", [5])])
    assert res.request_outputs == [] and res.reqs_to_abort == []


def test_error_output_reaches_the_caller(tokenizer):
    proc = OutputProcessor(tokenizer)
    proc.add_request(make_request(tokenizer), None)
    res = proc.process_outputs([EngineCoreOutput("r0", [], finish_reason=FinishReason.ERROR, error="boom")])
    ro = res.request_outputs[0]
    assert ro.finished and ro.error == "boom" and ro.outputs[0].finish_reason == "error"


def test_duplicate_request_id_is_rejected(tokenizer):
    proc = OutputProcessor(tokenizer)
    proc.add_request(make_request(tokenizer), None)
    with pytest.raises(ValueError, match="request_id"):
        proc.add_request(make_request(tokenizer), None)


def test_parent_id_clashing_with_a_running_request_is_rejected(tokenizer):
    proc = OutputProcessor(tokenizer)
    _add_parent(proc, tokenizer, 2, CUM)
    with pytest.raises(ValueError, match="request_id 'p'"):
        proc.add_request(make_request(tokenizer, "p"), None)
    with pytest.raises(ValueError, match="request_id 'p'"):
        _add_parent(proc, tokenizer, 2, CUM)


def test_metrics_and_stats_track_tokens_and_times(tokenizer):
    proc = OutputProcessor(tokenizer, log_stats=True)
    req = make_request(tokenizer)
    proc.add_request(req, None)
    r1 = proc.process_outputs([EngineCoreOutput("r0", [5, 6], num_cached_tokens=1)])
    r2 = proc.process_outputs([EngineCoreOutput("r0", [7], finish_reason=FinishReason.LENGTH)])
    m = r2.request_outputs[0].metrics
    assert m.arrival_time == 100.0 and m.num_generation_tokens == 3
    assert m.first_token_time <= m.last_token_time <= m.finished_time
    assert r2.request_outputs[0].num_cached_tokens == 1
    s1, s2 = r1.iteration_stats, r2.iteration_stats
    assert s1.num_generation_tokens == 2 and s1.num_prompt_tokens == len(req.prompt_token_ids)
    assert len(s1.time_to_first_tokens_s) == 1 and len(s2.inter_token_latencies_s) == 1
    assert s2.finished_requests[0].finish_reason == "length" and s2.finished_requests[0].num_generation_tokens == 3


# ---------------------------------------------------------------- the async collector


def test_collector_merges_deltas_when_consumer_is_slow(tokenizer):
    proc = OutputProcessor(tokenizer)
    q = RequestOutputCollector(DELTA)
    proc.add_request(make_request(tokenizer, output_kind=DELTA), None, queue=q)
    ids = ids_of(tokenizer, "merged text here")
    for i, t in enumerate(ids):
        res = proc.process_outputs(
            [EngineCoreOutput("r0", [t], finish_reason=FinishReason.LENGTH if i == len(ids) - 1 else None)]
        )
        assert res.request_outputs == []  # went to the queue
    got = q.get_nowait()
    assert got.outputs[0].text == "merged text here" and got.outputs[0].token_ids == ids and got.finished
    assert q.get_nowait() is None


def test_collector_async_get_waits_for_put_from_another_thread(tokenizer):
    proc = OutputProcessor(tokenizer)
    q = RequestOutputCollector(CUM)
    proc.add_request(make_request(tokenizer), None, queue=q)

    async def consume():
        texts = []
        threading.Timer(0.05, lambda: proc.process_outputs([EngineCoreOutput("r0", ids_of(tokenizer, "ok"))])).start()
        texts.append((await asyncio.wait_for(q.get(), 5)).outputs[0].text)
        threading.Timer(0.05, lambda: proc.propagate_error(RuntimeError("engine dead"))).start()
        with pytest.raises(RuntimeError, match="engine dead"):
            await asyncio.wait_for(q.get(), 5)
        return texts

    assert asyncio.run(consume()) == ["ok"]


def test_logprob_values_are_finite_python_floats(tokenizer):
    a = ids_of(tokenizer, "a")[0]
    proc = OutputProcessor(tokenizer)
    proc.add_request(make_request(tokenizer, logprobs=2, output_kind=FINAL), None)
    lp = _lp_tensors([(a, -0.25, 1, [(a, -0.25), (a + 1, -2.0), (a + 2, -3.0)])])
    res = proc.process_outputs([EngineCoreOutput("r0", [a], new_logprobs=lp, finish_reason=FinishReason.LENGTH)])
    d = res.request_outputs[0].outputs[0].logprobs[0]
    # logprobs=2: the top 2 (a, a+1) plus the sampled a, which is one of them; a+2 is trimmed.
    assert list(d) == [a, a + 1]
    assert all(type(v.logprob) is float and math.isfinite(v.logprob) for v in d.values())
    assert [v.rank for v in d.values()] == [1, 2]
