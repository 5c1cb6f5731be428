"""Tool calling and structured outputs end to end: the official `openai` client against a real server
on a tiny random checkpoint (one server for the module).

Random weights emit garbage unless constrained, so every tool call here is produced under a
constraint: tool_choice named and "required" build their own JSON-schema constraint; "auto" runs
the server's hermes parser (--enable-auto-tool-choice --tool-call-parser hermes) over a reply that a
structured_outputs regex shapes into `<tool_call>{...}</tool_call>`, which proves the parser is
wired, not that the model chose to call. response_format outputs are validated with `jsonschema`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from vllm_lite.testing.checkpoints import get_checkpoint
from vllm_lite.testing.json_schemas import JSON_SCHEMAS, check_output
from vllm_lite.testing.openai_server import ServerThread
from vllm_lite.testing.tool_chat_template import HERMES_TOOL_CHAT_TEMPLATE

MODEL = "tiny-llama"
WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1, "maximum": 3}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"tz": {"enum": ["UTC", "CET"]}},
    "required": ["tz"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
TOOLS = [{"type": "function", "function": {"name": n, "description": n, "parameters": s}} for n, s in SCHEMAS.items()]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
HERMES_CALL = (
    r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", "days": [1-3]\}\}</tool_call>'
)
GEN = dict(model=MODEL, max_tokens=120, temperature=0)


@pytest.fixture(scope="module")
def server():
    from vllm_lite.client.async_llm import AsyncLLM
    from vllm_lite.engine_args import EngineArgs

    # Compact JSON (vLLM's disable_any_whitespace): a random model given optional whitespace never stops.
    args = EngineArgs(
        model=get_checkpoint("llama"),
        dtype="float32",
        max_model_len=1024,
        seed=0,
        structured_outputs_config={"disable_any_whitespace": True},
    )
    srv = ServerThread(
        lambda: AsyncLLM.from_engine_args(args),
        served_model_name=MODEL,
        chat_template=HERMES_TOOL_CHAT_TEMPLATE,
        enable_auto_tool_choice=True,
        tool_call_parser="hermes",
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)


def check_calls(calls: list[Any], names: set[str]) -> None:
    """Each call names a tool in `names` and its arguments are JSON valid against that tool's schema."""
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def collect_stream(stream: Any) -> tuple[str, list[dict], str]:
    """(content, tool calls rebuilt from deltas, finish_reason), checking OpenAI's delta shapes on the way."""
    content, calls, finish = "", [], None
    for chunk in stream:
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for tc in choice.delta.tool_calls or []:
            if tc.index == len(calls):  # a call's first delta: id, type and name, then arguments in pieces
                assert tc.id and tc.type == "function" and tc.function.name
                calls.append({"id": tc.id, "name": tc.function.name, "arguments": tc.function.arguments or ""})
            else:
                assert tc.id is None and tc.function.name is None
                calls[tc.index]["arguments"] += tc.function.arguments
        finish = choice.finish_reason or finish
    return content, calls, finish


def check_streamed_calls(calls: list[dict], names: set[str]) -> None:
    assert calls and len({c["id"] for c in calls}) == len(calls)
    for c in calls:
        assert c["name"] in names
        jsonschema.validate(json.loads(c["arguments"]), SCHEMAS[c["name"]])


# ---------------------------------------------------------------------------- response_format / structured outputs


@pytest.mark.parametrize("case", [c for c in JSON_SCHEMAS if "xgrammar" in c.backends][:4], ids=lambda c: c.name)
def test_response_format_json_schema_output_validates(client: openai.OpenAI, case) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": case.name, "schema": case.spec, "strict": True}}
    chat = client.chat.completions.create(messages=ASK, response_format=fmt, **GEN)
    assert chat.choices[0].finish_reason == "stop"
    check_output(case, chat.choices[0].message.content)
    done = client.completions.create(prompt="Data:", extra_body={"response_format": fmt}, **GEN)
    check_output(case, done.choices[0].text)


def test_json_object_and_streamed_choice(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        messages=ASK, response_format={"type": "json_object"}, extra_body={"guided_whitespace_pattern": None}, **GEN
    )
    if chat.choices[0].finish_reason == "stop":  # an unbounded object may run to max_tokens
        assert isinstance(json.loads(chat.choices[0].message.content), dict)
    stream = client.completions.create(
        prompt="Pick:", stream=True, extra_body={"guided_choice": ["red", "blue"]}, **GEN
    )
    assert "".join(c.choices[0].text for c in stream) in ("red", "blue")


# ---------------------------------------------------------------------------- tool calls


def test_named_tool_choice_returns_that_call(client: openai.OpenAI) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    resp = client.chat.completions.create(messages=ASK, tools=TOOLS, tool_choice=named, **GEN)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    check_calls(choice.message.tool_calls, {"get_time"})
    content, calls, finish = collect_stream(
        client.chat.completions.create(messages=ASK, tools=TOOLS, tool_choice=named, stream=True, **GEN)
    )
    assert (content, finish) == ("", "tool_calls")
    check_streamed_calls(calls, {"get_time"})
    assert json.loads(calls[0]["arguments"]) == json.loads(choice.message.tool_calls[0].function.arguments)


