"""Unit tests written to kill mutants that survived the rest of the unit suite (docs/MUTATION.md).

Each test names the behaviour it pins; the mutants it was written against are listed in the note.
"""

from __future__ import annotations

from typing import Any

import pytest

from vllm_lite.client.detokenizer import (
    SlowIncrementalDetokenizer,
    _prompt_tail_for_context,
    _rust_backend,
    find_stop_string,
    stop_prefix_holdback,
)
from vllm_lite.core.messages import EngineCoreRequest
from vllm_lite.core.request import Request
from vllm_lite.core.request_validation import RequestLimits, validate_request
from vllm_lite.core.sched.request_queue import (
    FCFSRequestQueue,
    PriorityRequestQueue,
    create_request_queue,
)
from vllm_lite.sampling_params import SamplingParams


def _req(rid: str, *, priority: int = 0, arrival: float = 0.0) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(max_tokens=4), None, arrival, priority=priority)


# ------------------------------------------------------------------------------------------ request queues
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_empty_queue_is_falsy_and_refuses_peek_and_pop(policy: str):
    q = create_request_queue(policy)
    assert not q and len(q) == 0 and list(q) == []
    with pytest.raises(IndexError) as peeked:
        q.peek()
    assert str(peeked.value) == "peek from an empty request queue"
    with pytest.raises(IndexError) as popped:
        q.pop()
    assert str(popped.value) == "pop from an empty request queue"
    q.add(_req("a"))
    assert q and len(q) == 1


def test_create_request_queue_picks_the_policy_and_rejects_others():
    assert type(create_request_queue("fcfs")) is FCFSRequestQueue
    assert type(create_request_queue("priority")) is PriorityRequestQueue
    with pytest.raises(ValueError, match=r"scheduling policy must be 'fcfs' or 'priority', got 'lifo'\."):
        create_request_queue("lifo")


def test_fcfs_serves_arrivals_in_order_and_preempted_requests_first():
    q = FCFSRequestQueue()
    a, b, c = _req("a"), _req("b"), _req("c")
    q.add(a)
    q.add(b)
    q.prepend(c)
    assert list(q) == [c, a, b] and q.peek() is c and len(q) == 3
    assert q.pop() is c and q.pop() is a and list(q) == [b]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_remove_requests_drops_exactly_the_given_ones(policy: str):
    q = create_request_queue(policy)
    reqs = [_req(str(i), arrival=float(i)) for i in range(4)]
    for r in reqs:
        q.add(r)
    q.remove_requests([])
    assert list(q) == reqs
    q.remove_requests(iter([reqs[2], reqs[0]]))
    assert list(q) == [reqs[1], reqs[3]] and len(q) == 2
    assert q.pop() is reqs[1] and q.pop() is reqs[3]


def test_priority_orders_by_priority_then_arrival_then_insertion():
    q = PriorityRequestQueue()
    late_urgent = _req("late_urgent", priority=-1, arrival=9.0)
    early = _req("early", priority=0, arrival=1.0)
    # Equal priority and arrival: insertion order decides, never the heap's layout.
    ties = [_req(f"tie{i}", priority=0, arrival=5.0) for i in range(6)]
    low = _req("low", priority=3, arrival=0.0)
    for r in [low, *reversed(ties[3:]), early, *ties[:3], late_urgent]:
        q.add(r)
    expected = [late_urgent, early, *reversed(ties[3:]), *ties[:3], low]
    assert list(q) == expected
    assert q.peek() is late_urgent
    assert [q.pop() for _ in range(len(expected))] == expected


def test_priority_prepend_reenters_by_key_ahead_of_later_arrivals():
    q = PriorityRequestQueue()
    first, later = _req("first", arrival=1.0), _req("later", arrival=2.0)
    q.add(later)
    q.prepend(first)  # preempted: it arrived earlier, so it goes ahead
    assert list(q) == [first, later] and q.pop() is first


