"""Speculative decoding end to end (issue 20, n-gram): the same tokens and logprobs as plain decoding for greedy
requests (prefix caching and forced preemption included), stop conditions inside an accepted run, the sampled
distribution kept, seeded replay after preemption, the vLLM metrics and log line, and the config surface.

Every engine runs a tiny random float32 Llama in this process, so the acceptance counters can be read straight
from the scheduler: each comparison also asserts that drafts were accepted, so it cannot pass by never speculating.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from typing import Any, Iterator

import msgspec
import pytest

from vllm_lite import LLM, SamplingParams
from vllm_lite.config import SpeculativeConfig
from vllm_lite.core.engine_core import _StatsLogger
from vllm_lite.core.messages import EngineCoreOutputs, SchedulerStats
from vllm_lite.engine_args import EngineArgs
from vllm_lite.entrypoints.openai.metrics import ServerMetrics
from vllm_lite.sampling_params import StructuredOutputsParams
from vllm_lite.spec_decode.draft_budget import DraftBudget
from vllm_lite.spec_decode.metrics import SpecDecodingStats
from vllm_lite.testing.checkpoints import get_checkpoint
from vllm_lite.testing.chi_square import chi_square_homogeneity_pvalue
from vllm_lite.testing.spec_outputs import REPEATING, assert_same_outputs, tiny_llm, token_counts, token_prompts
from vllm_lite.worker.spec_decode_step import SpecDecodeStep

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
# The distribution test fails below this p-value; every draw is seeded, so its outcome is fixed.
SIGNIFICANCE = 1e-3
# Prompts whose continuation repeats spans of themselves (the tiny model's greedy output falls into cycles too),
# and prompts of unrelated token ids.
RANDOM = [[17, 1203, 845, 77, 1500, 9, 333, 1024, 64], [1999, 3, 1400, 250, 88]]


def _llm(**kwargs: Any) -> LLM:
    return tiny_llm(**kwargs)


@pytest.fixture(scope="module")
def base() -> Iterator[LLM]:
    llm = _llm(kv_cache_memory_bytes=4 << 20)
    yield llm
    llm.shutdown()


def _spec_llm(**kwargs: Any) -> LLM:
    """An n-gram engine that drafts at every step: the batch rule (draft_budget.py, tested on its own below) decides
    from measured step times, so with it these exactness tests would draft in a batch only when the host's timing
    allowed; the tests here check how drafts are verified, which the rule never changes."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(SpecDecodeStep, "gain_rule", False)
        return _llm(speculative_config=SPEC, **kwargs)


@pytest.fixture(scope="module")
def spec() -> Iterator[LLM]:
    llm = _spec_llm(kv_cache_memory_bytes=4 << 20)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def spec_small_kv() -> Iterator[LLM]:
    """Room for about 10 blocks of 16 tokens: four requests of ~70 tokens must preempt each other."""
    llm = _spec_llm(kv_cache_memory_bytes=10 * 12400)
    yield llm
    llm.shutdown()


def _scheduler(llm: LLM) -> Any:
    return llm.llm_engine.engine_core.engine_core.scheduler


def _accepted(llm: LLM) -> int:
    total = _scheduler(llm).spec.total
    return total.num_accepted_tokens


# ---------------------------------------------------------------------------------------------- greedy equality
def test_greedy_tokens_and_logprobs_equal_plain_decoding(base: LLM, spec: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=40, logprobs=3, ignore_eos=True)
    before = _accepted(spec)
    expected = base.generate(token_prompts(REPEATING + RANDOM), params, use_tqdm=False)
    got = spec.generate(token_prompts(REPEATING + RANDOM), params, use_tqdm=False)
    assert_same_outputs(expected, got, logprobs=True)
    assert _accepted(spec) > before, "no draft was accepted: the comparison proves nothing"


def _budget(llm: LLM) -> DraftBudget:
    budget = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner.spec_decode.budget
    assert isinstance(budget, DraftBudget)
    return budget


