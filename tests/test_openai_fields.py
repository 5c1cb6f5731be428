"""Every request field works, is refused with a 400 naming it, or is documented as having no effect;
vLLM's server flags (chat template, response role, CORS, root path) act as in vLLM. Fake engine: fast."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import httpx
import pytest

from vllm_lite.entrypoints.openai import field_support
from vllm_lite.entrypoints.openai.api_server import build_app
from vllm_lite.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from vllm_lite.testing.checkpoints import get_checkpoint
from vllm_lite.testing.openai_fake_engine import FakeAsyncLLM, fake_logprob

MODEL = "tiny-llama"
README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture
def engine() -> FakeAsyncLLM:
    return FakeAsyncLLM(get_checkpoint("llama"), max_model_len=128)


def request(app: Any, method: str, path: str, **kwargs: Any) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.request(method, path, **kwargs)

    return asyncio.run(go())


def post(app: Any, path: str, body: dict) -> httpx.Response:
    return request(app, "POST", path, json=body)


def error_param(resp: httpx.Response) -> str:
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["type"] == "BadRequestError"
    return err["param"]


# ---------------------------------------------------------------------------- the table cannot drift


@pytest.mark.parametrize(
    "model, rules",
    [(CompletionRequest, field_support.COMPLETION_FIELDS), (ChatCompletionRequest, field_support.CHAT_FIELDS)],
)
def test_every_schema_field_has_exactly_one_rule(model, rules):
    assert set(model.model_fields) == set(rules)


def test_readme_request_field_table_is_the_generated_one():
    with open(README, encoding="utf-8") as f:
        text = f.read()
    assert field_support.render_markdown() in text, "README's request-field table is stale: paste render_markdown()"


# ---------------------------------------------------------------------------- refusals name the field


def _refused(rules: dict) -> list[str]:
    return [name for name, (status, _, _) in rules.items() if status == field_support.REFUSED]


@pytest.mark.parametrize("field", _refused(field_support.COMPLETION_FIELDS))
def test_refused_completion_field_is_400_naming_it(engine, field):
    body = {"prompt": "Hello", "max_tokens": 2, field: {"not": "harmless"}}
    assert error_param(post(build_app(engine, MODEL), "/v1/completions", body)) == field


@pytest.mark.parametrize("field", _refused(field_support.CHAT_FIELDS))
def test_refused_chat_field_is_400_naming_it(engine, field):
    body = {"messages": CHAT, "max_tokens": 2, field: {"not": "harmless"}}
    assert error_param(post(build_app(engine, MODEL), "/v1/chat/completions", body)) == field


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"prompt": "Hello", "max_tokens": 2, "no_such_field": 1}),
        ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "no_such_field": 1}),
        ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "prompt": "completions only"}),
    ],
)
def test_unknown_field_is_400_naming_it(engine, path, body):
    resp = post(build_app(engine, MODEL), path, body)
    unknown = [k for k in body if k not in ("prompt", "messages", "max_tokens")] or ["prompt"]
    assert error_param(resp) == unknown[0]
    assert "Unrecognized request argument" in resp.json()["error"]["message"]


@pytest.mark.parametrize(
    "harmless",
    [
        {"tools": [], "tool_choice": "none", "parallel_tool_calls": False},
        {"response_format": {"type": "text"}, "modalities": ["text"], "use_beam_search": False},
        {"store": False, "metadata": {"k": "v"}, "user": "u", "service_tier": "auto", "length_penalty": 1.0},
    ],
)
def test_refused_fields_at_harmless_values_and_not_applicable_fields_are_accepted(engine, harmless):
    resp = post(build_app(engine, MODEL), "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, **harmless})
    assert resp.status_code == 200, resp.text


# ---------------------------------------------------------------------------- fields that work


def test_echo_with_max_tokens_zero_returns_the_prompt_and_its_logprobs_only(engine):
    resp = post(
        build_app(engine, MODEL),
        "/v1/completions",
        {"prompt": "Hello world", "max_tokens": 0, "echo": True, "logprobs": 1},
    )
    assert resp.status_code == 200, resp.text
    body = resp.json()
    (choice,) = body["choices"]
    prompt_ids = engine.tokenizer.encode("Hello world")
    assert choice["text"] == "Hello world"
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(
        [None] + [fake_logprob(p) for p in range(len(prompt_ids) - 1)]
    )
    assert body["usage"]["completion_tokens"] == 0
    assert choice["finish_reason"] == "length"


def test_echo_with_max_tokens_zero_streams_the_prompt_only(engine):
    resp = post(
        build_app(engine, MODEL),
        "/v1/completions",
        {"prompt": "Hello world", "max_tokens": 0, "echo": True, "stream": True},
    )
    chunks = [b[len("data: ") :] for b in resp.text.split("\n\n") if b.strip()]
    assert chunks[-1] == "[DONE]"
    import json

    assert "".join(json.loads(c)["choices"][0]["text"] for c in chunks[:-1]) == "Hello world"


def test_truncate_prompt_tokens_keeps_the_last_tokens(engine):
    resp = post(
        build_app(engine, MODEL),
        "/v1/completions",
        {"prompt": list(range(5, 25)), "max_tokens": 1, "truncate_prompt_tokens": 4},
    )
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["prompt_tokens"] == 4


# ---------------------------------------------------------------------------- server flags


TEMPLATE = "{% for m in messages %}<<{{ m['role'] }}:{{ m['content'] }}>>{% endfor %}"


def test_chat_template_flag_and_request_field_render_the_prompt(engine, tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    app = build_app(engine, MODEL, chat_template=str(path), response_role="robot")
    tok = request(
        app, "POST", "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1, "return_token_ids": True}
    )
    assert tok.status_code == 200, tok.text
    body = tok.json()
    assert engine.tokenizer.decode(body["prompt_token_ids"]) == engine.tokenizer.decode(
        engine.tokenizer.encode("<<user:hi>>", add_special_tokens=False)
    )
    assert body["choices"][0]["message"]["role"] == "robot"
    other = request(
        app,
        "POST",
        "/v1/chat/completions",
        json={
            "messages": CHAT,
            "max_tokens": 1,
            "return_token_ids": True,
            "chat_template": "[{{ messages[0]['content'] }}]",
        },
    )
    assert engine.tokenizer.decode(other.json()["prompt_token_ids"]) == engine.tokenizer.decode(
        engine.tokenizer.encode("[hi]", add_special_tokens=False)
    )


def test_cors_preflight_is_answered_before_the_api_key(engine):
    app = build_app(engine, MODEL, api_key="k", allowed_origins=["http://ui.example"])
    resp = request(
        app,
        "OPTIONS",
        "/v1/completions",
        headers={"Origin": "http://ui.example", "Access-Control-Request-Method": "POST"},
    )
    assert resp.status_code == 200
    assert resp.headers["access-control-allow-origin"] == "http://ui.example"
    denied = request(
        app,
        "OPTIONS",
        "/v1/completions",
        headers={"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"},
    )
    assert "access-control-allow-origin" not in denied.headers


def test_server_flags_parse_with_vllm_names():
    import argparse

    from vllm_lite.entrypoints.openai.api_server import server_options
    from vllm_lite.entrypoints.openai.cli_args import check_api_server_args, make_arg_parser

    parser = make_arg_parser(argparse.ArgumentParser())
    args = parser.parse_args(
        [
            "--model",
            "m",
            "--chat-template",
            "t.jinja",
            "--response-role",
            "bot",
            "--allowed-origins",
            '["http://a"]',
            "--root-path",
            "/api",
            "--disable-log-requests",
            "--served-model-name",
            "a",
            "b",
            "--api-key",
            "k",
            "--enforce-eager",
            "--max-logprobs",
            "5",
            "--generation-config",
            "vllm",
            "--disable-log-stats",
            "--revision",
            "main",
            "--download-dir",
            "/tmp/x",
        ]
    )
    opts = server_options(args)
    assert (opts["chat_template"], opts["response_role"], opts["allowed_origins"], opts["root_path"]) == (
        "t.jinja",
        "bot",
        ["http://a"],
        "/api",
    )
    assert opts["disable_log_requests"] and args.enforce_eager and args.max_logprobs == 5
    assert args.served_model_name == ["a", "b"] and args.api_key == "k"
    with pytest.raises(ValueError, match="--ssl-certfile"):
        check_api_server_args(parser.parse_args(["--model", "m", "--ssl-keyfile", "k.pem"]))
