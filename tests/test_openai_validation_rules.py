"""The OpenAI request models' own rules, checked on the pydantic models directly (no server, no engine).

What each rule promises: chat messages need OpenAI's roles and content, request fields become exactly the
SamplingParams vLLM builds from them (request value, else the model's default), usage flags follow the
stream options, empty tool-call fields are left out of response bodies, and a refused field is reported
only when its value asks for something. The HTTP paths over these are in test_openai_fields.py.
"""

from __future__ import annotations

import re
import time
from typing import Any

import pytest
from pydantic import ValidationError

from vllm_lite.entrypoints.openai import field_support
from vllm_lite.entrypoints.openai.field_support import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    NOT_APPLICABLE,
    REFUSED,
    WORKS,
    refused_field,
    render_markdown,
)
from vllm_lite.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    CompletionRequest,
    CompletionResponse,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    check_chat_messages,
    random_id,
)
from vllm_lite.sampling_params import RequestOutputKind, SamplingParams

CHAT = [{"role": "user", "content": "hi"}]

# ---------------------------------------------------------------------------- chat messages


def _message_error(messages: list[dict[str, Any]]) -> str:
    with pytest.raises(ValueError) as e:
        check_chat_messages(messages)
    return str(e.value)


def test_an_empty_message_list_is_refused():
    assert _message_error([]) == "messages must contain at least one message."


@pytest.mark.parametrize("role", ["hacker", "", "User", 5, None])
def test_a_role_outside_openais_five_is_refused_naming_the_message_and_the_role(role):
    msg = _message_error([{"role": "user", "content": "ok"}, {"role": role, "content": "hi"}])
    assert msg.startswith("messages[1].role must be one of "), msg
    assert "must be one of system, developer, user, assistant, tool; got" in msg, msg
    assert f"got {role!r}" in msg, msg


@pytest.mark.parametrize("role", ["system", "developer", "user", "tool"])
def test_a_non_assistant_message_without_content_is_refused_saying_content_is_required(role):
    msg = _message_error([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, {"role": role}])
    assert msg == f"messages[2] ({role}) has no content: it is required.", msg


@pytest.mark.parametrize("role", ["user", "system"])
def test_tool_calls_excuse_missing_content_only_on_an_assistant_message(role):
    call = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    msg = _message_error([{"role": role, "tool_calls": call}])
    assert msg == f"messages[0] ({role}) has no content: it is required.", msg


@pytest.mark.parametrize("extra", [{}, {"tool_calls": []}, {"function_call": None}, {"tool_calls": None}])
def test_an_assistant_message_without_content_needs_tool_calls_or_a_function_call(extra):
    msg = _message_error([{"role": "assistant", **extra}])
    assert msg == "messages[0] (assistant) has no content: an assistant message needs content or tool_calls.", msg


def test_an_assistant_message_with_a_function_call_and_no_content_is_accepted():
    messages = [{"role": "assistant", "function_call": {"name": "f", "arguments": "{}"}}, *CHAT]
    assert check_chat_messages(messages) is messages


def test_every_message_is_checked_not_only_the_first_assistant_turn():
    call = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    msg = _message_error([{"role": "assistant", "tool_calls": call}, {"role": "user", "content": 3.5}])
    assert msg == "messages[1].content must be a string or a list of content parts, got float.", msg


@pytest.mark.parametrize("content", [{"type": "text", "text": "x"}, 7, True])
def test_content_of_another_json_type_is_refused_naming_its_type(content):
    msg = _message_error([{"role": "user", "content": content}])
    assert msg.startswith("messages[0].content must be a string or a list"), msg
    assert msg.endswith(f"got {type(content).__name__}."), msg


def test_the_chat_request_model_runs_the_message_rules():
    with pytest.raises(ValidationError, match=re.escape("messages[0] (user) has no content")):
        ChatCompletionRequest(messages=[{"role": "user"}])
    assert ChatCompletionRequest(messages=CHAT).messages == CHAT


# ---------------------------------------------------------------------------- request -> SamplingParams