def test_batch_decodes_plainly_while_verify_steps_cost_more_than_drafts_bring(base: LLM, request) -> None:
    """The default batch rule, end to end: with verify steps priced at 100 plain steps (step times planted, clock
    frozen so no real step moves them), three repeating requests at once run no drafts and emit what plain
    decoding does; alone (batch 1, where the rule does not apply) the same request speculates."""
    spec = _llm(kv_cache_memory_bytes=4 << 20, speculative_config=SPEC)
    request.addfinalizer(spec.shutdown)
    budget = _budget(spec)
    assert budget.gain_rule, "the rule is on by default"
    budget.clock = lambda: 0.0
    for b in range(2, 4):
        budget._plain[b], budget._verify[b] = 1.0, 100.0
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = token_prompts(REPEATING)
    got = spec.generate(prompts, params, use_tqdm=False)
    assert _scheduler(spec).spec.total.num_drafts == 0, "verify steps cost 100x: no batch step should draft"
    assert_same_outputs(base.generate(prompts, params, use_tqdm=False), got)
    spec.generate(prompts[:1], params, use_tqdm=False)
    assert _accepted(spec) > 0, "a lone request speculates whatever the batch prices"


def test_disable_by_batch_size_stops_drafts_while_that_many_requests_run(base: LLM) -> None:
    llm = _llm(kv_cache_memory_bytes=4 << 20, speculative_config={**SPEC, "disable_by_batch_size": 2})
    try:
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        pair = token_prompts(REPEATING[:2])
        got = llm.generate(pair, params, use_tqdm=False)
        assert _scheduler(llm).spec.total.num_drafts == 0, "two requests ran: no drafts at disable_by_batch_size 2"
        assert_same_outputs(base.generate(pair, params, use_tqdm=False), got)
        llm.generate(token_prompts(REPEATING[:1]), params, use_tqdm=False)
        assert _scheduler(llm).spec.total.num_drafts > 0, "a lone request speculates"
    finally:
        llm.shutdown()


def test_prefix_cache_hits_on_blocks_written_by_verified_steps(base: LLM, spec: LLM) -> None:
    """A prompt that extends an earlier speculative run hits the blocks that run filled (with accepted drafts and
    with rejected ones rewritten): a cached rejected token would change the continuation."""
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    first = spec.generate(token_prompts(REPEATING[:1]), params, use_tqdm=False)[0]
    extended = REPEATING[0] + list(first.outputs[0].token_ids)
    follow = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    got = spec.generate(token_prompts([extended]), follow, use_tqdm=False)[0]
    expected = base.generate(token_prompts([extended]), follow, use_tqdm=False)[0]
    assert got.num_cached_tokens >= 48, "the extended prompt should hit the blocks of the first run"
    assert_same_outputs([expected], [got])


def test_forced_preemption_keeps_greedy_outputs(base: LLM, spec_small_kv: LLM, monkeypatch) -> None:
    sched = _scheduler(spec_small_kv)
    preempted = []
    original = sched._preempt
    monkeypatch.setattr(sched, "_preempt", lambda req, swap_out: (preempted.append(req), original(req, swap_out)))
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    prompts = token_prompts(REPEATING + RANDOM[:1])
    before = _accepted(spec_small_kv)
    got = spec_small_kv.generate(prompts, params, use_tqdm=False)
    expected = base.generate(prompts, params, use_tqdm=False)
    assert_same_outputs(expected, got)
    assert preempted, "the small KV cache should have forced a preemption"
    assert _accepted(spec_small_kv) > before


def test_multiprocess_engine_speculates_with_the_same_outputs(base: LLM) -> None:
    """The engine core in its own process: drafts and verified tokens cross no extra boundary, outputs agree."""
    llm = LLM(
        model=get_checkpoint("llama"),
        dtype="float32",
        max_model_len=128,
        num_threads=1,
        kv_cache_memory_bytes=4 << 20,
        speculative_config=SPEC,
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=1, ignore_eos=True)
        got = llm.generate(token_prompts(REPEATING), params, use_tqdm=False)
    finally:
        llm.shutdown()
    assert_same_outputs(base.generate(token_prompts(REPEATING), params, use_tqdm=False), got, logprobs=True)


