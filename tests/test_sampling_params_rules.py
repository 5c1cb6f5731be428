"""SamplingParams' rules at their edges: every bound accepted on the bound and refused just past it, every type
check against its near-misses (bools, floats, tuples), the normalisations vLLM does, the structured-output
constraint's own rules, and BeamSearchParams. tests/test_sampling_params.py has the broad cases."""

from __future__ import annotations

import re
from typing import Any

import msgspec
import pytest

from vllm_lite.sampling_params import (
    STRUCTURED_OUTPUT_KINDS,
    BeamSearchParams,
    RequestOutputKind,
    SamplingParams,
    SamplingType,
    StructuredOutputsParams,
)

EPS = 1e-5  # the smallest temperature that still samples


def refused(exc: type, says: str, **kw: Any) -> str:
    with pytest.raises(exc) as e:
        SamplingParams(**kw)
    assert says in str(e.value), str(e.value)
    return str(e.value)


# ---------------------------------------------------------------------------- bounds: on the bound, and past it

ACCEPTED_ON_THE_BOUND: list[dict[str, Any]] = [
    dict(n=1),
    dict(n=2, best_of=2),
    dict(presence_penalty=2.0),
    dict(presence_penalty=-2.0),
    dict(frequency_penalty=2.0),
    dict(frequency_penalty=-2.0),
    dict(repetition_penalty=1e-9),
    dict(temperature=0.0),
    dict(top_p=1.0),
    dict(top_p=1e-9),
    dict(top_k=-1),
    dict(top_k=0),
    dict(top_k=1),
    dict(min_p=0.0),
    dict(min_p=1.0),
    dict(max_tokens=1),
    dict(min_tokens=0),
    dict(min_tokens=3, max_tokens=3),
    dict(logprobs=0, prompt_logprobs=0),
    dict(seed=-(2**63)),
    dict(seed=2**64 - 1),
    dict(stop_token_ids=[0]),
    dict(allowed_token_ids=[0]),
    dict(logit_bias={0: -100.0, 1: 100}),
    dict(best_of=1, temperature=0.0),
    dict(bad_words=["x"]),
    dict(_bad_words_token_ids=[[0]], _all_stop_token_ids=[0]),
]


@pytest.mark.parametrize("kw", ACCEPTED_ON_THE_BOUND, ids=[repr(k) for k in ACCEPTED_ON_THE_BOUND])
def test_each_bound_itself_is_accepted(kw):
    p = SamplingParams(**kw)
    for k, v in kw.items():
        if p.temperature >= EPS or k not in ("top_p", "top_k", "min_p"):
            assert getattr(p, k) == v, k


