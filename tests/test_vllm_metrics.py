"""/metrics carries the series vLLM dashboards read, with vLLM's names and buckets, fed by a real engine."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from vllm_lite.testing.openai_server import ServerThread

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    from vllm_lite.client.async_llm import AsyncLLM
    from vllm_lite.engine_args import EngineArgs

    srv = ServerThread(
        lambda: AsyncLLM.from_engine_args(
            EngineArgs(model=tiny_checkpoint, dtype="float32", max_model_len=256, device="cpu", block_size=16)
        ),
        served_model_name=MODEL,
    )
    yield srv
    srv.stop()


def scrape(server) -> dict[str, float]:
    text = httpx.get(server.base_url + "/metrics", timeout=60).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            values[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return values


def test_request_phase_histograms_and_step_counters_count_every_request(server):
    before = scrape(server)
    prompt = list(range(5, 5 + 40))  # two full blocks: the repeat hits the prefix cache
    n = 3
    for _ in range(n):
        r = httpx.post(
            server.base_url + "/v1/completions",
            json={"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True},
            timeout=120,
        )
        assert r.status_code == 200, r.text
    after = scrape(server)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    for phase in ("queue", "prefill", "decode", "inference"):
        assert delta(f"vllm:request_{phase}_time_seconds_count") == n, phase
        assert after[f"vllm:request_{phase}_time_seconds_bucket{{le=7680.0}}"] >= n  # vLLM's largest bucket
    assert delta("vllm:request_success_total{finished_reason=length}") == n
    assert delta("vllm:prefix_cache_queries_total") >= n * len(prompt) - n
    assert delta("vllm:prefix_cache_hits_total") >= 32  # the repeats reuse at least the two full blocks
    assert delta("vllm:iteration_tokens_total_count") >= n
    assert delta("vllm:iteration_tokens_total_sum") >= n * (len(prompt) + 4)
    assert "vllm:num_preemptions_total" in after


# Any one scrape under --api-server-count 2 sums both frontends: tests/test_serve_daemon.py's bundled-default
# daemon checks it (it runs two API servers anyway).
