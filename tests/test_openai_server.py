"""The OpenAI HTTP layer against a model-free fake engine (fast): shapes, rules, errors, metrics, health."""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import httpx
import pytest

import vllm_lite
from vllm_lite.client.exceptions import EngineDeadError
from vllm_lite.entrypoints.openai import health
from vllm_lite.entrypoints.openai.api_server import build_app
from vllm_lite.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from vllm_lite.entrypoints.openai.serving_completion import OpenAIServingCompletion
from vllm_lite.testing.checkpoints import get_checkpoint
from vllm_lite.testing.openai_fake_engine import FakeAsyncLLM, fake_logprob, fake_token
from vllm_lite.testing.openai_server import ServerThread
from vllm_lite.testing.waiting import async_wait_until, wait_until

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def ckpt() -> str:
    return get_checkpoint("llama")


@pytest.fixture
def engine(ckpt: str) -> FakeAsyncLLM:
    return FakeAsyncLLM(ckpt, max_model_len=128)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def call(app: Any, method: str, path: str, **kwargs: Any) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return await client.request(method, path, **kwargs)


def post(app: Any, path: str, body: Any, **kwargs: Any) -> httpx.Response:
    return run(call(app, "POST", path, json=body, **kwargs))


def sse_events(resp: httpx.Response) -> list[Any]:
    events = []
    for block in resp.text.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        data = block[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def assert_openai_error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["code"] == status
    return err


def expected_ids(engine: FakeAsyncLLM, prompt: str, n_tokens: int, j: int = 0) -> list[int]:
    ids = engine.tokenizer.encode(prompt)
    return [fake_token(ids, k, j) for k in range(n_tokens)]


# ---------------------------------------------------------------------------- completions


def test_completion_returns_generated_text_and_usage(engine: FakeAsyncLLM) -> None:
    app = build_app(engine, MODEL)
    resp = post(
        app, "/v1/completions", {"model": MODEL, "prompt": "Hello world", "max_tokens": 5, "return_token_ids": True}
    )
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["object"] == "text_completion" and body["model"] == MODEL and body["id"].startswith("cmpl-")
    want = expected_ids(engine, "Hello world", 5)
    (choice,) = body["choices"]
    assert choice["token_ids"] == want
    assert choice["text"] == engine.tokenizer.decode(want)
    assert choice["finish_reason"] == "length"
    n_prompt = len(engine.tokenizer.encode("Hello world"))
    assert body["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 5, "total_tokens": n_prompt + 5}


def test_completion_without_model_field_uses_served_model(engine: FakeAsyncLLM) -> None:
    resp = post(build_app(engine, MODEL), "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    assert resp.status_code == 200 and resp.json()["model"] == MODEL


def test_completion_prompt_list_and_n_index_choices_prompt_major(engine: FakeAsyncLLM) -> None:
    app = build_app(engine, MODEL)
    prompts = ["one two", "three"]
    resp = post(
        app,
        "/v1/completions",
        {"prompt": prompts, "n": 2, "max_tokens": 3, "temperature": 0.8, "return_token_ids": True},
    )
    assert resp.status_code == 200, resp.text
    choices = resp.json()["choices"]
    assert [c["index"] for c in choices] == list(range(4))
    prompt_ids = [engine.tokenizer.encode(p) for p in prompts]
    for c in choices:
        i, j = divmod(c["index"], 2)
        assert c["token_ids"] == [fake_token(prompt_ids[i], k, j) for k in range(3)]
        assert c["prompt_token_ids"] == prompt_ids[i]


@pytest.mark.parametrize("prompt", [[5, 6, 7], [[5, 6, 7], [11]]])
def test_completion_token_id_prompts_reach_the_engine_unchanged(engine: FakeAsyncLLM, prompt: list) -> None:
    resp = post(build_app(engine, MODEL), "/v1/completions", {"prompt": prompt, "max_tokens": 2})
    assert resp.status_code == 200, resp.text
    lists = prompt if isinstance(prompt[0], list) else [prompt]
    assert len(resp.json()["choices"]) == len(lists)
    assert sorted(p["prompt_token_ids"] for p, _ in engine.requests.values()) == sorted(lists)


def test_completion_logprobs_have_openai_parallel_lists(engine: FakeAsyncLLM) -> None:
    resp = post(build_app(engine, MODEL), "/v1/completions", {"prompt": "abc", "max_tokens": 4, "logprobs": 3})
    assert resp.status_code == 200, resp.text
    (choice,) = resp.json()["choices"]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 4
    assert lp["token_logprobs"] == pytest.approx([fake_logprob(k) for k in range(4)])
    assert all(len(top) == 3 for top in lp["top_logprobs"])
    assert "".join(lp["tokens"]) == choice["text"]
    offsets = [0]
    for tok in lp["tokens"][:-1]:
        offsets.append(offsets[-1] + len(tok))
    assert lp["text_offset"] == offsets


def test_completion_echo_prepends_prompt_and_its_logprobs(engine: FakeAsyncLLM) -> None:
    resp = post(
        build_app(engine, MODEL),
        "/v1/completions",
        {"prompt": "Hello world", "max_tokens": 2, "echo": True, "logprobs": 1},
    )
    assert resp.status_code == 200, resp.text
    (choice,) = resp.json()["choices"]
    gen_ids = expected_ids(engine, "Hello world", 2)
    assert choice["text"] == "Hello world" + engine.tokenizer.decode(gen_ids)
    prompt_ids = engine.tokenizer.encode("Hello world")
    n_prompt = len(prompt_ids)
    lp = choice["logprobs"]
    # The prompt's first token has no logprob; the fake gives prompt position p + 1 fake_logprob(p),
    # and generated token k fake_logprob(k).
    assert lp["token_logprobs"] == pytest.approx(
        [None] + [fake_logprob(p) for p in range(n_prompt - 1)] + [fake_logprob(0), fake_logprob(1)]
    )
    assert lp["top_logprobs"][0] is None
    all_ids = prompt_ids + gen_ids
    assert lp["tokens"][1:] == [engine.tokenizer.decode([t]) for t in all_ids[1:]]
    for tok, chosen, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
        assert top == pytest.approx({tok: chosen})  # logprobs=1: the chosen token is also the top one
    offsets = [0]
    for tok in lp["tokens"][:-1]:
        offsets.append(offsets[-1] + len(tok))
    assert lp["text_offset"] == offsets


def test_completion_echo_without_logprobs_streams_the_prompt_first(engine: FakeAsyncLLM) -> None:
    events = sse_events(
        post(
            build_app(engine, MODEL),
            "/v1/completions",
            {"prompt": "Hello world", "max_tokens": 3, "echo": True, "stream": True},
        )
    )
    assert events[-1] == "[DONE]"
    text = "".join(ev["choices"][0]["text"] for ev in events[:-1])
    assert text == "Hello world" + engine.tokenizer.decode(expected_ids(engine, "Hello world", 3))
    assert events[0]["choices"][0]["text"].startswith("Hello world")


def test_completion_best_of_reaches_the_engine_and_cannot_stream(engine: FakeAsyncLLM) -> None:
    app = build_app(engine, MODEL)
    resp = post(app, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "n": 1, "best_of": 3, "temperature": 1.0})
    assert resp.status_code == 200, resp.text
    ((_, params),) = engine.requests.values()
    assert (params.n, params.best_of, params.num_samples) == (1, 3, 3)
    err = assert_openai_error(post(app, "/v1/completions", {"prompt": "Hi", "n": 1, "best_of": 3, "stream": True}), 400)
    assert err["param"] == "best_of"
    err = assert_openai_error(post(app, "/v1/completions", {"prompt": "Hi", "best_of": 2, "temperature": 0}), 400)
    assert "best_of" in err["message"] and "greedy" in err["message"]
    assert len(engine.requests) == 1  # neither rejected request reached the engine


def test_completion_stream_deltas_join_to_full_text_and_usage_comes_last(engine: FakeAsyncLLM) -> None:
    app = build_app(engine, MODEL)
    body = {
        "prompt": "Hello",
        "max_tokens": 6,
        "n": 2,
        "stream": True,
        "temperature": 0.7,
        "stream_options": {"include_usage": True},
    }
    resp = post(app, "/v1/completions", body)
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = sse_events(resp)
    assert events[-1] == "[DONE]"
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 12
    texts = {0: "", 1: ""}
    finish = {}
    for ev in events[:-2]:
        assert ev["object"] == "text_completion" and ev["usage"] is None
        (c,) = ev["choices"]
        texts[c["index"]] += c["text"]
        if c["finish_reason"]:
            finish[c["index"]] = c["finish_reason"]
    for j in (0, 1):
        assert texts[j] == engine.tokenizer.decode(expected_ids(engine, "Hello", 6, j))
    assert finish == {0: "length", 1: "length"}


def test_completion_stream_without_include_usage_has_no_usage_chunk(engine: FakeAsyncLLM) -> None:
    events = sse_events(
        post(build_app(engine, MODEL), "/v1/completions", {"prompt": "Hello", "max_tokens": 3, "stream": True})
    )
    assert events[-1] == "[DONE]"
    assert all(ev["choices"] for ev in events[:-1])


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_stream_sends_the_tokens_that_arrived_with_a_failure_before_its_error_event(
    engine: FakeAsyncLLM, endpoint: str
) -> None:
    """A failure merged behind unread deltas (AsyncLLM's mailbox) must not swallow their tokens."""
    engine.fail_at_step = 2  # steps 0 and 1 stream normally; step 2's token arrives together with the error
    prompt = {"prompt": "Hello"} if endpoint == "/v1/completions" else {"messages": [{"role": "user", "content": "Hi"}]}
    body = {**prompt, "max_tokens": 6, "stream": True}
    events = sse_events(post(build_app(engine, MODEL), endpoint, body))
    assert events[-1] == "[DONE]" and set(events[-2]) == {"error"} and events[-2]["error"]["code"] == 500
    chunks = events[:-2]
    ((sent, _),) = engine.requests.values()
    ids = sent["prompt_token_ids"]
    if endpoint == "/v1/completions":
        text = "".join(c["choices"][0]["text"] for c in chunks)
    else:
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text == engine.tokenizer.decode([fake_token(ids, k, 0) for k in range(3)])
    # The failed choice ends with the error event, not with a finish_reason of its own.
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks)


# ---------------------------------------------------------------------------- chat


def test_chat_completion_renders_template_and_returns_assistant_message(engine: FakeAsyncLLM) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    resp = post(
        build_app(engine, MODEL),
        "/v1/chat/completions",
        {"model": MODEL, "messages": messages, "max_completion_tokens": 4},
    )
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    rendered = engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ((prompt, params),) = engine.requests.values()
    assert prompt["prompt"] == rendered
    assert prompt["prompt_token_ids"] == engine.tokenizer.encode(rendered, add_special_tokens=False)
    assert params.max_tokens == 4
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant"
    want = [fake_token(prompt["prompt_token_ids"], k, 0) for k in range(4)]
    assert choice["message"]["content"] == engine.tokenizer.decode(want)
    assert body["usage"]["prompt_tokens"] == len(prompt["prompt_token_ids"])


def test_chat_content_parts_are_joined(engine: FakeAsyncLLM) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert (
        post(build_app(engine, MODEL), "/v1/chat/completions", {"messages": messages, "max_tokens": 1}).status_code
        == 200
    )
    ((prompt, _),) = engine.requests.values()
    joined = [{"role": "user", "content": "a\nb"}]
    assert prompt["prompt"] == engine.tokenizer.apply_chat_template(joined, tokenize=False, add_generation_prompt=True)


def test_chat_image_content_part_is_400(engine: FakeAsyncLLM) -> None:
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    err = assert_openai_error(post(build_app(engine, MODEL), "/v1/chat/completions", {"messages": messages}), 400)
    assert "image_url" in err["message"]


def test_chat_default_max_tokens_is_rest_of_context(engine: FakeAsyncLLM) -> None:
    post(build_app(engine, MODEL), "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})
    ((prompt, params),) = engine.requests.values()
    assert params.max_tokens == 128 - len(prompt["prompt_token_ids"])


def test_chat_stream_role_first_then_content_then_usage(engine: FakeAsyncLLM) -> None:
    body = {
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 5,
        "n": 2,
        "stream": True,
        "temperature": 0.5,
        "stream_options": {"include_usage": True},
    }
    events = sse_events(post(build_app(engine, MODEL), "/v1/chat/completions", body))
    assert events[-1] == "[DONE]"
    assert [ev["choices"][0]["delta"] for ev in events[:2]] == [{"role": "assistant", "content": ""}] * 2
    assert sorted(ev["choices"][0]["index"] for ev in events[:2]) == [0, 1]
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 10
    ((prompt, _),) = engine.requests.values()
    for j in (0, 1):
        text = "".join(ev["choices"][0]["delta"]["content"] for ev in events[2:-2] if ev["choices"][0]["index"] == j)
        assert text == engine.tokenizer.decode([fake_token(prompt["prompt_token_ids"], k, j) for k in range(5)])
    assert all(ev["object"] == "chat.completion.chunk" for ev in events[:-1])


def test_chat_logprobs_content_has_token_bytes_and_top_logprobs(engine: FakeAsyncLLM) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "logprobs": True, "top_logprobs": 2}
    resp = post(build_app(engine, MODEL), "/v1/chat/completions", body)
    assert resp.status_code == 200, resp.text
    content = resp.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 3
    for k, item in enumerate(content):
        assert item["logprob"] == pytest.approx(fake_logprob(k))
        assert bytes(item["bytes"]).decode() == item["token"]
        assert len(item["top_logprobs"]) == 2
        assert item["top_logprobs"][0]["token"] == item["token"]  # rank 1 is the chosen token here
        assert item["top_logprobs"][0]["logprob"] >= item["top_logprobs"][1]["logprob"]


def test_chat_top_logprobs_without_logprobs_is_400(engine: FakeAsyncLLM) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "top_logprobs": 2}
    err = assert_openai_error(post(build_app(engine, MODEL), "/v1/chat/completions", body), 400)
    assert err["param"] == "top_logprobs"


