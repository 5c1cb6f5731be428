"""Errors that are the server's, not the client's, never leak internals: an exception inside a handler, or a
request the engine core finished with an error (after tokens, streamed or not), is a generic OpenAI-style 500
whose message carries only an error id; the log line carries the same id with the real message and traceback.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import Any, AsyncGenerator

import httpx
import pytest

from vllm_lite.entrypoints.openai.api_server import build_app
from vllm_lite.outputs import RequestOutput
from vllm_lite.sampling_params import SamplingParams
from vllm_lite.testing.checkpoints import get_checkpoint
from vllm_lite.testing.openai_fake_engine import FakeAsyncLLM

MODEL = "tiny"
SECRET = "KeyError: '/srv/secret/path' in worker/model_runner.py line 42"
ERROR_ID = re.compile(r"err-[0-9a-f]{16}")


class FailingEngine(FakeAsyncLLM):
    """`mode` "raise": generate raises before any output; "error_output": after some tokens the final output
    carries an engine error (what the core sends when it finishes a request with FinishReason.ERROR)."""

    mode = "raise"

    async def generate(
        self, prompt: Any, sampling_params: SamplingParams, request_id: str, priority: int = 0
    ) -> AsyncGenerator[RequestOutput, None]:
        if self.mode == "raise":
            raise RuntimeError(SECRET)
        last = None
        async for out in super().generate(prompt, sampling_params, request_id, priority):
            if out.finished:
                last = out
                break
            yield out
        assert last is not None
        last.error = SECRET
        yield last


@pytest.fixture(scope="module")
def engine() -> FailingEngine:
    return FailingEngine(get_checkpoint("llama"), max_model_len=128)


def post(engine: FailingEngine, path: str, body: dict[str, Any]) -> httpx.Response:
    app = build_app(engine, MODEL)

    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.post(path, json={"model": MODEL, "max_tokens": 4, **body})

    return asyncio.run(go())


def assert_generic(error: dict[str, Any], caplog: pytest.LogCaptureFixture, *, traceback: bool) -> None:
    """The body names no internals; one log record has the body's error id, the real message (and traceback)."""
    assert error["code"] == 500 and error["type"] == "InternalServerError", error
    assert "SECRET" not in error["message"] and "secret" not in error["message"] and "Error:" not in error["message"]
    found = ERROR_ID.search(error["message"])
    assert found, error["message"]
    records = [r for r in caplog.records if found.group() in r.getMessage()]
    assert len(records) == 1 and SECRET in records[0].getMessage()
    assert records[0].levelno == logging.ERROR
    assert (records[0].exc_info is not None) == traceback


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ],
)
def test_exception_in_handler_is_generic_500_with_logged_traceback(engine, caplog, path, body) -> None:
    engine.mode = "raise"
    with caplog.at_level(logging.ERROR):
        resp = post(engine, path, body)
    assert resp.status_code == 500, resp.text
    assert SECRET not in resp.text and "RuntimeError" not in resp.text
    assert_generic(resp.json()["error"], caplog, traceback=True)


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ],
)
def test_engine_error_after_tokens_is_generic_500(engine, caplog, path, body) -> None:
    engine.mode = "error_output"
    with caplog.at_level(logging.ERROR):
        resp = post(engine, path, body)
    assert resp.status_code == 500, resp.text
    assert SECRET not in resp.text
    assert_generic(resp.json()["error"], caplog, traceback=False)


def test_streamed_engine_error_is_a_generic_error_event(engine, caplog) -> None:
    engine.mode = "error_output"
    with caplog.at_level(logging.ERROR):
        resp = post(engine, "/v1/completions", {"prompt": "hi", "stream": True})
    assert resp.status_code == 200
    events = [line[len("data: ") :] for line in resp.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and SECRET not in resp.text
    assert_generic(json.loads(events[-2])["error"], caplog, traceback=True)