# (kwargs, the field named, the reason's words)
REFUSED_PAST_THE_BOUND: list[tuple[dict[str, Any], str, str]] = [
    (dict(n=0), "n", "must be an integer >= 1"),
    (dict(n=3, best_of=2), "best_of", "must be >= n (3)"),
    (dict(presence_penalty=2.0001), "presence_penalty", "must be in [-2, 2]"),
    (dict(presence_penalty=-2.0001), "presence_penalty", "must be in [-2, 2]"),
    (dict(frequency_penalty=2.0001), "frequency_penalty", "must be in [-2, 2]"),
    (dict(frequency_penalty=-2.0001), "frequency_penalty", "must be in [-2, 2]"),
    (dict(repetition_penalty=0.0), "repetition_penalty", "must be > 0"),
    (dict(temperature=-1e-9), "temperature", "must be non-negative"),
    (dict(top_p=0.0), "top_p", "must be in (0, 1]"),
    (dict(top_p=1.0001), "top_p", "must be in (0, 1]"),
    (dict(top_k=-2), "top_k", "must be -1 or 0 (disable), or at least 1"),
    (dict(min_p=-1e-9), "min_p", "must be in [0, 1]"),
    (dict(min_p=1.0001), "min_p", "must be in [0, 1]"),
    (dict(max_tokens=0), "max_tokens", "must be at least 1"),
    (dict(min_tokens=-1), "min_tokens", "must be greater than or equal to 0"),
    (dict(min_tokens=4, max_tokens=3), "min_tokens", "must be less than or equal to max_tokens=3"),
    (dict(logprobs=-1), "logprobs", "must be non-negative"),
    (dict(prompt_logprobs=-1), "prompt_logprobs", "must be non-negative"),
    (dict(seed=-(2**63) - 1), "seed", "must be in [-2**63, 2**64)"),
    (dict(seed=2**64), "seed", "must be in [-2**63, 2**64)"),
    (dict(stop=["ok", ""]), "stop", "must contain only non-empty strings"),
    (dict(stop=["ok", 5]), "stop", "must contain only non-empty strings"),
    (dict(stop=["x"], detokenize=False), "stop", "requires detokenize=True"),
    (dict(stop_token_ids=[1, -1]), "stop_token_ids", "must contain only non-negative integers"),
    (dict(stop_token_ids=[1, "2"]), "stop_token_ids", "must contain only non-negative integers"),
    (dict(logit_bias={-1: 1.0}), "logit_bias", "keys must be non-negative token ids"),
    (dict(logit_bias={True: 1.0}), "logit_bias", "keys must be non-negative token ids"),
    (dict(logit_bias={1.5: 1.0}), "logit_bias", "keys must be non-negative token ids"),
    (dict(logit_bias={"-5": 1.0}), "logit_bias", "keys must be non-negative token ids"),
    (dict(logit_bias={"4.2": 1.0}), "logit_bias", "keys must be non-negative token ids"),
    (dict(logit_bias={"X1": 1.0}), "logit_bias", "keys must be non-negative token ids"),
    (dict(logit_bias={3: 100.001}), "logit_bias", "values must be numbers in [-100, 100]"),
    (dict(logit_bias={3: -100.001}), "logit_bias", "values must be numbers in [-100, 100]"),
    (dict(logit_bias={3: True}), "logit_bias", "values must be numbers in [-100, 100]"),
    (dict(logit_bias={3: "1"}), "logit_bias", "values must be numbers in [-100, 100]"),
    (dict(allowed_token_ids=[]), "allowed_token_ids", "must not be empty"),
    (dict(allowed_token_ids=[1, -1]), "allowed_token_ids", "must contain non-negative token ids"),
    (dict(allowed_token_ids=[1, 2.0]), "allowed_token_ids", "must contain non-negative token ids"),
    (dict(bad_words=["ok", ""]), "bad_words", "must contain only non-empty strings"),
    (dict(bad_words=["ok", 3]), "bad_words", "must contain only non-empty strings"),
    (dict(_bad_words_token_ids=[[1], []]), "bad_words_token_ids", "must be non-empty lists of non-negative token ids"),
    (dict(_bad_words_token_ids=[(1, 2)]), "bad_words_token_ids", "must be non-empty lists of non-negative token ids"),
    (dict(_bad_words_token_ids=[[1, -1]]), "bad_words_token_ids", "must be non-empty lists of non-negative token ids"),
    (dict(_bad_words_token_ids=[[1, True]]), "bad_words_token_ids", "must be non-empty lists of non-negative"),
    (dict(_bad_words_token_ids=[[1, 2.0]]), "bad_words_token_ids", "must be non-empty lists of non-negative"),
    (dict(_all_stop_token_ids=[1, -1]), "all_stop_token_ids", "must contain only non-negative integers"),
    (dict(_all_stop_token_ids=[1, True]), "all_stop_token_ids", "must contain only non-negative integers"),
    (dict(_all_stop_token_ids=[1, 2.0]), "all_stop_token_ids", "must contain only non-negative integers"),
    (dict(n=1, best_of=2, temperature=0.0), "best_of", "must be 1 when using greedy sampling"),
    (dict(n=1, best_of=2, temperature=EPS / 2 - EPS / 2), "best_of", "must be 1 when using greedy sampling"),
]