def _build(request: Any, defaults: SamplingParams | None = None, stream: bool = False, **kw: Any) -> SamplingParams:
    args = dict(max_tokens=7, logprobs=None, prompt_logprobs=None, defaults=defaults, stream=stream)
    return request.build_sampling_params(**{**args, **kw})


DEFAULTS = SamplingParams(temperature=0.6, top_p=0.9, top_k=20, min_p=0.05, repetition_penalty=1.1)
DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


def test_unset_sampling_fields_take_the_models_defaults_and_set_ones_override_them():
    got = _build(CompletionRequest(prompt="x"), DEFAULTS)
    assert {f: getattr(got, f) for f in DEFAULTED} == {f: getattr(DEFAULTS, f) for f in DEFAULTED}
    mine = dict(temperature=0.3, top_p=0.5, top_k=3, min_p=0.2, presence_penalty=0.5, frequency_penalty=-0.5)
    mine["repetition_penalty"] = 1.3
    got = _build(CompletionRequest(prompt="x", **mine), DEFAULTS)
    assert {f: getattr(got, f) for f in DEFAULTED} == mine


def test_penalty_defaults_come_from_the_models_defaults_too():
    defaults = SamplingParams(presence_penalty=0.25, frequency_penalty=-0.75)
    got = _build(ChatCompletionRequest(messages=CHAT), defaults)
    assert (got.presence_penalty, got.frequency_penalty) == (0.25, -0.75)


def test_without_model_defaults_unset_fields_take_vllms_defaults():
    got = _build(CompletionRequest(prompt="x"), None)
    assert {f: getattr(got, f) for f in DEFAULTED} == {f: getattr(SamplingParams(), f) for f in DEFAULTED}


def test_every_request_field_reaches_the_sampling_params():
    req = CompletionRequest(
        prompt="x",
        n=2,
        seed=11,
        stop=["##", "!!"],
        stop_token_ids=[3, 4],
        ignore_eos=True,
        min_tokens=2,
        skip_special_tokens=False,
        spaces_between_special_tokens=False,
        include_stop_str_in_output=True,
        logit_bias={"5": -1.5},
        allowed_token_ids=[5, 6, 7],
        bad_words=["bad"],
        temperature=0.8,
    )
    got = _build(req, DEFAULTS, max_tokens=9, logprobs=3, prompt_logprobs=2, best_of=4)
    assert (got.n, got.best_of, got.seed, got.max_tokens, got.min_tokens) == (2, 4, 11, 9, 2)
    assert (got.stop, got.stop_token_ids, got.ignore_eos) == (["##", "!!"], [3, 4], True)
    assert (got.logprobs, got.prompt_logprobs) == (3, 2)
    assert (got.skip_special_tokens, got.spaces_between_special_tokens, got.include_stop_str_in_output) == (
        False,
        False,
        True,
    )
    assert got.logit_bias == {5: -1.5} and req.logit_bias == {"5": -1.5}  # the request keeps its JSON keys
    assert (got.allowed_token_ids, got.bad_words) == ([5, 6, 7], ["bad"])


def test_request_fields_left_unset_give_sampling_params_defaults():
    got = _build(ChatCompletionRequest(messages=CHAT), None, max_tokens=None)
    base = SamplingParams(max_tokens=None)
    for f in ("n", "best_of", "seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens", "logprobs"):
        assert getattr(got, f) == getattr(base, f), f
    assert got.skip_special_tokens and got.spaces_between_special_tokens and not got.include_stop_str_in_output
    assert got.logit_bias is None and got.allowed_token_ids is None and got.bad_words == []


def test_an_empty_logit_bias_is_no_bias():
    assert _build(CompletionRequest(prompt="x", logit_bias={}), None).logit_bias is None


def test_streaming_asks_for_deltas_and_a_plain_request_for_the_final_output_only():
    assert _build(CompletionRequest(prompt="x"), None, stream=True).output_kind == RequestOutputKind.DELTA
    assert _build(CompletionRequest(prompt="x"), None, stream=False).output_kind == RequestOutputKind.FINAL_ONLY


