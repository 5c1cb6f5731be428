"""A served completion's prefill computes only its sampling row past the last attention (models/decoder.py).

The row selection (GPUModelRunner._logits_rows) is skipped for requests that read every row (prompt logprobs,
...), so whether it fires in serving depends on the sampling parameters the HTTP layer builds. This sends the
exact body `vllm bench serve` sends (random dataset, openai backend: prompt text, max_tokens, logprobs null,
repetition_penalty 1.0, ignore_eos, streamed with usage) through the real /v1/completions handler, takes the
request that reached the engine, and runs it in a bfloat16 engine core: the prefill's first-layer MLP and output
projection see every prompt token, the last layer's only the row that samples. Also: `echo` with `logprobs` (prompt logprobs)
keeps every row, so the check is not vacuous.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from vllm_lite.entrypoints.openai.api_server import build_app
from vllm_lite.testing.checkpoints import get_checkpoint
from vllm_lite.testing.core_harness import make_request, tiny_engine_core, unique_id
from vllm_lite.testing.openai_fake_engine import FakeAsyncLLM

MODEL = "tiny-llama"
PROMPT = "the quick brown fox jumps over the lazy dog and keeps running far away from here"


def _bench_body(**extra: Any) -> dict[str, Any]:
    """vLLM 0.32's `vllm bench serve` completions payload (benchmarks/lib/endpoint_request_func.py)."""
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "repetition_penalty": 1.0,
        "max_tokens": 3,
        "logprobs": None,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    body.update(extra)
    return body


def _served_request(body: dict[str, Any]) -> tuple[list[int], Any]:
    """The prompt token ids and sampling params that /v1/completions hands the engine for `body`."""
    engine = FakeAsyncLLM(get_checkpoint("llama"), max_model_len=128)
    app = build_app(engine, MODEL)

    async def post() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post("/v1/completions", json=body)

    resp = asyncio.run(post())
    assert resp.status_code == 200, resp.text
    ((prompt, params),) = engine.requests.values()
    return list(prompt["prompt_token_ids"]), params


@pytest.fixture(scope="module")
def core() -> Any:
    return tiny_engine_core(dtype="bfloat16", num_threads=1, enable_prefix_caching=False)


def _prefill_mlp_rows(core: Any, prompt: list[int], params: Any) -> tuple[int, int]:
    """Rows reaching the first and the last layer's MLP in the request's prefill step (the attention's output
    projection of each layer sees the same rows as its MLP: checked here)."""
    layers = core.executor.worker.model_runner.model.model.layers
    seen: dict[str, list[int]] = {"first": [], "last": [], "o_first": [], "o_last": []}

    def rec(key: str) -> Any:
        return lambda m, a: seen[key].append(a[0].shape[0])

    hooks = [
        layers[0].mlp.register_forward_pre_hook(rec("first")),
        layers[-1].mlp.register_forward_pre_hook(rec("last")),
        layers[0].self_attn.o_proj.register_forward_pre_hook(rec("o_first")),
        layers[-1].self_attn.o_proj.register_forward_pre_hook(rec("o_last")),
    ]
    try:
        core.add_request(make_request(unique_id("served"), prompt, params))
        core.step()
        while core.has_unfinished_requests():
            core.step()
    finally:
        for h in hooks:
            h.remove()
    assert (seen["o_first"][0], seen["o_last"][0]) == (seen["first"][0], seen["last"][0])
    return seen["first"][0], seen["last"][0]


def test_a_vllm_bench_serve_request_computes_one_row_past_the_last_attention(core):
    prompt, params = _served_request(_bench_body())
    assert len(prompt) > 8 and params.prompt_logprobs is None
    first, last = _prefill_mlp_rows(core, prompt, params)
    assert first == len(prompt)  # the whole prompt runs through every layer's attention and the first MLP
    assert last == 1  # past the last attention: only the token that samples


def test_a_served_request_with_prompt_logprobs_keeps_every_row(core):
    prompt, params = _served_request(_bench_body(stream=False, stream_options=None, echo=True, logprobs=1))
    assert params.prompt_logprobs is not None
    first, last = _prefill_mlp_rows(core, prompt, params)
    assert first == last == len(prompt)