@pytest.mark.parametrize(
    "kw, field, why", REFUSED_PAST_THE_BOUND, ids=[f"{f}:{k!r}" for k, f, _ in REFUSED_PAST_THE_BOUND]
)
def test_just_past_each_bound_is_refused_naming_the_field_the_reason_and_the_value(kw, field, why):
    msg = refused(ValueError, why, **kw)
    assert msg.startswith(f"{field} {why}"), msg
    value = kw.get(field, kw.get(f"_{field}"))
    if field == "logit_bias":  # shown with JSON-string keys already read as ids
        assert msg.endswith("}."), msg
    else:
        assert msg.endswith(f", got {value!r}."), msg


def test_best_of_sampling_randomly_at_the_smallest_temperature_is_accepted():
    assert SamplingParams(n=1, best_of=2, temperature=EPS).num_samples == 2


# ---------------------------------------------------------------------------- types


@pytest.mark.parametrize(
    "field", ["presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "min_p"]
)
@pytest.mark.parametrize("value", [True, "0.5", None, [0.5]])
def test_float_fields_take_numbers_but_not_bools_or_strings(field, value):
    assert refused(TypeError, f"{field} must be a number, got {value!r}.", **{field: value})
    SamplingParams(**{field: 1})  # an int is a number


@pytest.mark.parametrize("field", ["n", "top_k", "min_tokens"])
@pytest.mark.parametrize("value", [True, 1.0, "1", None])
def test_integer_fields_refuse_bools_floats_and_none(field, value):
    refused(TypeError, f"{field} must be an integer, got {value!r}.", **{field: value})


# logprobs=True is the flag's form of one (normalised, below), so only the other fields refuse True.
OPTIONAL_INT_MISSES = [
    (f, v)
    for f in ("best_of", "seed", "max_tokens", "logprobs", "prompt_logprobs")
    for v in (True, 2.0, "2")
    if not (v is True and f.endswith("logprobs"))
]


@pytest.mark.parametrize("field, value", OPTIONAL_INT_MISSES)
def test_optional_integer_fields_refuse_bools_floats_and_strings(field, value):
    refused(TypeError, f"{field} must be an integer or None, got {value!r}.", **{field: value})


@pytest.mark.parametrize("field", ["stop_token_ids", "allowed_token_ids", "bad_words", "stop"])
def test_list_fields_refuse_tuples(field):
    refused(TypeError, f"{field} must be a list, got ('a',).", **{field: ("a",)})


def test_structured_outputs_must_be_the_struct_and_logit_bias_a_dict():
    refused(TypeError, "structured_outputs must be a StructuredOutputsParams, got dict.", structured_outputs={})
    refused(TypeError, "logit_bias must be a dict of token id -> bias, got [1].", logit_bias=[1])


def test_non_finite_numbers_are_a_value_error_naming_the_field():
    refused(ValueError, "top_p must be finite, got nan.", top_p=float("nan"))


# ---------------------------------------------------------------------------- normalisations


def test_defaults_are_vllms():
    p = SamplingParams()
    assert (p.n, p.best_of, p.temperature, p.top_p, p.top_k, p.min_p) == (1, None, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.prompt_logprobs, p.seed) == (16, 0, None, None, None)
    assert (p.stop, p.stop_token_ids, p.bad_words, p.logit_bias, p.allowed_token_ids) == ([], [], [], None, None)
    assert p.detokenize and p.skip_special_tokens and p.spaces_between_special_tokens
    assert not p.ignore_eos and not p.include_stop_str_in_output
    assert p.output_kind == RequestOutputKind.CUMULATIVE and p.structured_outputs is None
    assert p.all_stop_token_ids == [] and p.bad_words_token_ids == [] and p.num_samples == 1


def test_logprobs_flags_become_counts_either_way():
    p = SamplingParams(logprobs=False, prompt_logprobs=True)
    assert p.logprobs is None and p.prompt_logprobs == 1
    p = SamplingParams(logprobs=True, prompt_logprobs=False)
    assert p.logprobs == 1 and p.prompt_logprobs is None
    assert SamplingParams(logprobs=3).logprobs == 3


def test_json_string_token_ids_become_ints_and_other_keys_are_left_to_validation():
    assert SamplingParams(logit_bias={" 12 ": 1.0, 7: -1}).logit_bias == {12: 1.0, 7: -1}
    # A negative id in JSON's string form is read as the number it is, then refused as negative.
    refused(ValueError, "logit_bias keys must be non-negative token ids, got {-5: 1.0}.", logit_bias={"-5": 1.0})
    refused(ValueError, "logit_bias keys must be non-negative token ids, got {'5-': 1.0}.", logit_bias={"5-": 1.0})


def test_temperatures_below_the_smallest_are_raised_to_it_and_zero_stays_greedy():
    assert SamplingParams(temperature=EPS / 10).temperature == EPS
    assert SamplingParams(temperature=EPS).temperature == EPS
    p = SamplingParams(temperature=0.0, top_p=0.5, top_k=4, min_p=0.5)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.sampling_type) == (0.0, 1.0, 0, 0.0, SamplingType.GREEDY)


