"""Structured-output request fields: response_format, vLLM's structured_outputs and the older guided_*
fields become one `SamplingParams.structured_outputs`; conflicts and bad constraints are 400s naming
the field (with the grammar compiler's message). Fake engine with the real Processor: fast.
Outputs that obey the constraint, from a real engine, are checked in test_openai_tools.py (one server).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncGenerator

import httpx
import pytest

from vllm_lite.entrypoints.openai.api_server import build_app
from vllm_lite.entrypoints.openai.errors import BadRequestError
from vllm_lite.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from vllm_lite.entrypoints.openai.structured_outputs import build_structured_outputs
from vllm_lite.outputs import CompletionOutput, RequestOutput
from vllm_lite.sampling_params import SamplingParams, StructuredOutputsParams
from vllm_lite.testing.checkpoints import get_checkpoint
from vllm_lite.testing.openai_fake_engine import FakeAsyncLLM

MODEL = "tiny-llama"
CHAT = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def chat_request(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": CHAT, **fields})


# ---------------------------------------------------------------------------- conversion


@pytest.mark.parametrize(
    "fields, expected",
    [
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "n", "schema": SCHEMA, "strict": True},
                }
            },
            StructuredOutputsParams(json=SCHEMA),
        ),
        (
            {"structured_outputs": {"regex": "[ab]+", "disable_any_whitespace": True}},
            StructuredOutputsParams(regex="[ab]+", disable_any_whitespace=True),
        ),
        ({"structured_outputs": {"json": SCHEMA}}, StructuredOutputsParams(json=SCHEMA)),
        ({"guided_json": SCHEMA}, StructuredOutputsParams(json=SCHEMA)),
        ({"guided_json": json.dumps(SCHEMA)}, StructuredOutputsParams(json=json.dumps(SCHEMA))),
        ({"guided_regex": "x+"}, StructuredOutputsParams(regex="x+")),
        ({"guided_choice": ["yes", "no"]}, StructuredOutputsParams(choice=["yes", "no"])),
        ({"guided_grammar": 'root ::= "a"'}, StructuredOutputsParams(grammar='root ::= "a"')),
        (
            {"guided_json": SCHEMA, "guided_whitespace_pattern": " ?"},
            StructuredOutputsParams(json=SCHEMA, whitespace_pattern=" ?"),
        ),
    ],
)
def test_every_spelling_becomes_one_structured_outputs_params(fields, expected):
    for request in (chat_request(**fields), CompletionRequest.model_validate({"prompt": "x", **fields})):
        got = build_structured_outputs(request)
        assert (got[1] if got is not None else None) == expected
        if got is not None:
            assert got[0] == next(iter(fields))  # the field it came from, for error messages


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"response_format": {"type": "json_object"}, "guided_json": SCHEMA}, "guided_json"),
        ({"structured_outputs": {"regex": "a"}, "guided_choice": ["a"]}, "guided_choice"),
        ({"guided_regex": "a", "guided_grammar": 'root ::= "a"'}, "guided_grammar"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {"disable_any_whitespace": True}}, "structured_outputs"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_json": "[1, 2]"}, "guided_json"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "n"}}}, "response_format"),
        ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ],
)
def test_conflicting_or_empty_constraints_are_400_naming_the_field(fields, param):
    with pytest.raises(BadRequestError) as err:
        build_structured_outputs(chat_request(**fields))
    assert err.value.param == param
    if len(fields) == 2:
        assert all(name in err.value.message for name in fields), "a conflict names both fields"


# ---------------------------------------------------------------------------- over HTTP (fake engine)


@pytest.fixture(scope="module")
def engine() -> FakeAsyncLLM:
    return FakeAsyncLLM(get_checkpoint("llama"), max_model_len=128)


def post(app: Any, path: str, body: dict) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post(path, json=body)

    return asyncio.run(go())


ENDPOINTS = [("/v1/completions", {"prompt": "Hello"}), ("/v1/chat/completions", {"messages": CHAT})]


@pytest.mark.parametrize("path, base", ENDPOINTS)
def test_the_constraint_reaches_the_engine_on_both_endpoints(engine, path, base):
    resp = post(build_app(engine, MODEL), path, {**base, "max_tokens": 2, "guided_choice": ["red", "blue"]})
    assert resp.status_code == 200, resp.text
    _, params = engine.requests[next(reversed(engine.requests))]
    assert params.structured_outputs == StructuredOutputsParams(choice=["red", "blue"])


@pytest.mark.parametrize("path, base", ENDPOINTS)
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "fields, param, words",
    [
        ({"guided_regex": "(unclosed"}, "guided_regex", "regex"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "no-type"}}}},
            "response_format",
            "no-type",
        ),
        ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "structured_outputs", "undefined_rule"),
        ({"response_format": {"type": "xml"}}, "response_format", "json_schema"),
    ],
)
def test_a_constraint_the_compiler_refuses_is_400_with_its_message(engine, path, base, stream, fields, param, words):
    before = len(engine.requests)
    resp = post(build_app(engine, MODEL), path, {**base, "max_tokens": 2, "stream": stream, **fields})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and words in err["message"], err
    assert len(engine.requests) == before, "nothing reached the engine"


class CoreRefusesGrammar(FakeAsyncLLM):
    """An engine whose core answers a constrained request with an error output before any token
    (a backend that refuses what the frontend's check let through)."""

    async def generate(
        self, prompt: Any, sampling_params: SamplingParams, request_id: str, priority: int = 0
    ) -> AsyncGenerator[RequestOutput, None]:
        if sampling_params.structured_outputs is None:
            async for out in super().generate(prompt, sampling_params, request_id, priority):
                yield out
            return
        fail = CompletionOutput(0, "", [], None, None, "error")
        yield RequestOutput(request_id, None, prompt["prompt_token_ids"], None, [fail], True, error="grammar: nope")


@pytest.mark.parametrize("path, base", ENDPOINTS)
@pytest.mark.parametrize("stream", [False, True])
def test_an_error_output_before_any_token_is_a_400(path, base, stream):
    app = build_app(CoreRefusesGrammar(get_checkpoint("llama"), max_model_len=128), MODEL)
    resp = post(app, path, {**base, "max_tokens": 2, "stream": stream, "guided_regex": "a+"})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "guided_regex" and "nope" in resp.json()["error"]["message"]
    assert post(app, path, {**base, "max_tokens": 2, "stream": stream}).status_code == 200
