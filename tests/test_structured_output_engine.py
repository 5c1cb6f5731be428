"""Structured outputs through the engine: valid outputs on a random-weight checkpoint (which emits garbage
unless the mask works), per-request compile errors, grammars compiling off the step loop, and matchers that
stay in sync across preemption by recompute."""

from __future__ import annotations

import json
import re
import threading
from typing import Any

import jsonschema
import pytest

from vllm_lite import LLM, SamplingParams
from vllm_lite.core.engine_core import EngineCore
from vllm_lite.core.messages import FinishReason
from vllm_lite.core.request import RequestStatus
from vllm_lite.sampling_params import StructuredOutputsParams
from vllm_lite.structured_output.manager import load_tokenizer
from vllm_lite.testing.checkpoints import get_checkpoint
from vllm_lite.testing.core_harness import (
    Result,
    assert_no_leak,
    drain,
    make_request,
    tiny_engine_core,
    unique_id,
)
from vllm_lite.testing.hf_match import record_preemptions

CHOICES = ["yes", "no", "maybe so"]
REGEX = r"[a-z]{3}-[0-9]{2}"
SCHEMA = {
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "tag": {"enum": ["x", "y"]},
        "ok": {"type": "boolean"},
    },
    "required": ["n", "tag", "ok"],
    "additionalProperties": False,
}
EBNF = 'root ::= num op num\nnum ::= [1-9] [0-9]?\nop ::= "+" | "-" | "*"'
LARK = 'start: NUM OP NUM\nNUM: /[1-9][0-9]?/\nOP: "+" | "-" | "*"'
ARITH = re.compile(r"[1-9][0-9]?[-+*][1-9][0-9]?")
PROMPT = "The for statement"


def constraints() -> list[tuple[StructuredOutputsParams, Any]]:
    """(constraint, check of the output text) pairs. Under backend auto the EBNF grammar runs on xgrammar and
    the Lark one, which xgrammar refuses, on guidance: one engine exercises both backends."""
    return [
        (StructuredOutputsParams(choice=CHOICES), lambda t: t in CHOICES),
        (StructuredOutputsParams(regex=REGEX), lambda t: re.fullmatch(REGEX, t)),
        (StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True), valid_json),
        (StructuredOutputsParams(grammar=EBNF), lambda t: ARITH.fullmatch(t)),
        (StructuredOutputsParams(grammar=LARK), lambda t: ARITH.fullmatch(t)),
    ]


def valid_json(text: str) -> bool:
    jsonschema.validate(json.loads(text), SCHEMA)
    return True


@pytest.fixture(scope="module")
def llm() -> Any:
    with LLM(model=get_checkpoint("llama"), dtype="float32", multiprocess=False, max_model_len=256) as engine:
        yield engine