def test_the_smallest_sampling_temperature_keeps_its_truncations_and_samples():
    p = SamplingParams(temperature=EPS, top_p=0.5, top_k=4, min_p=0.5)
    assert (p.top_p, p.top_k, p.min_p, p.sampling_type) == (0.5, 4, 0.5, SamplingType.RANDOM)
    assert SamplingParams(temperature=EPS, seed=0).sampling_type == SamplingType.RANDOM_SEED


def test_all_stop_token_ids_start_as_the_users_and_derived_lists_are_copies():
    p = SamplingParams(stop_token_ids=[4, 5])
    assert p.all_stop_token_ids == [4, 5]
    p.all_stop_token_ids.append(9)
    assert p.all_stop_token_ids == [4, 5] and p.stop_token_ids == [4, 5]
    q = SamplingParams(stop_token_ids=[4], _all_stop_token_ids=[4, 8], _bad_words_token_ids=[[1, 2]])
    assert q.all_stop_token_ids == [4, 8]
    q.bad_words_token_ids.append([3])
    assert q.bad_words_token_ids == [[1, 2]]


def test_num_samples_is_best_of_when_set():
    assert SamplingParams(n=2).num_samples == 2
    assert SamplingParams(n=2, best_of=5).num_samples == 5


def test_clone_is_an_equal_independent_copy():
    p = SamplingParams(n=2, temperature=0.5, stop=["x"], _all_stop_token_ids=[3])
    q = p.clone()
    assert q is not p and q == p
    q.max_tokens = 99
    assert p.max_tokens == 16


def test_repr_shows_public_fields_only():
    text = repr(SamplingParams(n=2, _all_stop_token_ids=[3]))
    assert text.startswith("SamplingParams(n=2, best_of=None, ") and text.endswith(")")
    assert "temperature=1.0" in text and "stop=[]" in text and "_all_stop" not in text


def test_decoding_from_the_wire_runs_the_same_checks():
    good = msgspec.msgpack.encode(SamplingParams(n=2, logit_bias={5: 1.0}))
    assert msgspec.msgpack.decode(good, type=SamplingParams).logit_bias == {5: 1.0}
    with pytest.raises(msgspec.ValidationError, match="top_k"):
        msgspec.msgpack.decode(msgspec.msgpack.encode({"top_k": -3}), type=SamplingParams)