# ------------------------------------------------------------------------------------------ request validation
_LIMITS = RequestLimits(
    vocab_size=10,
    max_model_len=8,
    max_logprobs=2,
    max_n=3,
    max_best_of=4,
    max_stop_strings=2,
    max_stop_string_chars=3,
    max_stop_token_ids=2,
    max_bad_words=2,
    max_bad_word_chars=3,
    max_bad_words_token_ids=2,
    max_cache_salt_chars=3,
    max_request_id_chars=4,
    min_priority=-5,
    max_priority=5,
)
_I64 = (1 << 63) - 1
_F32 = 3.4028234663852886e38


def _core_request(**changes: Any) -> EngineCoreRequest:
    """A request this core accepts, with `changes` applied after construction (`p_<field>` on its params)."""
    params = SamplingParams(max_tokens=4)
    request = EngineCoreRequest("r", [1, 2, 3], params, None, 0.0)
    for key, value in changes.items():
        if key.startswith("p_"):
            setattr(params, key[2:], value)
        else:
            setattr(request, key, value)
    return request


def test_request_limits_default_to_vllm_and_openai_caps():
    assert RequestLimits(vocab_size=10, max_model_len=8) == RequestLimits(
        10, 8, 20, 128, 128, 128, 1024, 1024, 1024, 1024, 2048, 1024, 1024, -(1 << 63), _I64
    )


