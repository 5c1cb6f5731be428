"""HTTP input is typed as OpenAI's schema says: no coercion, OpenAI's roles only, content where the
API requires it, and a 400 that names the problem for every bad input (never a 500, never an internal
exception's text). Fake engine with the real tokenizer and Processor: fast."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from vllm_lite.entrypoints.openai.api_server import build_app
from vllm_lite.testing.checkpoints import get_checkpoint
from vllm_lite.testing.openai_fake_engine import FakeAsyncLLM

CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def app() -> Any:
    return build_app(FakeAsyncLLM(get_checkpoint("llama"), max_model_len=128), "tiny-llama")


def post(app: Any, path: str, body: dict) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post(path, json=body)

    return asyncio.run(go())


def bad_request(resp: httpx.Response) -> dict:
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["type"] == "BadRequestError" and err["code"] == 400
    return err


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", "4"),
        ("n", "2"),
        ("stream", "yes"),
        ("stream", 1),
        ("temperature", "0.5"),
        ("seed", 1.5),
        ("ignore_eos", "true"),
        ("n", 2.0),
        ("top_k", True),
        ("logprobs", "1"),
    ],
)
def test_completions_refuse_a_value_of_the_wrong_json_type(app, field, value):
    err = bad_request(post(app, "/v1/completions", {"prompt": "hi", "max_tokens": 2, field: value}))
    assert err["param"] == field


@pytest.mark.parametrize("field, value", [("max_completion_tokens", "4"), ("logprobs", "yes"), ("n", "2")])
def test_chat_refuses_a_value_of_the_wrong_json_type(app, field, value):
    err = bad_request(post(app, "/v1/chat/completions", {"messages": CHAT, field: value}))
    assert err["param"] == field


def test_stream_options_are_typed_too(app):
    body = {"prompt": "hi", "stream": True, "stream_options": {"include_usage": "yes"}}
    assert bad_request(post(app, "/v1/completions", body))["param"] == "stream_options"


def test_numbers_still_take_integers_and_well_typed_requests_work(app):
    resp = post(app, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "temperature": 0, "top_p": 1})
    assert resp.status_code == 200, resp.text


@pytest.mark.parametrize(
    "messages, says",
    [
        ([{"role": "hacker", "content": "hi"}], "role must be one of"),
        ([{"content": "hi"}], "role must be one of"),
        ([{"role": "user"}], "has no content"),
        ([{"role": "user", "content": None}], "has no content"),
        ([{"role": "system"}, {"role": "user", "content": "hi"}], "messages[0] (system) has no content"),
        ([{"role": "user", "content": "hi"}, {"role": "assistant"}], "needs content or tool_calls"),
        ([{"role": "user", "content": 5}], "must be a string or a list"),
        ([], "at least one message"),
    ],
)
def test_chat_messages_need_openai_roles_and_content(app, messages, says):
    err = bad_request(post(app, "/v1/chat/completions", {"messages": messages}))
    assert err["param"] == "messages" and says in err["message"], err


def test_all_five_openai_roles_are_accepted_and_an_assistant_with_tool_calls_needs_no_content():
    from vllm_lite.entrypoints.openai.protocol import check_chat_messages

    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        {"role": "system", "content": "s"},
        {"role": "developer", "content": "d"},
        {"role": "user", "content": [{"type": "text", "text": "u"}]},
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "r"},
    ]
    assert check_chat_messages(messages) is messages


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_priority_out_of_int64_is_a_400_naming_it(app, path):
    body = {"prompt": "hi"} if path == "/v1/completions" else {"messages": CHAT}
    err = bad_request(post(app, path, {**body, "max_tokens": 2, "priority": 10**30}))
    assert err["param"] == "priority"


def test_priority_out_of_int64_is_a_value_error_naming_it_in_python():
    from vllm_lite.client.processor import check_priority

    with pytest.raises(ValueError, match="priority"):
        check_priority(10**30)
    with pytest.raises(ValueError, match="priority"):
        check_priority(-(2**63) - 1)
    assert check_priority(2**63 - 1) == 2**63 - 1


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_a_lone_surrogate_is_a_400_about_unicode_not_a_tokenizer_internal(app, path):
    text = "hello \ud800 world"
    body = {"prompt": text} if path != "/v1/chat/completions" else {"messages": [{"role": "user", "content": text}]}

    # httpx would refuse to encode the surrogate; JSON's escape reaches the server as a lone surrogate.
    async def go() -> httpx.Response:
        import json

        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            raw = json.dumps(body)  # ensure_ascii: "\ud800" as an escape
            return await client.post(path, content=raw, headers={"content-type": "application/json"})

    err = bad_request(asyncio.run(go()))
    assert "not valid Unicode" in err["message"] and "surrogate" in err["message"], err
    assert "TextEncodeInput" not in err["message"]
