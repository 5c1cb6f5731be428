"""The output processor's rules, one at a time: phase times from the core's clock, aborts reaching a waiting
caller, the async collector's merging, request-index and id checks, errors and prompt logprobs of n > 1
requests, and the logprobs dicts (ranks, trimming, decoded text, deltas).

A one-character-per-token tokenizer (`CharTokenizer`) keeps expected texts readable and costs nothing to load.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from vllm_lite.client.logprobs import LogprobsProcessor, TokenTextCache, make_position_dicts
from vllm_lite.client.output_processor import (
    OutputProcessor,
    RequestOutputCollector,
    _phase_times,
    merge_request_outputs,
)
from vllm_lite.client.parallel_sampling import ParentRequest
from vllm_lite.core.messages import EngineCoreOutput, EngineCoreRequest, FinishReason, LogprobsTensors
from vllm_lite.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from vllm_lite.sampling_params import RequestOutputKind, SamplingParams
from vllm_lite.testing.char_tokenizer import CharTokenizer, ids

CUM, DELTA, FINAL = RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY
LENGTH = FinishReason.LENGTH


def request(rid: str = "r", prompt: str = "Q:", **params: Any) -> EngineCoreRequest:
    return EngineCoreRequest(rid, ids(prompt), SamplingParams(**params), 0, 100.0)


def add_parent(proc: OutputProcessor, n: int, kind: RequestOutputKind, queue=None, **params: Any) -> ParentRequest:
    parent, children = ParentRequest.make_child_requests("p", SamplingParams(n=n, output_kind=kind, **params))
    for i, (cid, child_params) in enumerate(children):
        proc.add_request(EngineCoreRequest(cid, ids("Q:"), child_params, 0, 100.0), "Q:", parent, i, queue)
    return parent


def lp_rows(rows: list[tuple[list[int], list[float], int]]) -> LogprobsTensors:
    """Rows of (token ids, logprobs, rank of column 0)."""
    return LogprobsTensors(
        torch.tensor([r[0] for r in rows], dtype=torch.int64),
        torch.tensor([r[1] for r in rows], dtype=torch.float32),
        torch.tensor([r[2] for r in rows], dtype=torch.int64),
    )


# ---------------------------------------------------------------------- phase times
def test_phase_times_follow_vllms_definitions_on_the_cores_clock() -> None:
    m = RequestMetrics(arrival_time=0.0, queued_ts=10.0, scheduled_ts=12.5, first_token_ts=13.0, last_token_ts=20.0)
    assert _phase_times(m) == (2.5, 0.5, 7.0, 7.5)
    # Clocks that seem to run backwards never give negative times.
    back = RequestMetrics(arrival_time=0.0, queued_ts=10.0, scheduled_ts=9.0, first_token_ts=8.0, last_token_ts=7.0)
    assert _phase_times(back) == (0.0, 0.0, 0.0, 0.0)


def test_phase_times_are_unknown_until_the_core_reported_them() -> None:
    assert _phase_times(RequestMetrics(arrival_time=0.0)) == (None, None, None, None)
    assert _phase_times(RequestMetrics(arrival_time=0.0, scheduled_ts=5.0)) == (None, None, None, None)
    assert _phase_times(RequestMetrics(arrival_time=0.0, queued_ts=1.0, scheduled_ts=0.0)) == (None,) * 4
    queued_only = RequestMetrics(arrival_time=0.0, queued_ts=1.0, scheduled_ts=4.0)
    assert _phase_times(queued_only) == (3.0, None, None, None)
    assert _phase_times(RequestMetrics(arrival_time=0.0, queued_ts=1.0, scheduled_ts=4.0, first_token_ts=5.0)) == (
        3.0,
        None,
        None,
        None,
    )
    assert _phase_times(RequestMetrics(arrival_time=0.0, queued_ts=1.0, scheduled_ts=4.0, last_token_ts=5.0)) == (
        3.0,
        None,
        None,
        None,
    )


def test_the_cores_timestamps_reach_the_metrics_and_the_finished_requests_stats() -> None:
    proc = OutputProcessor(CharTokenizer(), log_stats=True)
    proc.add_request(request(), None)
    proc.process_outputs([EngineCoreOutput("r", [])], engine_core_timestamp=51.5)  # a prefill chunk: no token step
    first = EngineCoreOutput("r", ids("a"), queued_ts=50.0, scheduled_ts=51.0, num_cached_tokens=2)
    proc.process_outputs([first], engine_core_timestamp=52.0)
    proc.process_outputs([EngineCoreOutput("r", [], num_cached_tokens=7)], engine_core_timestamp=53.0)
    res = proc.process_outputs([EngineCoreOutput("r", ids("b"), finish_reason=LENGTH)], engine_core_timestamp=55.0)
    (ro,) = res.request_outputs
    m = ro.metrics
    assert (m.queued_ts, m.scheduled_ts, m.first_token_ts, m.last_token_ts) == (50.0, 51.0, 52.0, 55.0)
    assert ro.num_cached_tokens == 2  # from the first output with tokens only
    (fin,) = res.iteration_stats.finished_requests
    assert (fin.queue_time_s, fin.prefill_time_s, fin.decode_time_s, fin.inference_time_s) == (1.0, 1.0, 3.0, 4.0)
    assert fin.finish_reason == "length" and fin.num_prompt_tokens == 2 and fin.num_generation_tokens == 2
    assert fin.e2e_latency_s == pytest.approx(m.finished_time - 100.0, abs=1e-3)
    # Later outputs without scheduling times (0.0) and batches without a core timestamp change nothing.
    proc.add_request(request("s"), None)
    proc.process_outputs([EngineCoreOutput("s", ids("x"), queued_ts=1.0, scheduled_ts=2.0)])
    res = proc.process_outputs([EngineCoreOutput("s", ids("y"), queued_ts=0.0, scheduled_ts=0.0)])
    m = res.request_outputs[0].metrics
    assert (m.queued_ts, m.scheduled_ts, m.first_token_ts, m.last_token_ts) == (1.0, 2.0, None, None)


def test_iteration_stats_count_prompts_once_and_latencies_between_token_steps() -> None:
    proc = OutputProcessor(CharTokenizer(), log_stats=True)
    proc.add_request(request(prompt="abcd"), None)
    s1 = proc.process_outputs([EngineCoreOutput("r", [])]).iteration_stats  # a prefill chunk: no token yet
    assert (s1.num_prompt_tokens, s1.num_generation_tokens, s1.time_to_first_tokens_s) == (0, 0, [])
    s2 = proc.process_outputs([EngineCoreOutput("r", ids("xy"))]).iteration_stats
    assert (s2.num_prompt_tokens, s2.num_generation_tokens, len(s2.time_to_first_tokens_s)) == (4, 2, 1)
    assert s2.inter_token_latencies_s == []
    ttft = proc.request_states["r"].metrics.first_token_time - 100.0
    assert s2.time_to_first_tokens_s == [pytest.approx(ttft, abs=1e-3)]
    before = proc.request_states["r"].metrics.last_token_time
    s3 = proc.process_outputs([EngineCoreOutput("r", ids("z"))]).iteration_stats
    assert (s3.num_prompt_tokens, s3.num_generation_tokens, s3.time_to_first_tokens_s) == (0, 1, [])
    after = proc.request_states["r"].metrics.last_token_time
    assert s3.inter_token_latencies_s == [pytest.approx(after - before, abs=1e-3)]
    # Two requests in one batch: their counts add up.
    proc.add_request(request("s", prompt="abc"), None)
    proc.add_request(request("t", prompt="de"), None)
    s4 = proc.process_outputs([EngineCoreOutput("s", ids("xy")), EngineCoreOutput("t", ids("z"))]).iteration_stats
    assert (s4.num_prompt_tokens, s4.num_generation_tokens) == (5, 3)
    assert OutputProcessor(CharTokenizer()).process_outputs([]).iteration_stats is None


# ---------------------------------------------------------------------- aborts
def test_aborting_a_queued_request_gives_its_caller_a_final_abort_output_with_the_text_so_far() -> None:
    proc = OutputProcessor(CharTokenizer())
    q = RequestOutputCollector(CUM)
    proc.add_request(request(), "Q:", queue=q)
    proc.process_outputs([EngineCoreOutput("r", ids("hi"))])
    assert q.get_nowait().outputs[0].text == "hi"
    assert proc.abort_requests(["r"]) == ["r"]
    ro = q.get_nowait()
    assert ro.request_id == "r" and ro.finished and ro.prompt == "Q:"
    (c,) = ro.outputs
    assert (c.text, c.token_ids, c.finish_reason, c.stop_reason) == ("hi", ids("hi"), "abort", None)
    assert ro.metrics.finished_time is not None
    # A FINAL_ONLY request aborted before it finished gets its one output too; one without a queue, nothing.
    proc.add_request(request("f", output_kind=FINAL), None, queue=q)
    proc.process_outputs([EngineCoreOutput("f", ids("ab"))])
    assert q.get_nowait() is None
    proc.abort_requests(["f"])
    assert q.get_nowait().outputs[0].text == "ab"
    proc.add_request(request("n"), None)
    assert proc.has_unfinished_requests()
    assert proc.abort_requests(["n"]) == ["n"] and not proc.has_unfinished_requests()


def test_aborting_one_child_finishes_the_parent_only_with_the_last_child() -> None:
    proc = OutputProcessor(CharTokenizer())
    q = RequestOutputCollector(CUM)
    parent = add_parent(proc, 2, CUM, queue=q)
    proc.process_outputs([EngineCoreOutput("0_p", ids("a"), finish_reason=LENGTH), EngineCoreOutput("1_p", ids("b"))])
    assert [c.text for c in q.get_nowait().outputs] == ["a", "b"]
    assert proc.abort_requests(["1_p"]) == ["1_p"]
    ro = q.get_nowait()
    assert ro.request_id == "p" and ro.finished
    assert [(c.index, c.text, c.finish_reason) for c in ro.outputs] == [(0, "a", "length"), (1, "b", "abort")]
    assert parent.finished and "p" not in proc.parent_requests


def test_aborting_a_child_while_others_run_keeps_the_parent_open() -> None:
    proc = OutputProcessor(CharTokenizer())
    q = RequestOutputCollector(FINAL)
    add_parent(proc, 2, FINAL, queue=q)
    proc.abort_requests(["0_p"])
    assert q.get_nowait() is None  # FINAL_ONLY: nothing until every child is done
    assert "p" in proc.parent_requests
    res = proc.process_outputs([EngineCoreOutput("1_p", ids("zz"), finish_reason=LENGTH)])
    assert res.request_outputs == []
    ro = q.get_nowait()
    assert ro.finished and [(c.text, c.finish_reason) for c in ro.outputs] == [("", "abort"), ("zz", "length")]
    assert "p" not in proc.parent_requests


# ---------------------------------------------------------------------- add_request
def test_a_child_index_must_lie_within_the_parents_children() -> None:
    proc = OutputProcessor(CharTokenizer())
    parent, children = ParentRequest.make_child_requests("p", SamplingParams(n=2))
    cid, params = children[0]
    for bad in (-1, 2):
        with pytest.raises(ValueError, match=rf"request_index must be in \[0, 2\), got {bad}"):
            proc.add_request(EngineCoreRequest(cid, [1], params, 0, 0.0), None, parent, bad)
    proc.add_request(EngineCoreRequest(cid, [1], params, 0, 0.0), None, parent, 1)
    assert proc.get_num_unfinished_requests() == 1


def test_a_request_id_held_by_a_parent_or_another_parent_object_is_refused() -> None:
    proc = OutputProcessor(CharTokenizer())
    add_parent(proc, 2, CUM)
    with pytest.raises(ValueError, match="request_id 'p' is already in use"):
        proc.add_request(request("p"), None)
    other, children = ParentRequest.make_child_requests("p", SamplingParams(n=2))
    with pytest.raises(ValueError, match="request_id 'p' is already in use"):
        proc.add_request(EngineCoreRequest("new", [1], children[0][1], 0, 0.0), None, other, 0)
    # A plain request with the id of a running one: refused, with that id named.
    proc.add_request(request("x"), None)
    with pytest.raises(ValueError, match="request_id 'x' is already in use"):
        proc.add_request(request("x"), None)


def test_propagate_error_reaches_each_waiting_queue_once() -> None:
    proc = OutputProcessor(CharTokenizer())
    shared = RequestOutputCollector(DELTA)
    own = RequestOutputCollector(CUM)
    add_parent(proc, 2, DELTA, queue=shared)
    proc.add_request(request("solo"), None, queue=own)
    proc.add_request(request("plain"), None)
    puts: list[Any] = []
    shared.put = puts.append  # type: ignore[method-assign]
    err = RuntimeError("engine died")
    proc.propagate_error(err)
    assert puts == [err]
    with pytest.raises(RuntimeError, match="engine died"):
        own.get_nowait()


# ---------------------------------------------------------------------- n > 1
def test_a_childs_error_reaches_the_parents_output() -> None:
    proc = OutputProcessor(CharTokenizer())
    add_parent(proc, 2, CUM)
    res = proc.process_outputs(
        [
            EngineCoreOutput("0_p", ids("a")),
            EngineCoreOutput("1_p", [], finish_reason=FinishReason.ERROR, error="child failed"),
        ]
    )
    (ro,) = res.request_outputs
    assert ro.error == "child failed" and not ro.finished
    res = proc.process_outputs([EngineCoreOutput("0_p", ids("b"), finish_reason=LENGTH)])
    assert res.request_outputs[0].error is None and res.request_outputs[0].finished


def test_delta_prompt_logprobs_of_n_children_go_out_once_for_the_parent() -> None:
    proc = OutputProcessor(CharTokenizer())
    add_parent(proc, 2, DELTA, prompt_logprobs=0)
    plp = lp_rows([([ids(":")[0]], [-1.5], 3)])
    res = proc.process_outputs(
        [
            EngineCoreOutput("0_p", ids("a"), new_prompt_logprobs_tensors=plp),
            EngineCoreOutput("1_p", ids("b"), new_prompt_logprobs_tensors=plp),
        ]
    )
    (ro,) = res.request_outputs
    assert ro.prompt_logprobs == [None, {58: Logprob(-1.5, 3, ":")}]
    res = proc.process_outputs([EngineCoreOutput("1_p", ids("c"))])
    assert res.request_outputs[0].prompt_logprobs is None
    # CUMULATIVE repeats the whole prompt logprobs in every output, as vLLM.
    cum = OutputProcessor(CharTokenizer())
    add_parent(cum, 2, CUM, prompt_logprobs=0)
    cum.process_outputs([EngineCoreOutput("0_p", ids("a"), new_prompt_logprobs_tensors=plp)])
    res = cum.process_outputs([EngineCoreOutput("0_p", ids("b"))])
    assert res.request_outputs[0].prompt_logprobs == [None, {58: Logprob(-1.5, 3, ":")}]


def test_a_stop_string_ends_a_child_and_asks_the_core_to_abort_only_it() -> None:
    proc = OutputProcessor(CharTokenizer())
    add_parent(proc, 2, CUM, stop=["!"])
    res = proc.process_outputs([EngineCoreOutput("0_p", ids("hi!")), EngineCoreOutput("1_p", ids("yo"))])
    assert res.reqs_to_abort == ["0_p"]
    (ro,) = res.request_outputs
    assert [(c.text, c.finish_reason, c.stop_reason) for c in ro.outputs] == [("hi", "stop", "!"), ("yo", None, None)]
    # The core's own stop (EOS, stop token) needs no abort.
    res = proc.process_outputs([EngineCoreOutput("1_p", [0], finish_reason=FinishReason.STOP)])
    assert res.reqs_to_abort == [] and res.request_outputs[0].finished


def test_a_single_request_with_nothing_new_emits_nothing_in_delta_mode() -> None:
    proc = OutputProcessor(CharTokenizer())
    proc.add_request(request(output_kind=DELTA), None)
    assert proc.process_outputs([EngineCoreOutput("r", [])]).request_outputs == []
    (ro,) = proc.process_outputs([EngineCoreOutput("r", [], finish_reason=LENGTH)]).request_outputs
    assert ro.finished and ro.outputs[0].text == "" and ro.outputs[0].token_ids == []


# ---------------------------------------------------------------------- the async collector
def _ro(text: str, index: int = 0, finished: bool = False, **kw: Any) -> RequestOutput:
    c = CompletionOutput(index, text, ids(text), None, None, "length" if finished else None)
    return RequestOutput("r", "Q:", [1], kw.pop("prompt_logprobs", None), [c], finished, **kw)


def test_merged_delta_outputs_keep_every_piece_prompt_logprob_and_error() -> None:
    old = _ro("ab", prompt_logprobs=[None, {1: Logprob(-1.0, 1, "x")}], error="first")
    new = RequestOutput(
        "r2", "Q2", [2], [{2: Logprob(-2.0, 1, "y")}], [_ro("c").outputs[0], _ro("z", index=1).outputs[0]], True
    )
    merged = merge_request_outputs(old, new)
    assert merged.request_id == "r2" and merged.prompt == "Q2" and merged.prompt_token_ids == [2] and merged.finished
    assert [(c.index, c.text) for c in merged.outputs] == [(0, "abc"), (1, "z")]
    assert merged.prompt_logprobs == [None, {1: Logprob(-1.0, 1, "x")}, {2: Logprob(-2.0, 1, "y")}]
    assert merged.error == "first"
    assert merge_request_outputs(_ro("a"), _ro("b", error="late")).error == "late"
    assert merge_request_outputs(_ro("a"), _ro("b")).prompt_logprobs is None
    kept = merge_request_outputs(_ro("a", prompt_logprobs=[None]), _ro("b"))
    assert kept.prompt_logprobs == [None]  # a later piece without prompt logprobs keeps the earlier ones
    later = _ro("b", metrics=RequestMetrics(arrival_time=3.0), num_cached_tokens=8)
    merged = merge_request_outputs(_ro("a", metrics=RequestMetrics(arrival_time=1.0), num_cached_tokens=4), later)
    assert merged.metrics is later.metrics and merged.num_cached_tokens == 8
    only_new = merge_request_outputs(_ro("a"), _ro("b", prompt_logprobs=[None]))
    assert only_new.prompt_logprobs == [None]


def test_the_collector_replaces_snapshots_merges_deltas_and_lets_an_exception_win() -> None:
    cum = RequestOutputCollector(CUM)
    assert cum.get_nowait() is None
    cum.put(_ro("a"))
    cum.put(_ro("ab"))
    assert cum.get_nowait().outputs[0].text == "ab"
    delta = RequestOutputCollector(DELTA)
    delta.put(_ro("a"))
    delta.put(_ro("b"))
    assert delta.get_nowait().outputs[0].text == "ab"
    err = RuntimeError("dead")
    for first, second in ((err, _ro("x")), (_ro("x"), err)):
        q = RequestOutputCollector(DELTA)
        q.put(first)
        q.put(second)
        with pytest.raises(RuntimeError, match="dead"):
            q.get_nowait()
        assert q.get_nowait() is None


def test_the_collector_hands_an_output_put_before_the_consumer_waited() -> None:
    async def main() -> list[str]:
        q = RequestOutputCollector(CUM)
        q.put(_ro("early"))
        got = [(await asyncio.wait_for(q.get(), 5)).outputs[0].text]
        q.put(_ro("same loop"))  # from the loop's own thread
        got.append((await asyncio.wait_for(q.get(), 5)).outputs[0].text)
        return got

    assert asyncio.run(main()) == ["early", "same loop"]


def test_a_put_after_the_consumers_loop_closed_is_kept_not_raised() -> None:
    q = RequestOutputCollector(CUM)

    async def wait_once() -> None:
        q.put(_ro("a"))
        await q.get()

    asyncio.run(wait_once())
    q.put(_ro("late"))
    assert q.get_nowait().outputs[0].text == "late"


# ---------------------------------------------------------------------- logprobs
def test_position_dicts_put_the_chosen_token_first_with_its_true_rank_then_the_top_k() -> None:
    cache = TokenTextCache(CharTokenizer())
    a, b, c, d = ids("abcd")
    # Row 0: the chosen token (d, rank 7) is not among the top 3. Row 1: it is (b, rank 1) and appears once.
    tensors = lp_rows(
        [([d, a, b, c], [-5.0, -0.125, -0.25, -0.375], 7), ([b, b, a, c], [-0.5, -0.5, -0.75, -0.875], 1)]
    )
    dicts, chosen = make_position_dicts(tensors, 2, cache)
    assert chosen == [-5.0, -0.5]
    assert list(dicts[0].items()) == [
        (d, Logprob(-5.0, 7, "d")),
        (a, Logprob(-0.125, 1, "a")),
        (b, Logprob(-0.25, 2, "b")),
    ]
    assert list(dicts[1].items()) == [(b, Logprob(-0.5, 1, "b")), (a, Logprob(-0.75, 2, "a"))]
    # Zero candidates asked: the chosen token alone; no text cache: no decoded text.
    dicts, _ = make_position_dicts(tensors, 0, None)
    assert [list(x.items()) for x in dicts] == [[(d, Logprob(-5.0, 7, None))], [(b, Logprob(-0.5, 1, None))]]


def test_position_dicts_accept_plain_lists_and_rows_no_wider_than_asked() -> None:
    tensors = LogprobsTensors([[5, 6]], [[-1.0, -2.0]], [2])
    dicts, chosen = make_position_dicts(tensors, 1, None)
    assert dicts == [{5: Logprob(-1.0, 2, None), 6: Logprob(-2.0, 1, None)}] and chosen == [-1.0]
    assert make_position_dicts(LogprobsTensors([], [], []), 3, None) == ([], [])


def test_the_token_text_cache_decodes_each_id_once_and_unknown_ids_as_empty_text() -> None:
    calls: list[tuple[list[int], bool]] = []

    class Counting(CharTokenizer):
        def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
            calls.append((list(token_ids), skip_special_tokens))
            if token_ids == [ord("e")]:
                return ""  # a token with no text of its own
            return super().decode(token_ids, skip_special_tokens)

    cache = TokenTextCache(Counting(), max_entries=2)
    assert cache.decode_many([ord("a"), ord("a"), 0]) == ["a", "a", "\x00"]
    # One decode per id, special tokens shown (a logprob's text names the token, special or not).
    assert calls == [([ord("a")], False), ([0], False)]
    assert cache.decode(0x110000) == ""  # past the vocabulary (a padded model vocab): no text, no error
    assert calls[-1] == ([0x110000], False)
    # Full (2 entries): the cache starts over rather than grow without bound.
    assert len(cache._cache) == 1
    cache.decode(ord("a"))
    assert calls[-1] == ([ord("a")], False)
    assert cache.decode(ord("e")) == ""
    assert TokenTextCache(CharTokenizer()).max_entries == 1 << 16


def test_logprobs_processor_accumulates_sums_and_pops_deltas() -> None:
    cache = TokenTextCache(CharTokenizer())
    lp = LogprobsProcessor(1, 0, cache)
    assert lp.logprobs == [] and lp.cumulative_logprob == 0.0 and lp.prompt_logprobs == [None]
    a, b = ids("ab")
    lp.update_from_output(
        EngineCoreOutput(
            "r",
            [a, b],
            new_logprobs=lp_rows([([a, b], [-1.0, -2.0], 1), ([b, a], [-0.5, -0.25], 2)]),
            new_prompt_logprobs_tensors=lp_rows([([b, a], [-3.0, -0.1], 5)]),
        )
    )
    assert lp.cumulative_logprob == pytest.approx(-1.5)
    assert lp.logprobs == [
        {a: Logprob(-1.0, 1, "a"), b: Logprob(-2.0, 1, "b")},
        {b: Logprob(-0.5, 2, "b"), a: Logprob(-0.25, 1, "a")},
    ]
    assert lp.prompt_logprobs == [None, {b: Logprob(-3.0, 5, "b")}]  # 0 prompt candidates: the prompt token only
    assert lp.pop_sample_delta() == lp.logprobs
    assert lp.pop_sample_delta() == []
    assert lp.pop_prompt_delta() == [None, {b: Logprob(-3.0, 5, "b")}]
    assert lp.pop_prompt_delta() is None
    none = LogprobsProcessor(None, None, cache)
    none.update_from_output(EngineCoreOutput("r", [a], new_logprobs=lp_rows([([a], [-1.0], 1)])))
    assert (none.logprobs, none.cumulative_logprob, none.prompt_logprobs) == (None, None, None)
    assert none.pop_sample_delta() is None and none.pop_prompt_delta() is None


def test_a_request_that_skips_detokenizing_gets_logprobs_without_text() -> None:
    req = request(logprobs=0, prompt_logprobs=1, detokenize=False)
    lp = LogprobsProcessor.from_new_request(req, TokenTextCache(CharTokenizer()))
    assert (lp.num_logprobs, lp.num_prompt_logprobs, lp.text_cache) == (0, 1, None)
    with_text = LogprobsProcessor.from_new_request(request(logprobs=2), TokenTextCache(CharTokenizer()))
    assert with_text.text_cache is not None and with_text.num_prompt_logprobs is None


# ---------------------------------------------------------------------- one batch, many requests
def add_parent_as(proc: OutputProcessor, pid: str, n: int, kind: RequestOutputKind) -> None:
    parent, children = ParentRequest.make_child_requests(pid, SamplingParams(n=n, output_kind=kind))
    for i, (cid, child_params) in enumerate(children):
        proc.add_request(EngineCoreRequest(cid, ids("Q:"), child_params, 0, 100.0), "Q:", parent, i)


def test_an_output_with_nothing_due_or_for_a_forgotten_request_does_not_hide_the_rest_of_the_batch() -> None:
    proc = OutputProcessor(CharTokenizer())
    proc.add_request(request("f", output_kind=FINAL), None)
    proc.add_request(request("c"), None)
    add_parent_as(proc, "p", 2, FINAL)
    add_parent_as(proc, "q", 2, CUM)
    batch = [
        EngineCoreOutput("gone", ids("?")),  # aborted earlier: dropped
        EngineCoreOutput("f", ids("x")),  # FINAL_ONLY, not finished: nothing due
        EngineCoreOutput("0_p", ids("y")),  # its parent has nothing due either
        EngineCoreOutput("c", ids("hi")),
        EngineCoreOutput("0_q", ids("z")),
    ]
    outs = proc.process_outputs(batch).request_outputs
    assert [(o.request_id, [c.text for c in o.outputs]) for o in outs] == [("c", ["hi"]), ("q", ["z"])]
    assert outs[0].prompt_token_ids == ids("Q:")


def test_the_cores_stop_token_is_not_part_of_the_text_and_held_back_text_is_released_at_the_end() -> None:
    proc = OutputProcessor(CharTokenizer())
    proc.add_request(request("s", stop_token_ids=[ord("!")]), None)
    (ro,) = proc.process_outputs(
        [EngineCoreOutput("s", ids("hi!"), finish_reason=FinishReason.STOP, stop_reason=ord("!"))]
    ).request_outputs
    assert (ro.outputs[0].text, ro.outputs[0].stop_reason, ro.outputs[0].finish_reason) == ("hi", ord("!"), "stop")
    proc.add_request(request("h", stop=["xyz"]), None)
    (ro,) = proc.process_outputs([EngineCoreOutput("h", ids("abx"))]).request_outputs
    assert ro.outputs[0].text == "ab"  # "x" may start the stop string: held back while streaming
    (ro,) = proc.process_outputs([EngineCoreOutput("h", [], finish_reason=LENGTH)]).request_outputs
    assert ro.outputs[0].text == "abx"


def test_a_plain_request_is_output_zero_and_reports_no_cached_tokens_before_its_first_token() -> None:
    proc = OutputProcessor(CharTokenizer())
    proc.add_request(request(), None)
    (ro,) = proc.process_outputs(
        [EngineCoreOutput("r", [], finish_reason=FinishReason.ERROR, error="bad", num_cached_tokens=3)]
    ).request_outputs
    assert ro.outputs[0].index == 0 and ro.num_cached_tokens == 0


def test_without_a_tokenizer_logprobs_carry_no_text() -> None:
    proc = OutputProcessor(None)
    assert proc.text_cache is None
    proc.add_request(request(logprobs=0), None)
    lp = lp_rows([([5], [-1.0], 1)])
    (ro,) = proc.process_outputs([EngineCoreOutput("r", [5], new_logprobs=lp, finish_reason=LENGTH)]).request_outputs
    assert ro.outputs[0].logprobs == [{5: Logprob(-1.0, 1, None)}]