_REJECTED = [
    # request fields (the first two are not wrapped: the id is what the wrapper names)
    ({"request_id": ""}, "request_id must be a non-empty str, got ''."),
    ({"request_id": 5}, "request_id must be a non-empty str, got 5."),
    ({"request_id": "abcde"}, "request_id must be at most 4 characters, got 5."),
    ({"prompt_token_ids": []}, "request 'r': prompt_token_ids must not be empty."),
    ({"prompt_token_ids": "abc"}, "request 'r': prompt_token_ids must be a list, got str."),
    (
        {"prompt_token_ids": [1] * 8},
        "request 'r': prompt_token_ids has 8 tokens, which leaves no room to generate in max_model_len=8.",
    ),
    ({"prompt_token_ids": [1, 10]}, "request 'r': prompt_token_ids holds token id 10, out of vocabulary (size 10)."),
    ({"prompt_token_ids": [10, -1]}, "request 'r': prompt_token_ids holds token id -1, out of vocabulary (size 10)."),
    ({"prompt_token_ids": [1, 2.0]}, "request 'r': prompt_token_ids must hold token ids (int), got 2.0."),
    ({"prompt_token_ids": [True]}, "request 'r': prompt_token_ids must hold token ids (int), got True."),
    ({"eos_token_id": 10}, "request 'r': eos_token_id holds token id 10, out of vocabulary (size 10)."),
    ({"eos_token_id": -1}, "request 'r': eos_token_id holds token id -1, out of vocabulary (size 10)."),
    ({"eos_token_id": True}, "request 'r': eos_token_id must be a token id (int), got True."),
    ({"priority": -6}, "request 'r': priority must be in [-5, 5], got -6."),
    ({"priority": 6}, "request 'r': priority must be in [-5, 5], got 6."),
    ({"priority": True}, "request 'r': priority must be an integer, got True."),
    ({"priority": 1.0}, "request 'r': priority must be an integer, got 1.0."),
    ({"client_index": -1}, f"request 'r': client_index must be in [0, {_I64}], got -1."),
    ({"client_index": _I64 + 1}, f"request 'r': client_index must be in [0, {_I64}], got {_I64 + 1}."),
    ({"arrival_time": float("inf")}, "request 'r': arrival_time must be finite, got inf."),
    ({"arrival_time": float("nan")}, "request 'r': arrival_time must be finite, got nan."),
    ({"arrival_time": "x"}, "request 'r': arrival_time must be a number, got 'x'."),
    ({"arrival_time": True}, "request 'r': arrival_time must be a number, got True."),
    ({"cache_salt": 5}, "request 'r': cache_salt must be a str or None, got int."),
    ({"cache_salt": "abcd"}, "request 'r': cache_salt must be at most 3 characters, got 4."),
    ({"sampling_params": {"n": 1}}, "request 'r': sampling_params must be a SamplingParams, got dict."),
    ({"prompt_token_ids": None}, "request 'r': prompt_token_ids must be a list, got NoneType."),
    ({"prompt_token_ids": [0, 10]}, "request 'r': prompt_token_ids holds token id 10, out of vocabulary (size 10)."),
    # sampling params
    ({"p_n": 0}, "request 'r': n must be in [1, 3], got 0."),
    ({"p_n": 4}, "request 'r': n must be in [1, 3], got 4."),
    ({"p_n": 2, "p_best_of": 1}, "request 'r': best_of must be in [2, 4], got 1."),
    ({"p_best_of": 5}, "request 'r': best_of must be in [1, 4], got 5."),
    ({"p_temperature": -0.1}, f"request 'r': temperature must be in [0.0, {_F32}], got -0.1."),
    ({"p_temperature": 3.5e38}, f"request 'r': temperature must be in [0.0, {_F32}], got 3.5e+38."),
    ({"p_temperature": float("inf")}, "request 'r': temperature must be finite, got inf."),
    ({"p_top_p": 0.0}, "request 'r': top_p must be in (0.0, 1.0], got 0.0."),
    ({"p_top_p": 1.01}, "request 'r': top_p must be in (0.0, 1.0], got 1.01."),
    ({"p_min_p": -0.01}, "request 'r': min_p must be in [0.0, 1.0], got -0.01."),
    ({"p_min_p": 1.01}, "request 'r': min_p must be in [0.0, 1.0], got 1.01."),
    ({"p_top_k": -2}, f"request 'r': top_k must be in [-1, {_I64}], got -2."),
    ({"p_top_k": _I64 + 1}, f"request 'r': top_k must be in [-1, {_I64}], got {_I64 + 1}."),
    ({"p_presence_penalty": -2.01}, "request 'r': presence_penalty must be in [-2.0, 2.0], got -2.01."),
    ({"p_presence_penalty": 2.01}, "request 'r': presence_penalty must be in [-2.0, 2.0], got 2.01."),
    ({"p_frequency_penalty": -2.01}, "request 'r': frequency_penalty must be in [-2.0, 2.0], got -2.01."),
    ({"p_frequency_penalty": 2.01}, "request 'r': frequency_penalty must be in [-2.0, 2.0], got 2.01."),
    ({"p_repetition_penalty": 0.0}, f"request 'r': repetition_penalty must be in (0.0, {_F32}], got 0.0."),
    ({"p_repetition_penalty": 4e38}, f"request 'r': repetition_penalty must be in (0.0, {_F32}], got 4e+38."),
    (
        {"p_seed": -(1 << 63) - 1},
        f"request 'r': seed must be in [{-(1 << 63)}, {(1 << 64) - 1}], got {-(1 << 63) - 1}.",
    ),
    ({"p_seed": 1 << 64}, f"request 'r': seed must be in [{-(1 << 63)}, {(1 << 64) - 1}], got {1 << 64}."),
    ({"p_max_tokens": 0}, f"request 'r': max_tokens must be in [1, {_I64}], got 0."),
    ({"p_max_tokens": _I64 + 1}, f"request 'r': max_tokens must be in [1, {_I64}], got {_I64 + 1}."),
    ({"p_min_tokens": -1}, "request 'r': min_tokens must be in [0, 8], got -1."),
    ({"p_max_tokens": None, "p_min_tokens": 9}, "request 'r': min_tokens must be in [0, 8], got 9."),
    ({"p_max_tokens": 2, "p_min_tokens": 3}, "request 'r': min_tokens must be at most max_tokens=2, got 3."),
    ({"p_logprobs": -1}, "request 'r': logprobs must be in [0, 2], got -1."),
    ({"p_logprobs": 3}, "request 'r': logprobs must be in [0, 2], got 3."),
    ({"p_prompt_logprobs": 3}, "request 'r': prompt_logprobs must be in [0, 2], got 3."),
    ({"p_stop": "abcd"}, "request 'r': stop must hold non-empty strings of at most 3 characters, got 'abcd'."),
    ({"p_stop": ["a", ""]}, "request 'r': stop must hold non-empty strings of at most 3 characters, got ''."),
    ({"p_stop": [5]}, "request 'r': stop must hold non-empty strings of at most 3 characters, got 5."),
    ({"p_stop": ["a", "b", "c"]}, "request 'r': stop must have at most 2 entries, got 3."),
    ({"p_stop": ("a",)}, "request 'r': stop must be a list, got tuple."),
    (
        {"p_stop": ["x" * 100]},
        "request 'r': stop must hold non-empty strings of at most 3 characters, got '" + "x" * 76 + "....",
    ),
    ({"p_stop_token_ids": [10]}, "request 'r': stop_token_ids holds token id 10, out of vocabulary (size 10)."),
    ({"p_stop_token_ids": [1, 2, 3]}, "request 'r': stop_token_ids must have at most 2 entries, got 3."),
    ({"p__all_stop_token_ids": [1, 2, 3]}, "request 'r': all_stop_token_ids must have at most 2 entries, got 3."),
    ({"p__bad_words_token_ids": [[1], None]}, "request 'r': bad_words_token_ids must be a list, got NoneType."),
    # A value's repr of exactly 80 characters is shown whole; longer ones are cut to 77 plus "...".
    (
        {"p_stop": ["x" * 78]},
        "request 'r': stop must hold non-empty strings of at most 3 characters, got '" + "x" * 78 + "'.",
    ),
    (
        {"p_stop": ["x" * 79]},
        "request 'r': stop must hold non-empty strings of at most 3 characters, got '" + "x" * 76 + "....",
    ),
    (
        {"p__all_stop_token_ids": [10]},
        "request 'r': all_stop_token_ids holds token id 10, out of vocabulary (size 10).",
    ),
    ({"p_allowed_token_ids": []}, "request 'r': allowed_token_ids must not be empty (nothing could be sampled)."),
    ({"p_allowed_token_ids": [10]}, "request 'r': allowed_token_ids holds token id 10, out of vocabulary (size 10)."),
    ({"p_allowed_token_ids": [1] * 11}, "request 'r': allowed_token_ids must have at most 10 entries, got 11."),
    ({"p_logit_bias": [1]}, "request 'r': logit_bias must be a dict of token id -> bias, got list."),
    (
        {"p_logit_bias": {i: 0.0 for i in range(11)}},
        "request 'r': logit_bias must have at most vocab_size=10 entries, got 11.",
    ),
    ({"p_logit_bias": {10: 1.0}}, "request 'r': logit_bias holds token id 10, out of vocabulary (size 10)."),
    ({"p_logit_bias": {1: 100.5}}, "request 'r': logit_bias must be in [-100.0, 100.0], got 100.5."),
    ({"p_logit_bias": {1: -100.5}}, "request 'r': logit_bias must be in [-100.0, 100.0], got -100.5."),
    (
        {"p_bad_words": ["abcd"]},
        "request 'r': bad_words must hold non-empty strings of at most 3 characters, got 'abcd'.",
    ),
    ({"p_bad_words": [""]}, "request 'r': bad_words must hold non-empty strings of at most 3 characters, got ''."),
    ({"p_bad_words": [7]}, "request 'r': bad_words must hold non-empty strings of at most 3 characters, got 7."),
    ({"p_bad_words": ["a", "b", "c"]}, "request 'r': bad_words must have at most 2 entries, got 3."),
    (
        {"p__bad_words_token_ids": [[1], [2], [3]]},
        "request 'r': bad_words_token_ids must have at most 2 entries, got 3.",
    ),
    ({"p__bad_words_token_ids": [[1], []]}, "request 'r': bad_words_token_ids must not hold an empty sequence."),
    (
        {"p__bad_words_token_ids": [[10]]},
        "request 'r': bad_words_token_ids holds token id 10, out of vocabulary (size 10).",
    ),
    ({"p__bad_words_token_ids": [[1] * 9]}, "request 'r': bad_words_token_ids must have at most 8 entries, got 9."),
]