def test_verify_vocab_accepts_the_last_id_and_refuses_the_first_past_it():
    SamplingParams(stop_token_ids=[9], allowed_token_ids=[9], logit_bias={9: 1.0}).verify_vocab(10)
    with pytest.raises(ValueError) as e:
        SamplingParams(stop_token_ids=[10]).verify_vocab(10)
    assert str(e.value) == "stop_token_ids contains a token id out of vocabulary (size 10), got [10]."
    with pytest.raises(ValueError, match="^" + re.escape("logit_bias contains a token id out of vocabulary (size 10)")):
        SamplingParams(logit_bias={10: 1.0}).verify_vocab(10)
    SamplingParams().verify_vocab(1)


# ---------------------------------------------------------------------------- structured outputs


@pytest.mark.parametrize(
    "kw, kind",
    [
        (dict(json={"type": "object"}), "json"),
        (dict(json='{"type": "object"}'), "json"),
        (dict(regex="a+"), "regex"),
        (dict(choice=["a", "b"]), "choice"),
        (dict(grammar="root ::= 'a'"), "grammar"),
        (dict(json_object=True), "json_object"),
        (dict(structural_tag="{}"), "structural_tag"),
        (dict(regex="a", json_object=False), "regex"),
        (dict(regex="a", whitespace_pattern=r"\s*", disable_fallback=True), "regex"),
    ],
)
def test_exactly_one_constraint_names_its_kind(kw, kind):
    assert StructuredOutputsParams(**kw).kind == kind


def test_constraint_kinds_are_vllms():
    assert STRUCTURED_OUTPUT_KINDS == ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


def test_two_constraints_are_refused_naming_both():
    with pytest.raises(ValueError) as e:
        StructuredOutputsParams(regex="a", choice=["b"], json_object=False)
    assert str(e.value) == "structured_outputs: only one kind of constraint may be set, got regex, choice."


@pytest.mark.parametrize("kw", [{}, {"json_object": False}, {"whitespace_pattern": "x"}])
def test_no_constraint_is_refused_listing_the_kinds(kw):
    with pytest.raises(ValueError) as e:
        StructuredOutputsParams(**kw)
    assert str(e.value) == (
        "structured_outputs: one constraint must be set (json, regex, choice, grammar, json_object or structural_tag)."
    )


@pytest.mark.parametrize(
    "kw, says",
    [
        (dict(json=5), "structured_outputs.json must be a JSON schema object or string, got 5."),
        (dict(json=["a"]), "structured_outputs.json must be a JSON schema object or string, got ['a']."),
        (dict(regex=5), "structured_outputs.regex must be a string, got 5."),
        (dict(grammar=b"g"), "structured_outputs.grammar must be a string, got b'g'."),
        (dict(structural_tag=1), "structured_outputs.structural_tag must be a string, got 1."),
        (dict(regex="a", whitespace_pattern=3), "structured_outputs.whitespace_pattern must be a string, got 3."),
        (dict(choice="ab"), "structured_outputs.choice must be a list of strings, got 'ab'."),
        (dict(choice=["a", 1]), "structured_outputs.choice must be a list of strings, got ['a', 1]."),
    ],
)
def test_a_constraint_of_the_wrong_type_is_a_type_error_naming_it(kw, says):
    with pytest.raises(TypeError) as e:
        StructuredOutputsParams(**kw)
    assert str(e.value) == says


def test_an_empty_choice_is_refused():
    with pytest.raises(ValueError) as e:
        StructuredOutputsParams(choice=[])
    assert str(e.value) == "structured_outputs.choice must not be empty."


# ---------------------------------------------------------------------------- beam search


def test_beam_search_needs_one_beam_and_one_token_at_least():
    p = BeamSearchParams(beam_width=1, max_tokens=1)
    assert (p.ignore_eos, p.temperature, p.length_penalty, p.include_stop_str_in_output) == (False, 0.0, 1.0, False)
    with pytest.raises(ValueError, match="^" + re.escape("beam_width must be at least 1, got 0.") + "$"):
        BeamSearchParams(beam_width=0, max_tokens=1)
    with pytest.raises(ValueError, match="^" + re.escape("max_tokens must be at least 1, got 0.") + "$"):
        BeamSearchParams(beam_width=1, max_tokens=0)