def test_constrained_outputs_are_valid_beside_a_free_request(llm: LLM) -> None:
    cases = constraints()
    params = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=120, structured_outputs=so)
        for i, (so, _) in enumerate(cases)
    ]
    params.append(SamplingParams(temperature=1.0, seed=99, max_tokens=8, ignore_eos=True))
    outs = llm.generate([PROMPT] * len(params), params, use_tqdm=False)
    for (so, check), out in zip(cases, outs):
        text = out.outputs[0].text
        assert out.error is None and out.outputs[0].finish_reason == "stop", (so, out)
        assert check(text), (so, text)
    free = outs[-1].outputs[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 8


def test_a_bad_constraint_is_a_value_error_in_the_python_api(llm: LLM) -> None:
    with pytest.raises(ValueError, match=r"invalid structured_outputs\.regex.*Unclosed"):
        llm.generate([PROMPT], SamplingParams(structured_outputs=StructuredOutputsParams(regex="[a-")))
    out = llm.generate([PROMPT], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3  # the engine serves on


def test_constraints_and_the_bitmask_cross_the_wire_typed() -> None:
    """What the multiprocess core and the TP ranks decode: the constraint inside SamplingParams, the bitmask."""
    import numpy as np

    from vllm_lite.core.messages import EngineCoreRequest
    from vllm_lite.serialization import MsgpackDecoder, MsgpackEncoder
    from vllm_lite.worker.step import SchedulerOutput

    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    req = make_request("r", [1, 2], SamplingParams(structured_outputs=so))
    back = MsgpackDecoder(EngineCoreRequest).decode(MsgpackEncoder().encode(req))
    assert back.sampling_params.structured_outputs == so
    step = SchedulerOutput.empty()
    step.structured_output_request_ids = {"r": 0}
    step.grammar_bitmask = np.array([[-1, 5]], dtype=np.int32)
    decoded = MsgpackDecoder(SchedulerOutput).decode(MsgpackEncoder().encode(step))
    assert decoded.structured_output_request_ids == {"r": 0}
    assert np.array_equal(np.asarray(decoded.grammar_bitmask), step.grammar_bitmask)


# ---------------------------------------------------------------------------- the core, driven step by step
@pytest.fixture(scope="module")
def core() -> Any:
    engine = tiny_engine_core(enable_prefix_caching=False)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(get_checkpoint("llama"))


def constrained(so: StructuredOutputsParams, max_tokens: int = 40, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=so, **kw)


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"regex": "[a-"}, "Unclosed"),
        ({"json": '{"type": "nope"}'}, "nope"),
        ({"grammar": "root ::= undefined_rule"}, "undefined_rule"),
    ],
)
def test_a_compile_error_fails_that_request_alone(core: EngineCore, bad: dict, message: str) -> None:
    """Sent straight to the core (no frontend check): an ERROR output with the compiler's message."""
    bad_id, free_id = unique_id("bad"), unique_id("free")
    core.add_request(make_request(bad_id, [5, 6, 7], constrained(StructuredOutputsParams(**bad))))
    core.add_request(make_request(free_id, [5, 6, 7, 8]))
    results: dict[str, Result] = {}
    drain(core, results)
    assert results[bad_id].finish_reason == FinishReason.ERROR and not results[bad_id].token_ids
    assert results[bad_id].error is not None and message in results[bad_id].error
    assert results[free_id].finish_reason == FinishReason.LENGTH and len(results[free_id].token_ids) == 4
    assert_no_leak(core)