def test_stream_options_without_stream_are_refused_naming_both():
    req = CompletionRequest(prompt="x", stream_options={"include_usage": True})
    with pytest.raises(ValueError, match=r"^stream_options is only allowed when stream is true\.$"):
        _build(req, None)
    streamed = CompletionRequest(prompt="x", stream=True, stream_options={"include_usage": True})
    assert _build(streamed, None, stream=True).output_kind == RequestOutputKind.DELTA


def test_sampling_params_own_checks_apply_to_request_values():
    with pytest.raises(ValueError, match="temperature"):
        _build(CompletionRequest(prompt="x", temperature=-1.0), None)


@pytest.mark.parametrize(
    "stream, options, usage, continuous",
    [
        (False, None, False, False),
        (True, None, False, False),
        (True, {}, False, False),
        (True, {"include_usage": True}, True, False),
        (True, {"include_usage": False, "continuous_usage_stats": True}, False, False),
        (True, {"include_usage": True, "continuous_usage_stats": True}, True, True),
        (False, {"include_usage": True, "continuous_usage_stats": True}, False, False),
    ],
)
def test_usage_blocks_need_streaming_and_include_usage_and_continuous_needs_both(stream, options, usage, continuous):
    req = ChatCompletionRequest(messages=CHAT, stream=stream, stream_options=options)
    assert req.include_usage is usage and req.continuous_usage is continuous


# ---------------------------------------------------------------------------- response bodies


def test_a_message_without_tool_calls_leaves_the_field_out_and_one_with_calls_keeps_it():
    assert ChatMessage(role="assistant", content="hi").model_dump() == {"role": "assistant", "content": "hi"}
    call = ToolCall(id="t1", function=FunctionCall(name="f", arguments="{}"))
    body = ChatMessage(role="assistant", content=None, tool_calls=[call]).model_dump()
    assert body == {
        "role": "assistant",
        "content": None,  # OpenAI sends null content beside tool calls
        "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
    }
    assert DeltaMessage(content="x").model_dump() == {"role": None, "content": "x"}
    # A caller may leave the field out itself; the serializer must not trip over its absence.
    assert ChatMessage(role="user", content="hi").model_dump(exclude={"tool_calls"}) == {
        "role": "user",
        "content": "hi",
    }
    assert DeltaToolCall(index=0, id="t").model_dump(include={"index", "id"}) == {"index": 0, "id": "t"}


def test_a_streamed_tool_call_piece_carries_only_what_it_sets():
    first = DeltaToolCall(index=0, id="t1", type="function", function=DeltaFunctionCall(name="f"))
    assert first.model_dump() == {"index": 0, "id": "t1", "type": "function", "function": {"name": "f"}}
    later = DeltaToolCall(index=1, function=DeltaFunctionCall(arguments='{"a"'))
    assert later.model_dump() == {"index": 1, "function": {"arguments": '{"a"'}}
    assert DeltaToolCall(index=2).model_dump() == {"index": 2}
    assert DeltaFunctionCall(name="", arguments="").model_dump() == {"name": "", "arguments": ""}


def test_ids_carry_their_prefix_and_a_fresh_random_part():
    a, b = random_id("cmpl"), random_id("cmpl")
    assert re.fullmatch(r"cmpl-[0-9a-f]{32}", a) and a != b
    assert re.fullmatch(r"chatcmpl-tool-[0-9a-f]{32}", ToolCall(function=FunctionCall(name="f", arguments="")).id)
    before = int(time.time())
    resp = CompletionResponse(model="m", choices=[], usage={})
    assert re.fullmatch(r"cmpl-[0-9a-f]{32}", resp.id) and before <= resp.created <= int(time.time())
    chat = ChatCompletionResponse(model="m", choices=[], usage={})
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{32}", chat.id) and before <= chat.created <= int(time.time())


# ---------------------------------------------------------------------------- field_support rules


def test_refused_fields_at_none_are_not_reported():
    assert refused_field(COMPLETION_FIELDS, CompletionRequest(prompt="x")) is None
    assert refused_field(CHAT_FIELDS, ChatCompletionRequest(messages=CHAT)) is None


