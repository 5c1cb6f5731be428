"""Hostile but well-formed requests against a real in-process EngineCore (issue 21).

The frontend's checks are bypassed: values are set on the request after
construction, as any client speaking the wire format could send them. Every
SamplingParams field (and every request field) is tried at and beyond its
limits, with token ids in and out of the vocabulary. An out-of-range request
must be refused with a ValueError that names the field; an in-range one must
run; a well-behaved request beside it must finish as usual; and afterwards no
KV block and no request may be left behind. Run with -s to see the counts.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_lite.core.engine_core import EngineCore
from vllm_lite.core.messages import EngineCoreRequest, FinishReason
from vllm_lite.sampling_params import SamplingParams
from vllm_lite.serialization import MsgpackDecoder, MsgpackEncoder
from vllm_lite.testing.core_harness import (
    TINY_MAX_MODEL_LEN,
    Result,
    assert_no_leak,
    drain,
    make_request,
    tiny_engine_core,
    unique_id,
)

L = TINY_MAX_MODEL_LEN
I64_MIN, I64_MAX = -(1 << 63), (1 << 63) - 1
F32_MAX = 3.4028234663852886e38
MAX_TOKENS = 3  # the hostile request's default, so that valid ones finish fast
BASE_PROMPT = [5, 6, 7, 8]
NOT_INTS = [1.5, "3", True, None, [1]]
NOT_FLOATS = ["1.0", True, None, [0.5]]
BAD_FLOATS = [math.nan, math.inf, -math.inf]

# Example counts sized for CI's time budget: every field's limits are also checked one by one, with exact
# boundary values, by tests/test_mutation_kills.py (validate_request; no surviving mutant), so the fuzz here
# is for what no table lists (mixes, odd types, the core surviving them); `both sides tried` still holds.
SETTINGS = settings(max_examples=100, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
PER_FIELD_SETTINGS = settings(SETTINGS, max_examples=12)


@pytest.fixture(scope="module")
def core() -> EngineCore:
    c = tiny_engine_core()
    yield c
    c.shutdown()


# ---------------------------------------------------------------------------- the spec: (value, valid) per field


def ok(s: st.SearchStrategy) -> st.SearchStrategy:
    return s.map(lambda v: (v, True))


def bad(s: st.SearchStrategy) -> st.SearchStrategy:
    return s.map(lambda v: (v, False))


def ints(lo: int, hi: int, optional: bool = False) -> st.SearchStrategy:
    """Integers in [lo, hi] (valid, edges included) and beyond them, or of another type (invalid)."""
    cases = [
        ok(st.integers(lo, hi)),
        ok(st.sampled_from([lo, hi])),
        bad(st.sampled_from([lo - 1, hi + 1])),
        bad(st.integers(max_value=lo - 1)),
        bad(st.integers(min_value=hi + 1)),
        bad(st.sampled_from([v for v in NOT_INTS if not (optional and v is None)])),
    ]
    if optional:
        cases.append(ok(st.just(None)))
    return st.one_of(cases)


def floats(lo: float, hi: float, low_open: bool = False) -> st.SearchStrategy:
    """Finite floats in the range (valid), just outside it, non-finite or not numbers (invalid)."""
    edges = [hi] if low_open else [lo, hi]
    below = [lo] if low_open else [math.nextafter(lo, -math.inf)]
    return st.one_of(
        ok(st.floats(lo, hi, exclude_min=low_open, allow_nan=False)),
        ok(st.sampled_from(edges)),
        bad(st.sampled_from(below + [math.nextafter(hi, math.inf), hi * 2 + 1.0])),
        bad(st.floats(max_value=lo, exclude_max=not low_open, allow_nan=False)),
        bad(st.sampled_from(BAD_FLOATS + NOT_FLOATS)),
    )


def token_ids(max_len: int, vocab: int, min_len: int = 0) -> st.SearchStrategy:
    """Lists of ids; valid iff every id is in [0, vocab) and min_len <= length <= max_len."""
    in_vocab = st.integers(0, vocab - 1)
    anywhere = st.one_of(in_vocab, st.integers(-3, -1), st.integers(vocab, vocab + 3), st.integers(I64_MAX, 1 << 64))
    return st.one_of(
        ok(st.lists(in_vocab, min_size=min_len, max_size=min(max_len, 12))),
        st.lists(anywhere, min_size=min_len, max_size=12).map(
            lambda ids: (ids, all(0 <= t < vocab for t in ids) and len(ids) <= max_len)
        ),
        bad(st.just([0] * (max_len + 1))),
        bad(st.sampled_from(NOT_INTS[:3]).map(lambda t: [0, t])),
    )


def strings(max_count: int, max_chars: int) -> st.SearchStrategy:
    text = st.text(min_size=1, max_size=8)
    return st.one_of(
        ok(st.lists(text, max_size=4)),
        ok(st.just(["x" * max_chars])),
        bad(st.just(["x" * (max_chars + 1)])),
        bad(st.just([""])),
        bad(st.just(["s"] * (max_count + 1))),
        bad(st.just([b"bytes"])),
    )


def logit_bias(vocab: int) -> st.SearchStrategy:
    keys = st.one_of(st.integers(0, vocab - 1), st.integers(vocab, vocab + 100), st.integers(-5, -1))
    values = st.one_of(st.floats(-100, 100), st.floats(-1e6, 1e6, allow_nan=False), st.sampled_from(BAD_FLOATS))
    return st.one_of(
        ok(st.dictionaries(st.integers(0, vocab - 1), st.floats(-100, 100), max_size=6)),
        ok(st.just({vocab - 1: 100.0, 0: -100.0})),
        st.dictionaries(keys, values, max_size=6).map(
            lambda d: (d, all(0 <= k < vocab and -100 <= v <= 100 for k, v in d.items()))
        ),
        bad(st.just({"7": 1.0})),
    )


def bad_words_ids(vocab: int) -> st.SearchStrategy:
    seq = st.lists(st.integers(0, vocab - 1), min_size=1, max_size=3)
    return st.one_of(
        ok(st.lists(seq, max_size=4)),
        bad(st.just([[]])),
        bad(st.just([[vocab]])),
        bad(st.just([[0, -1]])),
        bad(st.just([[0]] * 2049)),
        bad(st.just([[0] * (L + 1)])),
    )


def field_cases(vocab: int) -> dict[str, tuple[str, st.SearchStrategy]]:
    """Field -> (the name a refusal must mention, strategy of (value, valid)); one field per example."""
    return {
        "prompt_token_ids": ("prompt_token_ids", token_ids(L - 1, vocab, min_len=1) | bad(st.just([]))),
        "eos_token_id": ("eos_token_id", ints(0, vocab - 1, optional=True)),
        "priority": ("priority", ints(I64_MIN, I64_MAX)),
        "client_index": ("client_index", ints(0, I64_MAX)),
        "arrival_time": (
            "arrival_time",
            st.one_of(
                ok(st.floats(allow_nan=False, allow_infinity=False)),
                ok(st.integers(-10, 10)),
                bad(st.sampled_from(BAD_FLOATS + NOT_FLOATS)),
            ),
        ),
        "cache_salt": (
            "cache_salt",
            st.one_of(
                ok(st.none()),
                ok(st.text(max_size=20)),
                ok(st.just("s" * 1024)),
                bad(st.just("s" * 1025)),
                bad(st.just(b"salt")),
                bad(st.just(7)),
            ),
        ),
        "request_id": (
            "request_id",
            st.one_of(
                ok(st.integers(1, 1000)),
                bad(st.just(1025)),
                bad(st.just(0)),
            ),
        ),
        "n": ("n", ints(1, 128)),
        "best_of": ("best_of", ints(1, 128, optional=True)),
        "temperature": ("temperature", floats(0.0, F32_MAX)),
        "top_p": ("top_p", floats(0.0, 1.0, low_open=True)),
        "top_k": ("top_k", ints(-1, I64_MAX)),
        "min_p": ("min_p", floats(0.0, 1.0)),
        "presence_penalty": ("presence_penalty", floats(-2.0, 2.0)),
        "frequency_penalty": ("frequency_penalty", floats(-2.0, 2.0)),
        "repetition_penalty": ("repetition_penalty", floats(0.0, F32_MAX, low_open=True)),
        "seed": ("seed", ints(I64_MIN, (1 << 64) - 1, optional=True)),
        "max_tokens": ("max_tokens", ints(1, I64_MAX, optional=True)),
        "min_tokens": ("min_tokens", ints(0, MAX_TOKENS)),
        "logprobs": ("logprobs", ints(0, 20, optional=True)),
        "prompt_logprobs": ("prompt_logprobs", ints(0, 20, optional=True)),
        "stop": ("stop", strings(128, 1024)),
        "stop_token_ids": ("stop_token_ids", token_ids(1024, vocab)),
        "_all_stop_token_ids": ("all_stop_token_ids", token_ids(1024, vocab)),
        "allowed_token_ids": ("allowed_token_ids", token_ids(vocab, vocab, min_len=1) | bad(st.just([]))),
        "logit_bias": ("logit_bias", logit_bias(vocab)),
        "bad_words": ("bad_words", strings(1024, 1024)),
        "_bad_words_token_ids": ("bad_words_token_ids", bad_words_ids(vocab)),
    }


_REQUEST_FIELDS = {"prompt_token_ids", "eos_token_id", "priority", "client_index", "arrival_time", "cache_salt"}


def hostile_request(field: str, value: Any) -> EngineCoreRequest:
    """A random-sampled (seeded) request with `field` set to `value` behind every frontend check."""
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=MAX_TOKENS, ignore_eos=True)
    rid = unique_id("hostile")
    if field == "request_id":  # the value is a length; the id stays unique
        rid = (rid + "-" + "x" * value)[:value] if value else ""
    req = make_request(rid, BASE_PROMPT, params)
    if field in _REQUEST_FIELDS:
        setattr(req, field, value)
    elif field != "request_id":
        setattr(params, field, value)
    return req


def serve_beside(core: EngineCore, hostile: EngineCoreRequest, field_names: set[str], tried: Counter) -> bool:
    """Send a good request and `hostile` together; check both outcomes and the leak; True if hostile ran."""
    good_id = unique_id("good")
    core.add_request(make_request(good_id, [9, 10, 11]))
    accepted = True
    try:
        core.add_request(hostile)
    except ValueError as e:
        accepted = False
        assert any(name in str(e) for name in field_names), f"refusal does not name {field_names}: {e}"
    results: dict[str, Result] = {}
    drain(core, results)
    assert results[good_id].token_ids and len(results[good_id].token_ids) == 4
    assert results[good_id].finish_reason == FinishReason.LENGTH
    if accepted:
        res = results[hostile.request_id]
        assert res.finish_reason in (FinishReason.STOP, FinishReason.LENGTH), (res, hostile)
        assert res.error is None
        tried["ran"] += 1
    else:
        assert hostile.request_id not in results or results[hostile.request_id].token_ids == []
        tried["refused"] += 1
    assert_no_leak(core)
    return accepted


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _report(name: str, tried: Counter, per_field: Counter) -> None:
    print(f"\n[{name}] examples={sum(per_field.values())} ran={tried['ran']} refused={tried['refused']}")
    for key, count in sorted(per_field.items()):
        print(f"  {key}: {count}")


# ---------------------------------------------------------------------------- tests


FIELDS = sorted(field_cases(2))  # the names only; the core's vocabulary sizes the values


@pytest.mark.parametrize("field", FIELDS)
def test_each_field_at_and_beyond_its_limit_is_refused_by_name_or_runs(core: EngineCore, field: str) -> None:
    name, values = field_cases(core.request_limits.vocab_size)[field]
    tried: Counter = Counter()
    per_case: Counter = Counter()

    @PER_FIELD_SETTINGS
    @given(case=values)
    def check(case: tuple[Any, bool]) -> None:
        value, valid = case
        ran = serve_beside(core, hostile_request(field, value), {name}, tried)
        per_case["valid" if valid else "invalid"] += 1
        assert ran == valid, f"{field}={_short(value)}: expected {'run' if valid else 'refusal'}"

    check()
    _report(f"field {field}", tried, per_case)
    assert tried["ran"] and tried["refused"], "both sides of the limit must have been tried"


def test_many_hostile_fields_at_once_never_break_the_core(core: EngineCore) -> None:
    """No oracle here: whatever mix of values, the answer is a named refusal or a clean run."""
    cases = field_cases(core.request_limits.vocab_size)
    tried: Counter = Counter()
    per_field: Counter = Counter()
    fields = st.lists(st.sampled_from(sorted(cases)), min_size=2, max_size=6, unique=True)
    draw = fields.flatmap(lambda fs: st.tuples(*(st.tuples(st.just(f), cases[f][1]) for f in fs)))

    @SETTINGS
    @given(mix=draw)
    def check(mix: tuple[tuple[str, tuple[Any, bool]], ...]) -> None:
        req = hostile_request("n", 1)
        for field, (value, _) in mix:
            if field == "request_id":
                continue
            target = req if field in _REQUEST_FIELDS else req.sampling_params
            setattr(target, field, value)
        serve_beside(core, req, {cases[f][0] for f, _ in mix} | {"min_tokens"}, tried)
        per_field[len(mix)] += 1

    check()
    _report("several fields per request (key: fields mutated)", tried, per_field)


@pytest.mark.parametrize(
    "field,value",
    [
        ("logit_bias", {5000: 1.0}),
        ("allowed_token_ids", [1, 99999]),
        ("_bad_words_token_ids", [[3, 2000]]),
        ("stop_token_ids", [2000]),
        ("_all_stop_token_ids", [1 << 40]),
    ],
)
def test_out_of_vocab_ids_sent_over_the_wire_are_refused_before_any_step(
    core: EngineCore, field: str, value: Any
) -> None:
    """The issue's crash: ids the frontend never checked, decoded by the core like any ADD."""
    params = SamplingParams(temperature=0.0, max_tokens=2)
    setattr(params, field, value)
    frames = MsgpackEncoder().encode(make_request(unique_id("wire"), BASE_PROMPT, params))
    decoded = MsgpackDecoder(EngineCoreRequest).decode(frames)
    assert isinstance(decoded, EngineCoreRequest)
    with pytest.raises(ValueError, match=field.lstrip("_")):
        core.add_request(decoded)
    assert_no_leak(core)