# ---------------------------------------------------------------------------- rules and errors


@pytest.mark.parametrize(
    "extra, field",
    [
        ({"temperature": -1}, "temperature"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_p": 2.0}, "top_p"),
        ({"n": 0}, "n"),
        ({"presence_penalty": 5}, "presence_penalty"),
        ({"logprobs": 50}, "logprobs"),
        ({"temperature": "hot"}, "temperature"),  # pydantic type error: 400, not 422
        ({"stop_token_ids": [999999]}, "stop_token_ids"),
    ],
)
def test_bad_completion_params_are_400_with_openai_error_shape(engine: FakeAsyncLLM, extra: dict, field: str) -> None:
    resp = post(build_app(engine, MODEL), "/v1/completions", {"prompt": "Hi", **extra})
    err = assert_openai_error(resp, 400)
    assert err["type"] == "BadRequestError"
    assert field in err["message"]
    assert not engine.running


def test_bad_chat_params_are_400(engine: FakeAsyncLLM) -> None:
    resp = post(
        build_app(engine, MODEL),
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Hi"}], "temperature": -1, "stream": True},
    )
    assert "temperature" in assert_openai_error(resp, 400)["message"]


def test_missing_prompt_and_invalid_json_are_400(engine: FakeAsyncLLM) -> None:
    app = build_app(engine, MODEL)
    err = assert_openai_error(post(app, "/v1/completions", {"max_tokens": 3}), 400)
    assert err["param"] == "prompt"
    resp = run(call(app, "POST", "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}))
    assert_openai_error(resp, 400)


def test_too_long_prompt_is_400_and_names_the_lengths(engine: FakeAsyncLLM) -> None:
    app = build_app(engine, MODEL)
    err = assert_openai_error(post(app, "/v1/completions", {"prompt": [5] * 200, "max_tokens": 1}), 400)
    assert "200" in err["message"] and "128" in err["message"]
    err = assert_openai_error(post(app, "/v1/completions", {"prompt": [5] * 100, "max_tokens": 50}), 400)
    assert "150" in err["message"] and "128" in err["message"] and "100" in err["message"]


def test_unknown_model_is_404(engine: FakeAsyncLLM) -> None:
    app = build_app(engine, MODEL)
    for path, body in [
        ("/v1/completions", {"prompt": "x"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
    ]:
        err = assert_openai_error(post(app, path, {"model": "gpt-17", **body}), 404)
        assert "gpt-17" in err["message"] and err["type"] == "NotFoundError"


def test_unknown_route_is_404_with_openai_shape(engine: FakeAsyncLLM) -> None:
    assert_openai_error(run(call(build_app(engine, MODEL), "GET", "/v1/nothing")), 404)


def test_api_key_required_on_api_routes_but_not_on_probes(engine: FakeAsyncLLM) -> None:
    app = build_app(engine, MODEL, api_key="sekrit")
    body = {"prompt": "Hi", "max_tokens": 1}
    err = assert_openai_error(post(app, "/v1/completions", body), 401)
    assert err["type"] == "AuthenticationError"
    assert_openai_error(post(app, "/v1/completions", body, headers={"Authorization": "Bearer wrong"}), 401)
    assert_openai_error(run(call(app, "GET", "/v1/models")), 401)
    assert post(app, "/v1/completions", body, headers={"Authorization": "Bearer sekrit"}).status_code == 200
    assert run(call(app, "GET", "/health")).status_code == 200
    assert run(call(app, "GET", "/metrics")).status_code == 200


def test_dead_engine_gives_503_and_fires_on_engine_dead(engine: FakeAsyncLLM) -> None:
    reasons: list[str] = []
    app = build_app(engine, MODEL, on_engine_dead=reasons.append)
    assert run(call(app, "GET", "/health")).status_code == 200
    engine.errored = True
    assert_openai_error(post(app, "/v1/completions", {"prompt": "Hi"}), 503)
    assert_openai_error(run(call(app, "GET", "/health")), 503)
    assert len(reasons) == 1 and app.state.engine_dead


def test_engine_dying_mid_request_is_503(engine: FakeAsyncLLM) -> None:
    app = build_app(engine, MODEL)

    async def dying(*args: Any, **kwargs: Any):
        await asyncio.sleep(0)
        engine.errored = True
        raise EngineDeadError()
        yield  # an async generator, like AsyncLLM.generate

    engine.generate = dying  # type: ignore[method-assign]
    assert_openai_error(post(app, "/v1/completions", {"prompt": "Hi", "max_tokens": 4}), 503)
    assert app.state.engine_dead


class _Clock:
    """A monotonic clock the test moves by hand, so 'no step for longer than the limit' needs no waiting."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def test_health_is_503_when_requests_pend_and_no_step_finishes(engine: FakeAsyncLLM, monkeypatch) -> None:
    clock = _Clock()
    monkeypatch.setattr(health, "time", clock)
    app = build_app(engine, MODEL, health_stuck_timeout_s=5.0)

    async def scenario() -> tuple[int, int, int]:
        first = (await call(app, "GET", "/health")).status_code
        engine.stuck = True
        await call(app, "GET", "/health")  # sees pending work at this step count
        clock.now += 4.9
        assert (await call(app, "GET", "/health")).status_code == 200  # within the limit
        clock.now += 0.2
        stuck = await call(app, "GET", "/health")
        engine.step_counter += 1  # progress again
        recovered = (await call(app, "GET", "/health")).status_code
        assert "stuck" in stuck.json()["error"]["message"]
        return first, stuck.status_code, recovered

    assert run(scenario()) == (200, 503, 200)


def test_stream_closed_early_aborts_the_request(engine: FakeAsyncLLM) -> None:
    engine.hang = True
    serving = OpenAIServingCompletion(engine, [MODEL])

    async def scenario() -> None:
        resp = await serving.create_completion(CompletionRequest(prompt="Hi", stream=True, max_tokens=5))
        it = resp.body_iterator
        task = asyncio.ensure_future(it.__anext__())
        await async_wait_until(lambda: engine.running, 30, "the request reaches the engine")
        task.cancel()  # what Starlette does when the client goes away
        with pytest.raises(asyncio.CancelledError):
            await task
        await async_wait_until(lambda: engine.aborted and not engine.running, 30, "the request is aborted")

    run(scenario())
    assert len(engine.aborted) == 1 and engine.aborted[0].startswith("cmpl-")
    assert not engine.running


def test_non_streaming_disconnect_aborts_the_request(engine: FakeAsyncLLM) -> None:
    engine.hang = True
    serving = OpenAIServingCompletion(engine, [MODEL])

    class GoneClient:
        async def is_disconnected(self) -> bool:
            return True

    async def scenario() -> Any:
        return await asyncio.wait_for(
            serving.create_completion(CompletionRequest(prompt=["a", "b"], max_tokens=5), GoneClient()), 5
        )

    resp = run(scenario())
    assert sorted(engine.aborted) == sorted(f"{resp.id}-{i}" for i in range(2))
    assert {c.finish_reason for c in resp.choices} == {"abort"}


# ---------------------------------------------------------------------------- misc endpoints


def test_models_version_tokenize_detokenize(engine: FakeAsyncLLM) -> None:
    app = build_app(engine, [MODEL, "alias"])
    models = run(call(app, "GET", "/v1/models")).json()
    assert [m["id"] for m in models["data"]] == [MODEL, "alias"] and models["data"][0]["max_model_len"] == 128
    assert run(call(app, "GET", "/version")).json()["version"] == vllm_lite.__version__
    tok = post(app, "/tokenize", {"prompt": "Hello world"}).json()
    assert tok["tokens"] == engine.tokenizer.encode("Hello world") and tok["count"] == len(tok["tokens"])
    assert tok["max_model_len"] == 128
    chat_tok = post(app, "/tokenize", {"messages": [{"role": "user", "content": "Hi"}]}).json()
    rendered = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat_tok["tokens"] == engine.tokenizer.encode(rendered, add_special_tokens=False)
    detok = post(app, "/detokenize", {"tokens": tok["tokens"][1:]}).json()
    assert detok["prompt"] == "Hello world"
    assert_openai_error(post(app, "/detokenize", {"tokens": [10**6]}), 400)
    assert post(app, "/v1/completions", {"model": "alias", "prompt": "x", "max_tokens": 1}).status_code == 200


def test_metrics_count_tokens_finish_reasons_and_engine_gauges(engine: FakeAsyncLLM) -> None:
    app = build_app(engine, MODEL)
    post(app, "/v1/completions", {"prompt": "Hello world", "max_tokens": 3})
    post(app, "/v1/completions", {"prompt": "Hello", "max_tokens": 2, "stream": True})
    text = run(call(app, "GET", "/metrics")).text

    def value(line_start: str) -> float:
        (line,) = [ln for ln in text.splitlines() if ln.startswith(line_start)]
        return float(line.rsplit(" ", 1)[1])

    label = f'{{model_name="{MODEL}"}}'
    n_prompt = len(engine.tokenizer.encode("Hello world")) + len(engine.tokenizer.encode("Hello"))
    assert value(f"vllm:prompt_tokens_total{label}") == n_prompt
    assert value(f"vllm:generation_tokens_total{label}") == 5
    assert value(f'vllm:request_success_total{{finished_reason="length",model_name="{MODEL}"}}') == 2
    assert value(f"vllm:time_to_first_token_seconds_count{label}") == 2
    assert value(f"vllm:e2e_request_latency_seconds_count{label}") == 2
    # One observation each: the whole request's mean gap (3 tokens, final only) and the stream's second token.
    assert value(f"vllm:inter_token_latency_seconds_count{label}") == 2
    assert value(f"vllm:kv_cache_usage_perc{label}") == 0.25


def test_protocol_builds_sampling_params_with_vllm_extensions() -> None:
    req = ChatCompletionRequest(
        messages=[{"role": "user", "content": "x"}],
        top_k=5,
        min_p=0.1,
        repetition_penalty=1.2,
        seed=3,
        stop=["\n"],
        ignore_eos=True,
        temperature=0.3,
    )
    sp = req.build_sampling_params(max_tokens=7, logprobs=None, prompt_logprobs=None, defaults=None, stream=False)
    assert (sp.top_k, sp.min_p, sp.repetition_penalty, sp.seed, sp.stop, sp.ignore_eos, sp.max_tokens) == (
        5,
        0.1,
        1.2,
        3,
        ["\n"],
        True,
        7,
    )
    with pytest.raises(ValueError, match="stream_options"):
        CompletionRequest(prompt="x", stream_options={"include_usage": True}).build_sampling_params(
            max_tokens=1, logprobs=None, prompt_logprobs=None, defaults=None, stream=False
        )


# ---------------------------------------------------------------------------- a real uvicorn, still model-free


def test_live_server_disconnect_while_queued_aborts_the_request(ckpt: str) -> None:
    srv = ServerThread(lambda: _hanging_engine(ckpt), served_model_name=MODEL)
    try:
        for stream in (True, False):
            before = len(srv.engine.aborted)
            body = json.dumps({"prompt": "Hi", "max_tokens": 5, "stream": stream}).encode()
            head = (
                f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n"
            ).encode()
            # A raw connection, closed only once the request is known to be in the engine.
            with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as conn:
                conn.sendall(head + body)
                wait_until(lambda: srv.engine.running, 30, "the request reaches the engine")
            wait_until(
                lambda before=before: len(srv.engine.aborted) > before and not srv.engine.running,
                30,
                "the server aborts the request of the client that left",
            )
    finally:
        srv.stop()


def _hanging_engine(ckpt: str) -> FakeAsyncLLM:
    engine = FakeAsyncLLM(ckpt, max_model_len=128)
    engine.hang = True
    return engine


def test_vllm_lite_cli_has_api_server_subcommand_with_engine_args(ckpt: str) -> None:
    from vllm_lite.entrypoints.cli import build_parser
    from vllm_lite.entrypoints.openai.cli_args import engine_args_from_cli

    parser, by_name = build_parser()
    args = parser.parse_args(
        [
            "api-server",
            "--model",
            ckpt,
            "--port",
            "9123",
            "--api-key",
            "k",
            "--served-model-name",
            "a",
            "b",
            "--max-model-len",
            "64",
            "--no-enable-prefix-caching",
        ]
    )
    run_api_server = by_name["api-server"].run
    assert args.func == run_api_server
    assert (args.port, args.api_key, args.served_model_name) == (9123, "k", ["a", "b"])
    ea = engine_args_from_cli(args)
    assert (ea.model, ea.max_model_len, ea.enable_prefix_caching, ea.served_model_name) == (ckpt, 64, False, "a")
    with pytest.raises(ValueError, match="--model"):
        run_api_server(parser.parse_args(["api-server"]))
