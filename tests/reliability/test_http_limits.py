"""Limits of the OpenAI server, each with a clear error before any work is spent on the request:
a body over --max-request-body-bytes is a 413 before it is parsed, a prompt text longer than
max_model_len tokens could hold is a 400 before it is tokenized, and n/best_of over 128 are a 400.
Fake engine with the real tokenizer and Processor; the tokenizer is watched to prove it never ran."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from vllm_lite.client.processor import Processor, max_prompt_chars
from vllm_lite.entrypoints.openai.api_server import build_app
from vllm_lite.sampling_params import SamplingParams
from vllm_lite.testing.checkpoints import get_checkpoint
from vllm_lite.testing.openai_fake_engine import FakeAsyncLLM

MAX_MODEL_LEN = 128
BODY_LIMIT = 4096


@pytest.fixture(scope="module")
def engine() -> FakeAsyncLLM:
    return FakeAsyncLLM(get_checkpoint("llama"), max_model_len=MAX_MODEL_LEN)


@pytest.fixture
def encoded(engine, monkeypatch) -> list[int]:
    """Lengths of every text the tokenizer was asked to encode during the test."""
    seen: list[int] = []
    real = engine.tokenizer.encode

    def spy(text: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(len(text))
        return real(text, *args, **kwargs)

    monkeypatch.setattr(engine.tokenizer, "encode", spy)
    return seen


def send(app: Any, path: str, content: Any, headers: dict[str, str]) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post(path, content=content, headers=headers)

    return asyncio.run(go())


def assert_openai_error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    return err


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_a_declared_body_over_the_limit_is_a_413_before_parsing(engine, encoded, path):
    app = build_app(engine, "m", max_request_body_bytes=BODY_LIMIT)
    body = json.dumps({"prompt": "x" * (2 * BODY_LIMIT)}).encode()
    err = assert_openai_error(send(app, path, body, {"content-type": "application/json"}), 413)
    assert str(BODY_LIMIT) in err["message"] and "--max-request-body-bytes" in err["message"]
    assert encoded == []
    print(f"{path}: {len(body)}-byte body -> 413 with a limit of {BODY_LIMIT}, tokenizer calls {len(encoded)}")


def test_a_chunked_body_is_cut_off_at_the_limit(engine, encoded):
    app = build_app(engine, "m", max_request_body_bytes=BODY_LIMIT)

    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(64):  # 64 KiB in all, no Content-Length
            yield b"x" * 1024
        yield b'"}'

    err = assert_openai_error(send(app, "/v1/completions", chunks(), {"content-type": "application/json"}), 413)
    assert "too large" in err["message"]
    assert encoded == []


def test_a_body_under_the_limit_is_served_and_zero_turns_the_limit_off(engine):
    body = json.dumps({"prompt": "hello", "max_tokens": 2}).encode()
    headers = {"content-type": "application/json"}
    assert send(build_app(engine, "m", max_request_body_bytes=BODY_LIMIT), "/v1/completions", body, headers).is_success
    big = json.dumps({"prompt": [5] * 20, "max_tokens": 2, "user": "u" * (2 * BODY_LIMIT)}).encode()
    assert send(build_app(engine, "m", max_request_body_bytes=0), "/v1/completions", big, headers).is_success


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_a_prompt_text_too_long_for_max_model_len_is_a_400_without_tokenizing(engine, encoded, path):
    app = build_app(engine, "m", max_request_body_bytes=0)
    text = "word " * (max_prompt_chars(MAX_MODEL_LEN, engine.tokenizer) // 5 + 1)
    body = {"prompt": text} if path != "/v1/chat/completions" else {"messages": [{"role": "user", "content": text}]}
    err = assert_openai_error(send(app, path, json.dumps(body), {"content-type": "application/json"}), 400)
    assert "too long" in err["message"] and f"max_model_len={MAX_MODEL_LEN}" in err["message"]
    assert all(n < len(text) for n in encoded), "the over-long text reached the tokenizer"


def test_the_character_bound_never_refuses_a_text_that_could_fit(engine):
    # The bound is the longest token's text x 4: a text at it tokenizes to far more than max_model_len tokens.
    limit = max_prompt_chars(MAX_MODEL_LEN, engine.tokenizer)
    longest = max(engine.tokenizer.get_vocab(), key=len)
    at_limit = (longest * (limit // len(longest) + 1))[:limit]
    assert len(engine.tokenizer.encode(at_limit, add_special_tokens=False)) > MAX_MODEL_LEN


def test_python_processor_refuses_an_over_long_text_before_tokenizing(engine, encoded):
    processor = Processor(engine.model_config, engine.tokenizer)
    text = "a" * (max_prompt_chars(MAX_MODEL_LEN, engine.tokenizer) + 1)
    with pytest.raises(ValueError, match="prompt is too long"):
        processor.process_inputs("r", text, SamplingParams(max_tokens=1))
    assert encoded == []


@pytest.mark.parametrize("field, value", [("n", 129), ("n", 10000), ("best_of", 10000)])
def test_n_and_best_of_over_the_cap_are_a_400(engine, field, value):
    app = build_app(engine, "m")
    body = {"prompt": "hi", "max_tokens": 1, field: value}
    err = assert_openai_error(send(app, "/v1/completions", json.dumps(body), {"content-type": "application/json"}), 400)
    assert err["param"] == field and "at most 128" in err["message"]


def test_n_over_the_cap_is_a_400_on_chat_too(engine):
    app = build_app(engine, "m")
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "n": 129}
    err = assert_openai_error(
        send(app, "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"}), 400
    )
    assert err["param"] == "n"
