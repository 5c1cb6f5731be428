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


def test_a_scrape_under_two_api_servers_counts_every_request(tiny_checkpoint):
    """Two HTTP frontend processes share the port; any one scrape sums both (prometheus multiprocess mode)."""
    import os

    from vllm_lite.testing.serve_process import ServeProcess

    env = {k: v for k, v in os.environ.items() if k not in ("PROMETHEUS_MULTIPROC_DIR", "VLLM_LITE_API_KEY")}
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    srv = ServeProcess(
        [
            tiny_checkpoint,
            "--port",
            "0",
            "--core-port",
            "0",
            "--api-server-count",
            "2",
            "--num-threads",
            "1",
            "--max-model-len",
            "256",
            "--served-model-name",
            MODEL,
        ],
        env,
    )
    try:
        base = srv.api_base()
        sent = 8
        for i in range(sent):  # a fresh connection each: the kernel spreads them over both frontends
            with httpx.Client(base_url=base, timeout=120) as client:
                r = client.post("/v1/completions", json={"prompt": f"Request {i}", "max_tokens": 2})
                assert r.status_code == 200, r.text
        for _ in range(4):  # whichever frontend answers the scrape, it reports everyone's requests
            with httpx.Client(base_url=base, timeout=60) as client:
                text = client.get("/metrics").text
            values = {}
            for family in text_string_to_metric_families(text):
                for s in family.samples:
                    key = (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name")))
                    values[key] = values.get(key, 0.0) + s.value
            assert values[("vllm:request_success_total", (("finished_reason", "length"),))] == sent
            assert values[("vllm:http_requests_total", (("endpoint", "/v1/completions"), ("status", "200")))] == sent
            assert values[("vllm:e2e_request_latency_seconds_count", ())] == sent
    finally:
        srv.stop()
    assert srv.proc.returncode == 0