def test_a_compiling_grammar_does_not_hold_the_batch_up(
    core: EngineCore, tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    manager = core.scheduler.structured_output_manager
    gate = threading.Event()
    original = manager._prepare

    def held(spec: Any) -> Any:
        gate.wait(120)
        return original(spec)

    monkeypatch.setattr(manager, "_prepare", held)
    so_id, free_id = unique_id("so"), unique_id("free")
    core.add_request(make_request(so_id, [5, 6, 7], constrained(StructuredOutputsParams(regex=REGEX)), eos_token_id=2))
    core.add_request(make_request(free_id, [5, 6, 7, 8]))
    results: dict[str, Result] = {}
    try:
        while results.get(free_id, Result()).finish_reason is None:
            for outs in core.step().values():
                for out in outs.outputs:
                    res = results.setdefault(out.request_id, Result())
                    res.token_ids.extend(out.new_token_ids)
                    res.finish_reason = out.finish_reason
            assert core.scheduler.get_request(so_id).status == RequestStatus.WAITING_FOR_FSM
    finally:
        gate.set()
    drain(core, results)
    assert re.fullmatch(REGEX, tokenizer.decode(results[so_id].token_ids, skip_special_tokens=True))
    assert results[so_id].finish_reason == FinishReason.STOP
    assert_no_leak(core)


def test_an_abort_while_compiling_frees_everything(core: EngineCore) -> None:
    rid = unique_id("so")
    core.add_request(make_request(rid, [5, 6], constrained(StructuredOutputsParams(regex="[0-9]{5}"))))
    core.abort_requests([rid])
    drain(core, {})
    assert_no_leak(core)


def _run_all(core: EngineCore, params: list[SamplingParams], prompts: list[list[int]]) -> list[list[int]]:
    ids = [unique_id("p") for _ in params]
    for rid, p, prompt in zip(ids, params, prompts):
        core.add_request(make_request(rid, prompt, p, eos_token_id=2))
    results: dict[str, Result] = {}
    drain(core, results)
    assert all(results[r].error is None for r in ids), [results[r].error for r in ids]
    return [results[r].token_ids for r in ids]


def test_preemption_by_recompute_keeps_each_matcher_in_sync(tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy constrained requests give the same tokens whether or not they were preempted and recomputed."""
    long_regex = r"[a-z]{12}-[0-9]{6}"
    params = [constrained(StructuredOutputsParams(regex=long_regex), max_tokens=60) for _ in range(6)]
    prompts = [tokenizer.encode(f"{PROMPT} {i}", add_special_tokens=False) for i in range(6)]
    block_size = 4
    kw = {"block_size": block_size, "enable_prefix_caching": False, "max_num_batched_tokens": 32}
    roomy = tiny_engine_core(**kw)
    try:
        reference = _run_all(roomy, params, prompts)
        per_block = roomy.executor.worker.model_runner.kv_cache_bytes_per_block()
    finally:
        roomy.shutdown()
    # Sized from the reference run, so the premise holds whatever tokens this device's float rounding picks:
    # the largest request fits alone, but all six (admitted together: short prompts, max_num_seqs 16) need
    # twice the cache before any of them can finish.
    needs = [-(-(len(p) + len(out)) // block_size) for p, out in zip(prompts, reference)]
    num_blocks = max(max(needs) + 1, -(-sum(needs) // 2))
    assert num_blocks < sum(needs) - max(needs), f"outputs too short to squeeze: {needs}"
    preempted = record_preemptions(monkeypatch)
    squeezed_core = tiny_engine_core(
        kv_cache_memory_bytes=per_block * num_blocks, max_model_len=block_size * (max(needs) + 1), **kw
    )
    try:
        squeezed = _run_all(squeezed_core, params, prompts)
        assert_no_leak(squeezed_core)
    finally:
        squeezed_core.shutdown()
    assert preempted, "the small KV cache was meant to force preemption"
    assert squeezed == reference
    for tokens in squeezed:
        assert re.fullmatch(long_regex, tokenizer.decode(tokens, skip_special_tokens=True))


# ---------------------------------------------------------------------------- random sampling under a grammar
def tool_call_schemas() -> list[dict[str, Any]]:
    """tool_choice="required" schemas as the OpenAI server builds them (anyOf over two tools; one flat tool)."""
    from vllm_lite.entrypoints.openai.protocol import ChatCompletionToolsParam
    from vllm_lite.entrypoints.openai.tool_choice import required_schema
    from vllm_lite.testing.json_schemas import JSON_SCHEMAS

    weather = {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1, "maximum": 3}},
        "required": ["city", "days"],
        "additionalProperties": False,
    }
    flat = next(c.spec for c in JSON_SCHEMAS if c.name == "flat_required")

    def tools(**params: Any) -> list[ChatCompletionToolsParam]:
        return [
            ChatCompletionToolsParam.model_validate({"type": "function", "function": {"name": n, "parameters": p}})
            for n, p in params.items()
        ]

    return [required_schema(tools(get_weather=weather, flat_required=flat)), required_schema(tools(flat_required=flat))]


def test_seeded_random_sampling_keeps_every_tool_call_output_valid(llm: LLM) -> None:
    """Many random draws (one seed each, batched) through the bitmask and matcher: no token the grammar refuses."""
    schemas = tool_call_schemas()
    params = [
        SamplingParams(
            temperature=1.0,
            seed=seed,
            max_tokens=120,
            structured_outputs=StructuredOutputsParams(json=schema, disable_any_whitespace=True),
        )
        for schema in schemas
        for seed in range(40)
    ]
    outs = llm.generate([PROMPT] * len(params), params, use_tqdm=False)
    for i, out in enumerate(outs):
        schema = schemas[i // 40]
        assert out.error is None, (i, out.error)
        if out.outputs[0].finish_reason == "stop":
            jsonschema.validate(json.loads(out.outputs[0].text), schema)
    # An array of >= 1 calls may run to max_tokens on a random model; most finish (and each one that does parses).
    assert sum(o.outputs[0].finish_reason == "stop" for o in outs) >= len(outs) // 4


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_past_a_complete_grammar_ends_on_its_eos(llm: LLM, temperature: float) -> None:
    """A complete grammar allows only EOS, which min_tokens bans: the grammar wins (before, every logit was -inf
    and the sampled token 0 failed the request)."""
    so = StructuredOutputsParams(choice=CHOICES)
    sp = SamplingParams(temperature=temperature, seed=3, max_tokens=30, min_tokens=20, structured_outputs=so)
    free = SamplingParams(temperature=temperature, seed=4, max_tokens=4, min_tokens=4, allowed_token_ids=[7, 8])
    out, beside = llm.generate([PROMPT, PROMPT], [sp, free], use_tqdm=False)
    assert out.error is None and out.outputs[0].finish_reason == "stop", out
    assert out.outputs[0].text in CHOICES
    assert set(beside.outputs[0].token_ids) <= {7, 8}  # an unconstrained row's masks stay as they were


def _collect(step_outputs: dict[int, Any], results: dict[str, Result]) -> None:
    for outs in step_outputs.values():
        for out in outs.outputs:
            res = results.setdefault(out.request_id, Result())
            res.token_ids.extend(out.new_token_ids)
            res.finish_reason, res.error = out.finish_reason, out.error


class _FailsWith:
    """The core's executor, except that every step (or recovery probe) holding request `bad_id` raises."""

    def __init__(self, inner: Any, bad_id: str) -> None:
        self.inner, self.bad_id, self.failures = inner, bad_id, 0

    def execute_model(self, so: Any) -> Any:
        if self.bad_id in so.num_scheduled_tokens:
            self.failures += 1
            raise RuntimeError("injected step failure")
        return self.inner.execute_model(so)

    def shutdown(self) -> None:
        self.inner.shutdown()


def test_a_step_replayed_after_a_failure_keeps_the_grammar_mask(core: EngineCore, tokenizer: Any) -> None:
    """Step recovery re-runs the good requests of a failed step: their tokens must still be drawn under their mask
    (before, the replay dropped the bitmask, and a constrained request beside the failing one got a token its
    grammar refuses)."""
    bad_id = unique_id("bad")
    good = [unique_id("so") for _ in range(4)]
    for i, rid in enumerate(good):
        sp = SamplingParams(
            temperature=1.0, seed=i, max_tokens=40, structured_outputs=StructuredOutputsParams(regex=REGEX)
        )
        core.add_request(make_request(rid, [5, 6, 7], sp, eos_token_id=2))
    results: dict[str, Result] = {}
    # Every grammar compiled before the first step, so the four are admitted together and none can finish (the
    # regex is 6 characters) while another still waits for its grammar, however slow the host is.
    sors = [core.scheduler.get_request(r).structured_output_request for r in good]
    while not all(s.is_ready() for s in sors):
        core.scheduler.wait_for_grammar(5.0)
    _collect(core.step(), results)
    assert all(core.scheduler.get_request(r).status == RequestStatus.RUNNING for r in good)
    core.add_request(make_request(bad_id, [5, 6, 7, 8], SamplingParams(max_tokens=30, ignore_eos=True)))
    inner = core.executor
    core.executor = _FailsWith(inner, bad_id)
    try:
        drain(core, results)
    finally:
        core.executor = inner
    assert core.executor is inner and results[bad_id].finish_reason == FinishReason.ERROR
    for rid in good:
        assert results[rid].error is None, results[rid].error
        assert re.fullmatch(REGEX, tokenizer.decode(results[rid].token_ids, skip_special_tokens=True))
    assert_no_leak(core)
