"""lm-evaluation-harness's `local-completions` request shapes against the real server and engine:
log-likelihood (echo + logprobs + max_tokens 0) and greedy generate-until return what it reads."""

from __future__ import annotations

import httpx
import pytest

from vllm_lite.sampling_params import SamplingParams
from vllm_lite.testing.openai_server import ServerThread

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    from vllm_lite.client.async_llm import AsyncLLM
    from vllm_lite.engine_args import EngineArgs

    srv = ServerThread(
        lambda: AsyncLLM.from_engine_args(
            EngineArgs(model=tiny_checkpoint, dtype="float32", max_model_len=256, device="cpu")
        ),
        served_model_name=MODEL,
    )
    yield srv
    srv.stop()


def _offline(server, prompt, params: SamplingParams):
    async def run():
        final = None
        async for out in server.engine.generate(prompt, params, f"oracle-{id(params)}"):
            final = out
        return final

    return server.call(run, timeout_s=120)


def test_loglikelihood_request_scores_the_continuation(server):
    context, continuation = [5, 17, 29, 41, 53, 65], [77, 89, 101]
    body = {
        "model": MODEL,
        "prompt": [context + continuation],
        "max_tokens": 0,
        "temperature": 0,
        "logprobs": 1,
        "echo": True,
        "seed": 1234,
    }
    resp = httpx.post(server.base_url + "/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    (choice,) = resp.json()["choices"]
    lp = choice["logprobs"]
    # lm-eval: sum(token_logprobs[ctxlen:]) is the log-likelihood; is_greedy compares top_logprobs' argmax.
    assert len(lp["token_logprobs"]) == len(context) + len(continuation)
    oracle = _offline(
        server,
        {"prompt_token_ids": context + continuation},
        SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0.0),
    )
    expected = [oracle.prompt_logprobs[i][t].logprob for i, t in enumerate(context + continuation) if i > 0]
    assert lp["token_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx(expected, abs=1e-4)
    for i, t in enumerate(continuation, start=len(context)):
        top_text, top_lp = max(lp["top_logprobs"][i].items(), key=lambda kv: kv[1])
        greedy_id, greedy = max(oracle.prompt_logprobs[i].items(), key=lambda kv: kv[1].logprob)
        assert top_lp == pytest.approx(greedy.logprob, abs=1e-4)
        # lm-eval's is_greedy: the top alternative's text is the continuation token's text.
        assert (top_text == lp["tokens"][i]) == (greedy_id == t)
    assert resp.json()["usage"]["completion_tokens"] == 0


def test_greedy_until_request_stops_at_the_stop_sequence(server):
    prompt = "The for statement"
    full = _offline(server, prompt, SamplingParams(max_tokens=24, temperature=0.0)).outputs[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 2]  # a sequence the greedy text contains
    assert stop.strip(), f"degenerate greedy text {full!r}"
    body = {"model": MODEL, "prompt": [prompt], "max_tokens": 24, "temperature": 0, "stop": [stop], "seed": 1234}
    resp = httpx.post(server.base_url + "/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    (choice,) = resp.json()["choices"]
    assert choice["text"] == full[: full.index(stop)]
    assert choice["finish_reason"] == "stop"