def test_a_refused_field_in_use_is_reported_with_its_reason():
    req = CompletionRequest(prompt="x", suffix="tail")
    assert refused_field(COMPLETION_FIELDS, req) == ("suffix", COMPLETION_FIELDS["suffix"][1])
    assert "fill-in-the-middle" in refused_field(COMPLETION_FIELDS, req)[1]


def test_the_first_refused_field_in_table_order_is_reported():
    req = ChatCompletionRequest(messages=CHAT, audio={"voice": "x"}, request_id="r")
    names = [n for n, (s, _, _) in CHAT_FIELDS.items() if s == REFUSED]
    assert names.index("audio") < names.index("request_id")
    assert refused_field(CHAT_FIELDS, req)[0] == "audio"


def test_working_and_not_applicable_fields_are_never_reported():
    class Everything:
        """Every field set to a value no refused field would accept."""

        def __getattr__(self, name: str) -> Any:
            return {"asks": "for something"}

    rules = {"a": (WORKS, "", None), "b": (NOT_APPLICABLE, "", None), "c": (REFUSED, "why", None)}
    assert refused_field(rules, Everything()) == ("c", "why")
    assert refused_field({k: v for k, v in rules.items() if k != "c"}, Everything()) is None


@pytest.mark.parametrize(
    "rules, field, harmless, harmful",
    [
        (COMPLETION_FIELDS, "suffix", [""], ["x"]),
        (COMPLETION_FIELDS, "use_beam_search", [False], [True]),
        (COMPLETION_FIELDS, "length_penalty", [1.0, 1], [0.5]),
        (COMPLETION_FIELDS, "logits_processors", [[], {}], [["p"], {"a": 1}]),
        (COMPLETION_FIELDS, "vllm_xargs", [[], {}], [{"k": 1}]),
        (COMPLETION_FIELDS, "return_tokens_as_token_ids", [False], [True]),
        (COMPLETION_FIELDS, "prompt_logprobs", [], [0, 1, False]),
        (CHAT_FIELDS, "functions", [[]], [[{"name": "f"}]]),
        (CHAT_FIELDS, "function_call", ["none", "auto"], ["required", {"name": "f"}]),
        (CHAT_FIELDS, "modalities", [["text"]], [["text", "audio"], ["audio"]]),
        (CHAT_FIELDS, "echo", [False], [True]),
        (CHAT_FIELDS, "best_of", [1], [2]),
        (CHAT_FIELDS, "audio", [], [{}, False]),
    ],
)
def test_a_refused_field_passes_exactly_at_its_harmless_values(rules, field, harmless, harmful):
    class Request:
        def __init__(self, value: Any) -> None:
            setattr(self, field, value)

    for value in harmless:
        assert refused_field(rules, Request(value)) is None, (field, value)
    for value in harmful:
        assert refused_field(rules, Request(value)) == (field, rules[field][1]), (field, value)


def test_the_harmless_value_helpers():
    accepts = field_support._is_none_or(False, "none")
    assert accepts(None) and accepts(False) and accepts("none")
    assert not accepts(True) and not accepts("auto") and not accepts(0.5)
    assert field_support._empty(None) and field_support._empty([]) and field_support._empty({})
    assert not field_support._empty([0]) and not field_support._empty({"a": 0}) and not field_support._empty("x")


def test_the_rendered_table_has_one_row_per_field_and_says_unknown_where_an_endpoint_lacks_one():
    lines = render_markdown().split("\n")
    assert lines[:2] == ["| field | /v1/completions | /v1/chat/completions |", "|---|---|---|"]
    names = list(dict.fromkeys([*COMPLETION_FIELDS, *CHAT_FIELDS]))
    assert [line.split(" | ")[0] for line in lines[2:]] == [f"| `{n}`" for n in names]
    rows = {line.split(" | ")[0][3:-1]: line for line in lines[2:]}
    assert rows["prompt"] == ("| `prompt` | works: text, token ids, or a list of either | 400: unknown field |")
    assert rows["messages"] == "| `messages` | 400: unknown field | works: text content (strings or text parts) |"
    assert rows["n"] == "| `n` | works | works |"  # a rule without a note shows its status only
    assert rows["suffix"].startswith("| `suffix` | 400: insertion (fill-in-the-middle)")
