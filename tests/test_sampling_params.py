"""SamplingParams: every bad value is refused with its field and value named; good ones normalize as vLLM does."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from vllm_lite.sampling_params import SamplingParams, SamplingType

# (field, value, extra kwargs): each must raise ValueError naming field and value.
OUT_OF_RANGE: list[tuple[str, Any, dict[str, Any]]] = [
    ("n", 0, {}),
    ("n", -2, {}),
    ("best_of", 1, {"n": 2}),
    ("presence_penalty", 2.5, {}),
    ("presence_penalty", -2.01, {}),
    ("frequency_penalty", 3.0, {}),
    ("frequency_penalty", -7.0, {}),
    ("repetition_penalty", 0.0, {}),
    ("repetition_penalty", -1.0, {}),
    ("temperature", -0.1, {}),
    ("top_p", 0.0, {}),
    ("top_p", 1.5, {}),
    ("top_k", -2, {}),
    ("min_p", -0.1, {}),
    ("min_p", 1.1, {}),
    ("max_tokens", 0, {}),
    ("max_tokens", -5, {}),
    ("min_tokens", -1, {}),
    ("min_tokens", 10, {"max_tokens": 4}),
    ("logprobs", -1, {}),
    ("prompt_logprobs", -3, {}),
    ("seed", 2**64, {}),
    ("seed", -(2**63) - 1, {}),
    ("stop_token_ids", [1, -4], {}),
    ("allowed_token_ids", [], {}),
    ("allowed_token_ids", [3, -1], {}),
    ("logit_bias", {5: 100.5}, {}),
    ("logit_bias", {5: -101}, {}),
    ("logit_bias", {-1: 1.0}, {}),
    ("stop", [""], {}),
    ("stop", ["end"], {"detokenize": False}),
    ("bad_words", [""], {}),
    ("bad_words_token_ids", [[]], {}),
    ("bad_words_token_ids", [[1, -2]], {}),
]

NON_FINITE = ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"]


def _kw(field: str) -> str:
    return "_bad_words_token_ids" if field == "bad_words_token_ids" else field


@pytest.mark.parametrize(("field", "value", "extra"), OUT_OF_RANGE, ids=[f"{f}={v!r}" for f, v, _ in OUT_OF_RANGE])
def test_out_of_range_or_contradictory_value_raises_value_error_naming_field_and_value(
    field: str, value: Any, extra: dict[str, Any]
) -> None:
    with pytest.raises(ValueError) as e:
        SamplingParams(**{_kw(field): value}, **extra)
    msg = str(e.value)
    assert field in msg and repr(value) in msg, msg


@pytest.mark.parametrize("field", NON_FINITE)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_numbers_raise_value_error(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", "0.5"),
        ("top_p", None),
        ("top_k", 2.5),
        ("n", True),
        ("seed", 1.0),
        ("max_tokens", "8"),
        ("stop_token_ids", 5),
        ("allowed_token_ids", (1, 2)),
        ("logit_bias", [(1, 2.0)]),
    ],
)
def test_wrong_types_raise_type_error_naming_field(field: str, value: Any) -> None:
    with pytest.raises(TypeError, match=field):
        SamplingParams(**{field: value})


def test_logit_bias_out_of_vocab_is_refused_by_verify_vocab() -> None:
    SamplingParams(logit_bias={9: 1.0}).verify_vocab(10)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={10: 1.0}).verify_vocab(10)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[3, 12]).verify_vocab(10)
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[10]).verify_vocab(10)


def test_greedy_resets_truncation_and_reports_its_sampling_type() -> None:
    p = SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2)
    assert (p.top_p, p.top_k, p.min_p) == (1.0, 0, 0.0)
    assert p.sampling_type == SamplingType.GREEDY
    assert SamplingParams(temperature=0.5).sampling_type == SamplingType.RANDOM
    assert SamplingParams(temperature=0.5, seed=3).sampling_type == SamplingType.RANDOM_SEED


def test_normalizes_stop_logprobs_and_string_bias_keys() -> None:
    p = SamplingParams(stop="###", logprobs=True, prompt_logprobs=False, logit_bias={"42": -5})
    assert p.stop == ["###"] and p.logprobs == 1 and p.prompt_logprobs is None
    assert p.logit_bias == {42: -5}
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={"forty": 1.0})


def test_tiny_temperature_stays_random_without_overflow() -> None:
    p = SamplingParams(temperature=1e-9)
    assert p.temperature == pytest.approx(1e-5) and p.sampling_type == SamplingType.RANDOM


def test_wire_round_trip_keeps_frontend_fields_and_validates_on_decode() -> None:
    p = SamplingParams(temperature=0.7, seed=9, _bad_words_token_ids=[[1, 2]], _all_stop_token_ids=[7])
    q = msgspec.msgpack.decode(msgspec.msgpack.encode(p), type=SamplingParams)
    assert q.bad_words_token_ids == [[1, 2]] and q.all_stop_token_ids == [7] and q.seed == 9
    bad = msgspec.msgpack.encode({"temperature": -1.0})
    with pytest.raises(msgspec.ValidationError, match="temperature"):
        msgspec.msgpack.decode(bad, type=SamplingParams)


def test_valid_edge_values_are_accepted() -> None:
    SamplingParams(presence_penalty=-2.0, frequency_penalty=2.0, top_p=1.0, top_k=-1, min_p=1.0, seed=-(2**63))
    SamplingParams(seed=2**64 - 1, logprobs=0, min_tokens=4, max_tokens=4, logit_bias={0: -100, 1: 100.0})
    SamplingParams(max_tokens=None, min_tokens=1000)
