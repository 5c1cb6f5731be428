"""The official `openai` client against a live server (real AsyncLLM, tiny random checkpoint).

Greedy results must equal offline `LLM(..., multiprocess=False).generate` on
the same prompts; the rules (401/400/404), client disconnects (request aborted,
KV blocks freed) and engine death (503, exit code 1; an api-server attached by address stays up and
re-attaches) are checked end to end.
"""

from __future__ import annotations

import os
import signal

import httpx
import openai
import pytest

from vllm_lite.testing.checkpoints import get_checkpoint
from vllm_lite.testing.openai_server import ServerProcess, ServerThread
from vllm_lite.testing.waiting import wait_until

MODEL = "tiny-llama"
API_KEY = "test-key"
MAX_MODEL_LEN = 256
ENGINE_KW = dict(dtype="float32", max_model_len=MAX_MODEL_LEN, seed=0)
PROMPTS = ["Hello world", "The quick brown fox", "def main():"]
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
# n=2 seeded: sample j draws with seed + j; 8 tokens from a random-weight model's near-uniform
# distribution over its vocabulary, so two samples that agree mean one seed was used twice.
SAMPLED = dict(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt() -> str:
    return get_checkpoint("llama")


@pytest.fixture(scope="module")
def reference(ckpt: str) -> dict:
    """Offline greedy outputs: completions of PROMPTS and of the rendered chat prompt."""
    from vllm_lite import LLM, SamplingParams

    llm = LLM(model=ckpt, multiprocess=False, **ENGINE_KW)
    try:
        tok = llm.get_tokenizer()
        chat_text = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
        chat_ids = tok.encode(chat_text, add_special_tokens=False)
        sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
        outs = llm.generate(PROMPTS + [{"prompt_token_ids": chat_ids}], sp, use_tqdm=False)
        (sampled,) = llm.generate("Once", SamplingParams(n=2, **SAMPLED), use_tqdm=False)
        (chat_sampled,) = llm.generate({"prompt_token_ids": chat_ids}, SamplingParams(n=2, **SAMPLED), use_tqdm=False)
    finally:
        llm.shutdown()
    return {
        "completions": [(o.outputs[0].token_ids, o.outputs[0].text) for o in outs[:-1]],
        "chat": (outs[-1].outputs[0].token_ids, outs[-1].outputs[0].text),
        # Per position: the chosen token's logprob and the top-3 {token id: logprob}.
        "logprobs": [[{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs] for o in outs],
        "sampled": [list(c.token_ids) for c in sampled.outputs],
        "chat_sampled": [c.text for c in chat_sampled.outputs],
    }


@pytest.fixture(scope="module")
def server(ckpt: str):
    from vllm_lite.client.async_llm import AsyncLLM
    from vllm_lite.engine_args import EngineArgs

    srv = ServerThread(
        lambda: AsyncLLM.from_engine_args(EngineArgs(model=ckpt, **ENGINE_KW)),
        served_model_name=MODEL,
        api_key=API_KEY,
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


GREEDY = dict(temperature=0, max_tokens=12, extra_body={"ignore_eos": True, "return_token_ids": True})


# ---------------------------------------------------------------------------- results equal offline generate


def test_greedy_completions_equal_offline_generate(client: openai.OpenAI, reference: dict) -> None:
    resp = client.completions.create(model=MODEL, prompt=PROMPTS, **GREEDY)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    for choice, (ids, text) in zip(resp.choices, reference["completions"]):
        assert choice.model_extra["token_ids"] == ids
        assert choice.text == text
        assert choice.finish_reason == "length"
    assert resp.usage.completion_tokens == 36


def test_streamed_completion_equals_offline_generate_and_ends_with_usage(
    client: openai.OpenAI, reference: dict
) -> None:
    stream = client.completions.create(
        model=MODEL, prompt=PROMPTS[1], stream=True, stream_options={"include_usage": True}, **GREEDY
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    ids = [t for c in chunks if c.choices for t in c.choices[0].model_extra["token_ids"]]
    assert (ids, text) == tuple(reference["completions"][1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-2].choices[0].finish_reason == "length"


def test_greedy_chat_equals_offline_generate_on_rendered_prompt(client: openai.OpenAI, reference: dict) -> None:
    resp = client.chat.completions.create(model=MODEL, messages=CHAT, **GREEDY)
    ids, text = reference["chat"]
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == text
    assert resp.choices[0].model_extra["token_ids"] == ids


def test_streamed_chat_equals_offline_generate_and_ends_with_usage(client: openai.OpenAI, reference: dict) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=CHAT, stream=True, stream_options={"include_usage": True}, **GREEDY
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reference["chat"][1]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens > 0


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_truncates_the_text_and_reports_it(client: openai.OpenAI, reference: dict, stream: bool) -> None:
    full = reference["completions"][2][1]
    stop = full.strip()[len(full.strip()) // 2 :][:2]
    assert stop and stop.strip(), f"reference text too short: {full!r}"
    expected = full[: full.find(stop)]
    kwargs = dict(
        model=MODEL, prompt=PROMPTS[2], temperature=0, max_tokens=12, stop=[stop], extra_body={"ignore_eos": True}
    )
    if stream:
        chunks = [c for c in client.completions.create(stream=True, **kwargs) if c.choices]
        text = "".join(c.choices[0].text for c in chunks)
        last = chunks[-1].choices[0]
    else:
        last = client.completions.create(**kwargs).choices[0]
        text = last.text
    assert text == expected
    assert last.finish_reason == "stop" and last.model_extra["stop_reason"] == stop


# ---------------------------------------------------------------------------- n, logprobs


def test_n2_seeded_sampling_gives_two_different_samples_equal_to_offline(
    client: openai.OpenAI, reference: dict
) -> None:
    kwargs = dict(
        model=MODEL,
        prompt="Once",
        n=2,
        temperature=1.0,
        seed=7,
        max_tokens=8,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    resp = client.completions.create(**kwargs)
    assert [c.index for c in resp.choices] == [0, 1]
    ids = [c.model_extra["token_ids"] for c in resp.choices]
    assert ids == reference["sampled"]  # sample j is offline sample j: same seeds, same draws
    assert ids[0] != ids[1]  # each sample has its own seed
    assert resp.usage.completion_tokens == 16
    again = client.completions.create(**kwargs)
    assert [c.model_extra["token_ids"] for c in again.choices] == ids  # seeded: reproducible
    chat = client.chat.completions.create(
        model=MODEL, messages=CHAT, n=2, max_tokens=8, temperature=1.0, seed=7, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in chat.choices] == [0, 1]
    assert [c.message.content for c in chat.choices] == reference["chat_sampled"]
    assert chat.choices[0].message.content != chat.choices[1].message.content


def _token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


def test_completion_logprobs_equal_offline_logprobs(client: openai.OpenAI, reference: dict, ckpt: str) -> None:
    from vllm_lite.client.tokenizer import get_tokenizer

    tok = get_tokenizer(ckpt)
    resp = client.completions.create(model=MODEL, prompt=PROMPTS[0], logprobs=3, **GREEDY)
    lp = resp.choices[0].logprobs
    ids, _ = reference["completions"][0]
    offline = reference["logprobs"][0]
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 12
    assert lp.tokens == [_token_text(tok, t) for t in ids]
    # Offline ran in-process, the server's core in its own process: float32 kernels may round an ulp apart.
    assert lp.token_logprobs == pytest.approx([step[t] for step, t in zip(offline, ids)], abs=1e-5)
    for top, step in zip(lp.top_logprobs, offline):
        # Greedy picks the top token, so the top-3 hold the chosen one: exactly 3 entries.
        assert top == pytest.approx({_token_text(tok, t): v for t, v in step.items()}, abs=1e-5)


def test_chat_logprobs_equal_offline_logprobs(client: openai.OpenAI, reference: dict) -> None:
    resp = client.chat.completions.create(model=MODEL, messages=CHAT, logprobs=True, top_logprobs=2, **GREEDY)
    content = resp.choices[0].logprobs.content
    ids, _ = reference["chat"]
    offline = reference["logprobs"][-1]
    assert len(content) == 12
    for item, step, t in zip(content, offline, ids):
        assert item.logprob == pytest.approx(step[t], abs=1e-5)
        best_two = sorted(step.values(), reverse=True)[:2]
        assert [x.logprob for x in item.top_logprobs] == pytest.approx(best_two, abs=1e-5)
        assert item.top_logprobs[0].token == item.token  # greedy: the chosen token ranks first


# ---------------------------------------------------------------------------- rules


def test_missing_or_wrong_api_key_is_401(server: ServerThread) -> None:
    bad = openai.OpenAI(base_url=server.base_url + "/v1", api_key="wrong-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    r = httpx.post(server.base_url + "/v1/completions", json={"model": MODEL, "prompt": "Hi"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(temperature=-1), "temperature"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(top_p=0.0), "top_p"),
    ],
)
def test_bad_params_are_400(client: openai.OpenAI, kwargs: dict, needle: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="Hi", **kwargs)
    assert e.value.status_code == 400 and needle in e.value.message
    assert e.value.body["type"] == "BadRequestError"


def test_too_long_prompt_is_400_naming_lengths(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=[5] * (MAX_MODEL_LEN + 10), max_tokens=2)
    assert str(MAX_MODEL_LEN + 10) in e.value.message and str(MAX_MODEL_LEN) in e.value.message


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=CHAT, max_tokens=2)


def test_models_lists_the_served_name(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_client_disconnect_mid_stream_aborts_the_request_and_frees_blocks(server: ServerThread) -> None:
    engine = server.engine
    total = server.call(lambda: engine.call_utility_async("get_num_total_blocks"))
    body = {
        "model": MODEL,
        "prompt": "Tell me a long story",
        "max_tokens": MAX_MODEL_LEN - 20,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", server.base_url + "/v1/completions", json=body, headers=headers) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            got = [line for line, _ in zip(lines, range(6)) if line.startswith("data: ")]
            assert got

    # The connection is closed with most of the 236 tokens still to go.
    def drained() -> bool:
        unfinished = server.call(lambda: engine.call_utility_async("get_num_unfinished_requests"))
        free = server.call(lambda: engine.call_utility_async("get_num_free_blocks"))
        return (unfinished, free) == (0, total)

    wait_until(drained, 60, "the abandoned request is aborted and its blocks freed", interval_s=0.1)
    text = httpx.get(server.base_url + "/metrics").text
    assert 'vllm:request_success_total{finished_reason="abort",model_name="tiny-llama"}' in text


def test_health_and_metrics_are_public(server: ServerThread) -> None:
    assert httpx.get(server.base_url + "/health").status_code == 200
    text = httpx.get(server.base_url + "/metrics").text
    assert "vllm:num_requests_running" in text and "vllm:kv_cache_usage_perc" in text


# ---------------------------------------------------------------------------- engine death


def test_killed_core_gives_503_and_the_server_exits_nonzero(ckpt: str) -> None:
    srv = ServerProcess(
        [
            "--model",
            ckpt,
            "--served-model-name",
            MODEL,
            "--dtype",
            "float32",
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--engine-dead-grace",
            "2",
        ]
    )
    try:
        r = httpx.post(srv.base_url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200
        (core,) = srv.core_pids()
        os.kill(core, signal.SIGKILL)

        def health_503() -> bool:
            return httpx.get(srv.base_url + "/health", timeout=5).status_code == 503

        # --engine-dead-grace 2: the server answers 503 for 2 s before it exits.
        wait_until(health_503, 60, "/health reports the dead engine", interval_s=0.05)
        assert srv.proc.wait(60) == 1
    finally:
        srv.kill()


# ---------------------------------------------------------------------------- attaching to a running core


def _health(url: str) -> int:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code
    except httpx.TransportError:
        return 0  # not listening any more


def test_api_server_attaches_to_a_running_core_survives_its_death_with_503_reattaches_and_leaves_it_running(
    reference: dict, tmp_path
) -> None:
    """`api-server --engine ADDRESS` serves offline-equal outputs from a core it did not start; when the core is
    killed it stays up with /health 503 (as `serve`'s frontends do), re-attaches when a core answers at the same
    address, and a clean stop (exit 0) leaves that core running for other frontends."""
    from vllm_lite.endpoints import CoreAddresses
    from vllm_lite.testing.core_at_address import start_core_at

    token = "core-token"
    deadline_s = 120.0
    base = f"ipc://{tmp_path}/core"
    addresses = CoreAddresses.from_base(base)
    core = start_core_at(addresses, auth_token=token, **ENGINE_KW)
    srv = None
    try:
        srv = ServerProcess(["--engine", base, "--auth-token", token, "--served-model-name", MODEL])
        url = srv.base_url
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)

        def completes_like_offline() -> None:
            resp = client.completions.create(model=MODEL, prompt=PROMPTS[0], **GREEDY)
            got = (resp.choices[0].model_extra["token_ids"], resp.choices[0].text)
            assert got == tuple(reference["completions"][0])

        completes_like_offline()
        os.kill(core.pid, signal.SIGKILL)
        core.wait(deadline_s)
        wait_until(lambda: _health(url) == 503, deadline_s, "/health says 503 after the core died", interval_s=0.2)
        body = {"model": MODEL, "prompt": "The for statement", "max_tokens": 3, "temperature": 0.0}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=deadline_s).status_code == 503
        assert srv.proc.poll() is None  # still up

        core = start_core_at(addresses, auth_token=token, **ENGINE_KW)  # same address: the server says HELLO again
        wait_until(lambda: _health(url) == 200, deadline_s, "/health says 200 again", interval_s=0.2)
        assert srv.proc.poll() is None  # it stayed up the whole time, well past --engine-dead-grace (1 s)
        completes_like_offline()
        assert srv.terminate() == 0  # attached again, a clean stop is exit code 0
        assert core.is_alive()  # the core serves other frontends; the server only detached
    finally:
        if srv is not None:
            srv.kill()
        core.stop()