# ---------------------------------------------------------------------------------------------- stop conditions
def test_stop_conditions_inside_an_accepted_run(base: LLM, spec: LLM) -> None:
    """max_tokens, stop token ids, stop strings and min_tokens cut where plain decoding cuts them."""
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    reference = base.generate(token_prompts(REPEATING[:1]), greedy, use_tqdm=False)[0].outputs[0]
    toks, text = list(reference.token_ids), reference.text
    stop_text = text[len(text) // 2 : len(text) // 2 + 3]
    cases = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (5, 7, 11, 14)] + [
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop_token_ids=[toks[9]]),
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop_text]),
        SamplingParams(
            temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop_text], include_stop_str_in_output=True
        ),
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop_token_ids=[toks[2]], min_tokens=12),
    ]
    prompts = token_prompts(REPEATING[:1] * len(cases))
    before = _accepted(spec)
    expected = base.generate(prompts, cases, use_tqdm=False)
    got = spec.generate(prompts, cases, use_tqdm=False)
    for e, g, p in zip(expected, got, cases):
        assert g.outputs[0].text == e.outputs[0].text, p
        assert g.outputs[0].finish_reason == e.outputs[0].finish_reason, p
        if not p.stop:  # a stop string may land mid-step: the text is cut there, as vLLM's detokenizer does
            assert g.outputs[0].token_ids == e.outputs[0].token_ids, p
    assert _accepted(spec) > before


def test_penalized_requests_are_drafted_and_keep_their_outputs(base: LLM, spec: LLM) -> None:
    """Penalties at each verified position count the drafts accepted before it (they would be outputs by then):
    penalised requests get drafts, some are accepted, and the tokens and logprobs are plain decoding's."""
    cases = [
        SamplingParams(temperature=0.0, max_tokens=24, repetition_penalty=1.3, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=24, frequency_penalty=0.4, presence_penalty=0.3, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=24, frequency_penalty=-0.5, logprobs=2),  # favours repeats
    ]
    prompts = token_prompts([REPEATING[0]] * 3)
    before = _accepted(spec)
    expected = base.generate(prompts, cases, use_tqdm=False)
    got = spec.generate(prompts, cases, use_tqdm=False)
    assert_same_outputs(expected, got, logprobs=True)
    assert _accepted(spec) > before


def test_grammar_requests_are_drafted_and_keep_their_constraint(base: LLM, spec: LLM) -> None:
    """A constrained request is verified with one grammar row per position (its matcher advanced through the
    drafts, then rolled back); drafts are accepted, outputs equal plain decoding's, beside unconstrained rows."""
    constrained = SamplingParams(
        temperature=0.0, max_tokens=24, structured_outputs=StructuredOutputsParams(regex="(ab|cd)+e")
    )
    json_like = SamplingParams(
        temperature=0.0,
        max_tokens=32,
        structured_outputs=StructuredOutputsParams(regex="\\[(1|22|333)(,(1|22|333))*\\]"),
    )
    plain = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    prompts = token_prompts(REPEATING[:2] + [RANDOM[0], REPEATING[1]])
    params = [plain, plain, constrained, json_like]
    sched = _scheduler(spec)
    constrained_drafts = []
    original = sched.spec.rollback
    sched.spec.rollback = lambda req, n, m: (
        constrained_drafts.append(m - 1) if req.structured_output_request is not None else None,
        original(req, n, m),
    )
    try:
        expected = base.generate(prompts, params, use_tqdm=False)
        got = spec.generate(prompts, params, use_tqdm=False)
    finally:
        del sched.spec.rollback
    assert_same_outputs(expected, got)
    assert sum(constrained_drafts) > 0, "no draft of a constrained request was accepted"


# ---------------------------------------------------------------------------------------------- sampling
def test_sampled_token_frequencies_match_plain_decoding(base: LLM, spec: LLM) -> None:
    """Chi-square homogeneity test at significance 1e-3: the 3rd and 4th sampled tokens of many seeded runs
    with speculation (seeds 0..N-1) against as many without it (seeds N..2N-1, independent draws). The N requests
    run as one batch (the `spec` engine drafts at every step: this tests the rejection sampler)."""
    n = 300
    prompt = token_prompts([REPEATING[1]])
    with_spec = [SamplingParams(temperature=0.8, top_k=4, max_tokens=4, seed=s, ignore_eos=True) for s in range(n)]
    without = [SamplingParams(temperature=0.8, top_k=4, max_tokens=4, seed=n + s, ignore_eos=True) for s in range(n)]
    before = _accepted(spec)
    got = spec.generate(prompt * n, with_spec, use_tqdm=False)
    expected = base.generate(prompt * n, without, use_tqdm=False)
    assert _accepted(spec) > before, "no sampled draft was accepted: the test would not exercise verification"
    for position in (2, 3):
        pvalue = chi_square_homogeneity_pvalue(token_counts(got, position), token_counts(expected, position))
        assert pvalue > SIGNIFICANCE, f"position {position}: p = {pvalue}"