@pytest.mark.parametrize(("changes", "message"), _REJECTED, ids=[str(c)[:60] for c, _ in _REJECTED])
def test_validate_request_rejects_with_a_message_naming_the_field(changes: dict, message: str):
    with pytest.raises(ValueError) as info:
        validate_request(_core_request(**changes), _LIMITS)
    assert str(info.value) == message


_ACCEPTED = [
    {},
    {"request_id": "abcd", "cache_salt": "abc", "prompt_token_ids": [0] * 6 + [9]},
    {"eos_token_id": 0, "priority": -5, "client_index": _I64, "arrival_time": 7},
    {"eos_token_id": 9, "priority": 5, "cache_salt": ""},
    {"p_n": 3, "p_best_of": 4, "p_temperature": 0.0, "p_top_p": 1.0, "p_min_p": 0.0, "p_top_k": -1},
    {"p_n": 2, "p_best_of": 2, "p_temperature": _F32, "p_top_p": 1e-9, "p_min_p": 1.0, "p_top_k": _I64},
    {"p_presence_penalty": -2.0, "p_frequency_penalty": 2.0, "p_repetition_penalty": _F32},
    {"p_presence_penalty": 2.0, "p_frequency_penalty": -2.0, "p_repetition_penalty": 1e-9},
    {"p_seed": -(1 << 63), "p_max_tokens": 1, "p_min_tokens": 1, "p_logprobs": 0, "p_prompt_logprobs": 2},
    {"p_seed": (1 << 64) - 1, "p_max_tokens": _I64, "p_min_tokens": 0, "p_logprobs": 2, "p_prompt_logprobs": 0},
    {"p_max_tokens": None, "p_min_tokens": 8},
    {"p_stop": "abc", "p_stop_token_ids": [0, 9], "p_allowed_token_ids": list(range(10))},
    {"p_stop": ["a", "abc"], "p_stop_token_ids": None, "p__all_stop_token_ids": None, "p_allowed_token_ids": [9]},
    {"p_logit_bias": {}, "p_bad_words": ["abc", "d"], "p__bad_words_token_ids": [[1] * 8, [9]]},
    {"p_logit_bias": {i: (-100.0 if i % 2 else 100.0) for i in range(10)}},
]