def close_brackets_first() -> dict[str, int]:
    """logit_bias towards every token that holds "]": "required" is an open array of calls (vLLM's schema) and a
    random-weight model may never close it (on the H100 and H200 it ran past 480 tokens). No schema here has an
    array inside a call, so the first place the grammar allows "]" is after a whole call: the array closes there,
    whatever the weights or the device."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(get_checkpoint("llama"))
    bias = {str(i): 100 for i in range(len(tok)) if "]" in tok.decode([i])}
    assert bias, "the tokenizer has no token holding ']'"
    return bias


def test_required_tool_choice_returns_calls_to_the_given_tools(client: openai.OpenAI) -> None:
    gen = {**GEN, "logit_bias": close_brackets_first()}
    resp = client.chat.completions.create(messages=ASK, tools=TOOLS, tool_choice="required", seed=1, **gen)
    assert resp.choices[0].finish_reason == "tool_calls"
    assert len(resp.choices[0].message.tool_calls) == 1  # the bias closed the array after the first call
    check_calls(resp.choices[0].message.tool_calls, set(SCHEMAS))
    _, calls, finish = collect_stream(
        client.chat.completions.create(messages=ASK, tools=TOOLS, tool_choice="required", stream=True, **gen)
    )
    assert finish == "tool_calls" and len(calls) == 1
    check_streamed_calls(calls, set(SCHEMAS))


def test_auto_tool_choice_reads_hermes_calls_out_of_the_reply(client: openai.OpenAI) -> None:
    shaped = {"structured_outputs": {"regex": HERMES_CALL}}
    resp = client.chat.completions.create(messages=ASK, tools=TOOLS, extra_body=shaped, **GEN)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    check_calls(choice.message.tool_calls, {"get_weather"})
    content, calls, finish = collect_stream(
        client.chat.completions.create(
            messages=ASK, tools=TOOLS, tool_choice="auto", stream=True, extra_body=shaped, **GEN
        )
    )
    assert (content, finish) == ("", "tool_calls")
    check_streamed_calls(calls, {"get_weather"})


@pytest.mark.parametrize("stream", [False, True])
def test_auto_reply_without_a_call_is_content(client: openai.OpenAI, stream: bool) -> None:
    shaped = {"guided_choice": ["It is sunny <b>today</b>."]}
    resp = client.chat.completions.create(messages=ASK, tools=TOOLS, stream=stream, extra_body=shaped, **GEN)
    if stream:
        content, calls, finish = collect_stream(resp)
    else:
        msg = resp.choices[0].message
        content, calls, finish = msg.content, msg.tool_calls or [], resp.choices[0].finish_reason
    assert (content, calls, finish) == ("It is sunny <b>today</b>.", [], "stop")


def test_tools_and_tool_turns_reach_the_chat_template(client: openai.OpenAI, server: ServerThread) -> None:
    history = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    resp = client.chat.completions.create(
        messages=history,
        tools=TOOLS,
        tool_choice="none",
        extra_body={"return_token_ids": True},
        **{**GEN, "max_tokens": 2},
    )
    assert not resp.choices[0].message.tool_calls
    prompt = server.engine.tokenizer.decode(resp.model_extra["prompt_token_ids"], skip_special_tokens=False)
    assert '{"type": "function", "function": {"name": "get_time"' in prompt  # tools, inside <tools>
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in prompt
    assert '<tool_response tool_call_id="call_1">sunny</tool_response>' in prompt


# ---------------------------------------------------------------------------- refusals and flags


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"tools": TOOLS}, "tool_choice"),  # auto is OpenAI's default with tools; this app has no parser
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tools"),
        ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),  # two constraints
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
    ],
)
def test_tool_requests_the_server_cannot_honour_are_400(fields, param):
    from vllm_lite.entrypoints.openai.api_server import build_app
    from vllm_lite.testing.openai_fake_engine import FakeAsyncLLM

    app = build_app(FakeAsyncLLM(get_checkpoint("llama"), max_model_len=128), MODEL)

    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 2, **fields})

    resp = asyncio.run(go())
    assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text
    if len(fields) == 1 and param == "tool_choice":
        assert "--enable-auto-tool-choice" in resp.json()["error"]["message"]


def test_tool_flags_parse_with_vllm_names_and_need_each_other():
    from vllm_lite.entrypoints.openai.api_server import server_options
    from vllm_lite.entrypoints.openai.cli_args import check_api_server_args, make_arg_parser

    parser = make_arg_parser(argparse.ArgumentParser())
    args = parser.parse_args(["--model", "m", "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json"])
    check_api_server_args(args)
    opts = server_options(args)
    assert (opts["enable_auto_tool_choice"], opts["tool_call_parser"]) == (True, "llama3_json")
    with pytest.raises(ValueError, match="--tool-call-parser"):
        check_api_server_args(parser.parse_args(["--model", "m", "--enable-auto-tool-choice"]))
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "--tool-call-parser", "no-such-parser"])