def test_seeded_requests_replay_exactly_after_preemption(spec: LLM, spec_small_kv: LLM) -> None:
    """A seeded row draws once per emitted token even when several land in one step, so a preempted request
    resumes its random stream where its kept outputs left it."""
    params = [SamplingParams(temperature=0.8, top_k=4, max_tokens=40, seed=s, ignore_eos=True) for s in (1, 2, 3, 4)]
    prompts = token_prompts(REPEATING + RANDOM[:1])
    alone = [spec.generate(p, sp, use_tqdm=False)[0] for p, sp in zip(prompts, params)]
    crowded = spec_small_kv.generate(prompts, params, use_tqdm=False)
    assert_same_outputs(alone, crowded)


# ---------------------------------------------------------------------------------------------- metrics and log
def _stats() -> SpecDecodingStats:
    stats = SpecDecodingStats.new(3)
    stats.observe_batch([3, 3, 2], [3, 1, 0])
    return stats


def test_metrics_carry_vllm_spec_decode_series() -> None:
    wire = msgspec.msgpack.encode(SchedulerStats(spec_decoding_stats=_stats()))
    stats = msgspec.msgpack.decode(wire, type=SchedulerStats)  # as the core sends it to a frontend
    metrics = ServerMetrics("m")
    metrics.record(stats, None)
    metrics.record(stats, None)
    text = metrics.render().decode()
    for line in (
        'vllm:spec_decode_num_drafts_total{model_name="m"} 6.0',
        'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 16.0',
        'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 8.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 4.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 2.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="2"} 2.0',
    ):
        assert line in text


def test_engine_core_logs_a_spec_decoding_line(caplog) -> None:
    log = _StatsLogger(interval_s=0.0)
    outputs = {0: EngineCoreOutputs(scheduler_stats=SchedulerStats(spec_decoding_stats=_stats()))}
    with caplog.at_level(logging.INFO, logger="vllm_lite.engine_core"):
        log.record(12, outputs)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("SpecDecoding metrics:")]
    assert len(lines) == 1
    assert "mean_acceptance_length=2.33" in lines[0] and "accepted=4 drafted=8 drafts=3" in lines[0]
    assert "draft_acceptance_rate=50.0%" in lines[0] and "per_position_acceptance_rate=[0.667,0.333,0.333]" in lines[0]


# ---------------------------------------------------------------------------------------------- configuration
@pytest.mark.parametrize(
    ("value", "field"),
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "max"),
        ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, "lookahead"),
        ({"model": "/some/draft", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, "prompt_lookup_max"),
        ("[1, 2]", "JSON object"),
        ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 1}, "disable_by_batch_size"),
        ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": True}, "disable_by_batch_size"),
        ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": "4"}, "disable_by_batch_size"),
    ],
)
def test_speculative_config_refuses_bad_values_naming_the_field(value, field) -> None:
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.from_value(value)


def test_speculative_config_from_cli_json_and_defaults() -> None:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}'])
    config = EngineArgs.from_cli_args(args).speculative_config
    assert config == SpeculativeConfig(
        method="ngram", num_speculative_tokens=4, prompt_lookup_min=5, prompt_lookup_max=5
    )
    assert SpeculativeConfig.from_value({"model": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}) == (
        SpeculativeConfig(method="ngram", num_speculative_tokens=2, prompt_lookup_min=3, prompt_lookup_max=3)
    )
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative-config", '{"method": "ngram"}'])


def test_draft_model_of_another_vocabulary_is_refused_naming_the_field(tmp_path) -> None:
    target = get_checkpoint("llama")
    with open(os.path.join(target, "config.json")) as f:
        config = json.load(f)
    (tmp_path / "config.json").write_text(json.dumps(dict(config, vocab_size=config["vocab_size"] + 8)))

    def create(draft: str) -> None:
        EngineArgs(
            model=target, speculative_config={"model": draft, "num_speculative_tokens": 2}
        ).create_engine_config()

    with pytest.raises(ValueError, match="speculative_config.model: the draft's vocab_size"):
        create(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(config))
    with open(os.path.join(target, "tokenizer.json")) as f:
        tok = json.load(f)
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab)[:2]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # same size, two ids swapped
    (tmp_path / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match="speculative_config.model: .* different tokenizer"):
        create(str(tmp_path))
    with pytest.raises(ValueError, match="speculative_config.model"):
        create(str(tmp_path / "missing"))