@pytest.mark.parametrize("changes", _ACCEPTED, ids=[str(c)[:60] for c in _ACCEPTED])
def test_validate_request_accepts_values_on_every_bound(changes: dict):
    validate_request(_core_request(**changes), _LIMITS)


# ------------------------------------------------------------------------------------------ detokenizer
def test_find_stop_string_edges():
    assert find_stop_string("stop", 4, ["stop"], False) == ("stop", 0)  # a match at the very start
    # "bc" ends before the one new character: already checked, not matched again.
    assert find_stop_string("abcd", 1, ["bc"], False) is None
    assert find_stop_string("abcd", 2, ["bc"], True) == ("bc", 3)
    # Two stop strings starting at the same place: the first listed wins.
    assert find_stop_string("xabc", 4, ["ab", "abc"], True) == ("ab", 3)
    assert find_stop_string("xabc", 4, ["abc", "ab"], True) == ("abc", 4)


def test_holdback_never_holds_a_whole_stop_string():
    assert stop_prefix_holdback("xab", ["ab"]) == 0
    assert stop_prefix_holdback("xa", ["ab"]) == 1


class _CleanDecode:
    """A tokenizer backend whose decode of `tail` is clean only for the lengths in `clean` (all when None)."""

    def __init__(self, clean: set[int] | None = None, fail: bool = False) -> None:
        self.clean, self.fail = clean, fail

    def decode(self, ids: list[int], *, skip_special_tokens: bool) -> str:
        if self.fail or skip_special_tokens is not False:  # the prompt tail keeps its special tokens as context
            raise ValueError("cannot decode")
        return "text" if self.clean is None or len(ids) in self.clean else "text\ufffd"