def test_priority_beyond_64_bits_is_refused_by_name(core: EngineCore) -> None:
    """priority=10**30 cannot be encoded on the wire (OverflowError); in process the core refuses it."""
    with pytest.raises(OverflowError):
        msgspec.msgpack.encode(10**30)
    with pytest.raises(ValueError, match="priority"):
        core.add_request(make_request(unique_id("prio"), BASE_PROMPT, priority=10**30))
    assert_no_leak(core)


def test_valid_values_at_every_limit_together_run(core: EngineCore) -> None:
    """The edges are inside: a request using every limit at once runs to its end."""
    vocab = core.request_limits.vocab_size
    params = SamplingParams(temperature=1.0, seed=(1 << 64) - 1, max_tokens=MAX_TOKENS, ignore_eos=True)
    edges: dict[str, Any] = dict(
        n=128,
        best_of=128,
        top_p=1.0,
        top_k=I64_MAX,
        min_p=1.0,
        presence_penalty=-2.0,
        frequency_penalty=2.0,
        repetition_penalty=F32_MAX,
        min_tokens=MAX_TOKENS,
        logprobs=20,
        prompt_logprobs=20,
        stop=["s"] * 128,
        stop_token_ids=[vocab - 1] * 1024,
        allowed_token_ids=list(range(vocab)),
        logit_bias={0: -100.0, vocab - 1: 100.0},
        _bad_words_token_ids=[[vocab - 1]] * 2048,
    )
    for name, value in edges.items():
        setattr(params, name, value)
    req = make_request(unique_id("edges"), [vocab - 1] * (L - 1), params, priority=I64_MIN, cache_salt="s" * 1024)
    core.add_request(req)
    results: dict[str, Result] = {}
    drain(core, results)
    res = results[req.request_id]
    assert res.finish_reason == FinishReason.LENGTH and res.error is None and len(res.token_ids) == 1
    assert_no_leak(core)