def test_prompt_tail_for_context_takes_the_shortest_clean_tail_of_4_to_24_tokens():
    prompt = list(range(100, 130))
    assert _prompt_tail_for_context(_CleanDecode(), prompt) == prompt[-4:]
    assert _prompt_tail_for_context(_CleanDecode({6}), prompt) == prompt[-6:]
    assert _prompt_tail_for_context(_CleanDecode({24}), prompt) == prompt[-24:]
    # No clean tail up to 24 tokens (25 is past the cap): the last 4, split character and all.
    assert _prompt_tail_for_context(_CleanDecode({25}), prompt) == prompt[-4:]
    assert _prompt_tail_for_context(_CleanDecode(set()), prompt) == prompt[-4:]
    assert _prompt_tail_for_context(_CleanDecode({6}), prompt[:6]) == prompt[:6]
    # Prompts of at most 4 tokens are used whole, without decoding; a decode error primes nothing.
    assert _prompt_tail_for_context(_CleanDecode(fail=True), prompt[:4]) == prompt[:4]
    assert _prompt_tail_for_context(_CleanDecode(fail=True), prompt[:5]) == []


def test_rust_backend_is_none_for_non_rust_tokenizers():
    class _WithOtherBackend:
        backend_tokenizer = "not a tokenizers.Tokenizer"

    assert _rust_backend(object()) is None
    assert _rust_backend(_WithOtherBackend()) is None


class _BareCharTokenizer:
    """One token per character (id = code point); ids past Unicode have no token and cannot be decoded."""

    def convert_ids_to_tokens(self, token_id: int) -> str | None:
        return chr(token_id) if token_id < 0x110000 else None

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return "".join(tokens)

    def decode(self, ids: list[int], *, skip_special_tokens: bool) -> str:
        if any(i >= 0x110000 for i in ids):
            raise ValueError("unknown id")
        return "".join(chr(i) for i in ids if not (skip_special_tokens and i == 0))


class _CharTokenizer(_BareCharTokenizer):
    all_special_ids = [0]
    added_tokens_decoder: dict[int, str] = {}


def _slow_detok(tokenizer: object, **params: Any) -> SlowIncrementalDetokenizer:
    request = EngineCoreRequest("r", [ord(c) for c in "prompt"], SamplingParams(**params), None, 0.0)
    return SlowIncrementalDetokenizer(tokenizer, request)


def test_slow_detokenizer_skips_special_ids_and_works_without_special_token_attributes():
    d = _slow_detok(_CharTokenizer())
    d.update([ord("a"), 0, ord("b")], False)
    assert d.get_next_output_text(finished=True, delta=False) == "ab"
    kept = _slow_detok(_CharTokenizer(), skip_special_tokens=False)
    kept.update([ord("a"), 0], False)
    assert kept.get_next_output_text(finished=True, delta=False) == "a\x00"
    bare = _slow_detok(_BareCharTokenizer())
    bare.update([ord("o"), ord("k")], False)
    assert bare.get_next_output_text(finished=True, delta=False) == "ok"


def test_slow_detokenizer_ids_without_tokens_give_no_text():
    d = _slow_detok(_CharTokenizer())
    d.update([ord("a"), 0x110000, ord("b")], False)
    assert d.output_text == "ab"
    assert d.decode_ids([0x110000]) == ""
    assert d.decode_ids([0, ord("c")]) == "c"


def test_stop_terminated_update_drops_only_the_last_ids_text():
    d = _slow_detok(_CharTokenizer())
    ids = [ord("a"), ord("b"), ord("!")]
    assert d.update(ids, True) is None
    assert d.token_ids == ids and d.output_text == "ab"


def test_stop_string_in_the_min_tokens_th_token_of_a_multi_token_update_is_ignored():
    d = _slow_detok(_CharTokenizer(), min_tokens=2, stop=["b"])
    assert d.update([ord("a"), ord("b"), ord("c")], False) is None
    assert d.output_text == "abc"


def test_text_kept_stop_strings_stream_their_prefix_at_once():
    d = _slow_detok(_CharTokenizer(), stop=["bc"], include_stop_str_in_output=True)
    d.update([ord("a"), ord("b")], False)
    assert d.get_next_output_text(finished=False, delta=True) == "ab"
    held = _slow_detok(_CharTokenizer(), stop=["bc"])
    held.update([ord("a"), ord("b")], False)
    assert held.get_next_output_text(finished=False, delta=True) == "a"
