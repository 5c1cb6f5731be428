"""Prometheus metrics of the HTTP server, with vLLM's metric names.

Request-level numbers (finish reasons, token counts, TTFT, inter-token and
end-to-end latency) are observed here from the `RequestOutput`s the server
streams; engine-level gauges (running/waiting requests, KV-cache usage) are
refreshed from the core's scheduler stats when /metrics is scraped. Per-step
counters (prefix-cache queries/hits, preemptions, tokens per iteration) and the
per-request phase histograms (queue, prefill, decode, inference, measured on the
core's clock) come from AsyncLLM's stat-logger hook (`record`), as in vLLM V1.
Each app gets its own registry, so several servers can live in one process (tests).
Under `vllm-lite serve --api-server-count N` the supervisor sets PROMETHEUS_MULTIPROC_DIR for
its frontends: every process writes its values there (prometheus-client's multiprocess mode)
and any one frontend's /metrics renders the sum, so a scrape sees all the traffic.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from vllm_lite import envs
from vllm_lite.outputs import RequestOutput
from vllm_lite.sampling_params import RequestOutputKind

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
)
# The seconds ladder the end-to-end and the per-request phase histograms share.
_REQUEST_SECONDS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
)
_E2E_BUCKETS = (0.1, *_REQUEST_SECONDS)

# vLLM V1's request_latency_buckets (queue, prefill, decode, inference times) and iteration-token buckets.
_REQUEST_PHASE_BUCKETS = (*_REQUEST_SECONDS, 1920.0, 7680.0)
_ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

METRICS_CONTENT_TYPE = CONTENT_TYPE_LATEST
logger = logging.getLogger(__name__)


class ServerMetrics:
    """All collectors of one server, labelled with the served model name."""

    def __init__(self, model_name: str, registry: Optional[CollectorRegistry] = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.model_name = model_name
        self.multiproc_dir = envs.PROMETHEUS_MULTIPROC_DIR
        labels = ["model_name"]
        r = self.registry
        # Engine gauges: every frontend reads the same core, so the latest value is the value.
        gauge_mode = {"multiprocess_mode": "mostrecent"} if self.multiproc_dir else {}
        self.request_success = Counter(
            "vllm:request_success",
            "Finished sequences (one per sample when n > 1) by finish reason.",
            labels + ["finished_reason"],
            registry=r,
        )
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed.", labels, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.", labels, registry=r)
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds", "Time to first token.", labels, buckets=_LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Time between generated tokens.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Request latency from arrival to finish.",
            labels,
            buckets=_E2E_BUCKETS,
            registry=r,
        )
        self.num_running = Gauge(
            "vllm:num_requests_running", "Requests running in the engine.", labels, registry=r, **gauge_mode
        )
        self.num_waiting = Gauge(
            "vllm:num_requests_waiting", "Requests waiting in the engine.", labels, registry=r, **gauge_mode
        )
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 0..1.", labels, registry=r, **gauge_mode)
        self.http_requests = Counter(
            "vllm:http_requests", "HTTP requests by endpoint and status.", ["endpoint", "status"], registry=r
        )
        self.prefix_cache_queries = Counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            labels,
            registry=r,
        )
        self.prefix_cache_hits = Counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", labels, registry=r
        )
        self.num_preemptions = Counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine.", labels, registry=r
        )
        # Speculative decoding (vLLM's names): drafts verified, draft tokens proposed and accepted, by position.
        self.spec_decode_num_drafts = Counter(
            "vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", labels, registry=r
        )
        self.spec_decode_num_draft_tokens = Counter(
            "vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", labels, registry=r
        )
        self.spec_decode_num_accepted_tokens = Counter(
            "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", labels, registry=r
        )
        self.spec_decode_num_accepted_tokens_per_pos = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            labels + ["position"],
            registry=r,
        )
        self.iteration_tokens = Histogram(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            labels,
            buckets=_ITERATION_TOKEN_BUCKETS,
            registry=r,
        )
        phase = {
            "queue": "Histogram of time spent in WAITING phase for request.",
            "prefill": "Histogram of time spent in PREFILL phase for request.",
            "decode": "Histogram of time spent in DECODE phase for request.",
            "inference": "Histogram of time spent in RUNNING phase for request.",
        }
        self.phase_times = {
            name: Histogram(
                f"vllm:request_{name}_time_seconds", doc, labels, buckets=_REQUEST_PHASE_BUCKETS, registry=r
            )
            for name, doc in phase.items()
        }

    def tracker(self, output_kind: RequestOutputKind) -> "RequestTracker":
        return RequestTracker(self, output_kind)

    def record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        """AsyncLLM's stat-logger hook: one batch of core outputs (never raises into the output handler)."""
        try:
            self._record(scheduler_stats, iteration_stats)
        except Exception:  # noqa: BLE001 -- metrics must not take the engine's output handler down
            logger.exception("recording engine metrics failed")

    def _record(self, s: Any, it: Any) -> None:
        m = self.model_name
        if s is not None:
            self.prefix_cache_queries.labels(m).inc(s.prefix_cache_queries)
            self.prefix_cache_hits.labels(m).inc(s.prefix_cache_hits)
            self.num_preemptions.labels(m).inc(s.num_preemptions)
            spec = getattr(s, "spec_decoding_stats", None)
            if spec is not None:
                self.spec_decode_num_drafts.labels(m).inc(spec.num_drafts)
                self.spec_decode_num_draft_tokens.labels(m).inc(spec.num_draft_tokens)
                self.spec_decode_num_accepted_tokens.labels(m).inc(spec.num_accepted_tokens)
                for pos, n in enumerate(spec.num_accepted_tokens_per_pos):
                    self.spec_decode_num_accepted_tokens_per_pos.labels(m, str(pos)).inc(n)
        if it is None:
            return
        tokens = it.num_prompt_tokens + it.num_generation_tokens
        if tokens:
            self.iteration_tokens.labels(m).observe(tokens)
        for f in it.finished_requests:
            for name, value in (
                ("queue", f.queue_time_s),
                ("prefill", f.prefill_time_s),
                ("decode", f.decode_time_s),
                ("inference", f.inference_time_s),
            ):
                if value is not None:
                    self.phase_times[name].labels(m).observe(value)

    def update_engine_stats(self, stats: dict[str, Any]) -> None:
        m = self.model_name
        self.num_running.labels(m).set(float(stats.get("num_running_reqs", 0)))
        self.num_waiting.labels(m).set(float(stats.get("num_waiting_reqs", 0)))
        self.kv_usage.labels(m).set(float(stats.get("kv_cache_usage", 0.0)))

    def render(self) -> bytes:
        """This process's registry, or with PROMETHEUS_MULTIPROC_DIR the sum over every frontend process."""
        if not self.multiproc_dir:
            return generate_latest(self.registry)
        from prometheus_client import multiprocess

        merged = CollectorRegistry()
        multiprocess.MultiProcessCollector(merged, path=self.multiproc_dir)
        return generate_latest(merged)


class RequestTracker:
    """Observes one engine request's outputs (one user prompt; n samples share it)."""

    def __init__(self, metrics: ServerMetrics, output_kind: RequestOutputKind) -> None:
        self.metrics = metrics
        self.streaming = output_kind == RequestOutputKind.DELTA
        self.start = time.time()
        self.first_token_time: Optional[float] = None
        self.last_token_time: Optional[float] = None
        self.num_generated = 0
        self.done = False

    def observe(self, out: RequestOutput) -> None:
        if self.done:
            return
        m, name = self.metrics, self.metrics.model_name
        now = time.time()
        new_tokens = sum(len(c.token_ids) for c in out.outputs)
        if self.streaming and new_tokens:
            # A delta may carry several tokens (the client fell behind): spread the gap over them.
            if self.first_token_time is None:
                self.first_token_time = now
                m.ttft.labels(name).observe(max(0.0, now - self._arrival(out)))
            elif self.last_token_time is not None:
                m.itl.labels(name).observe(max(0.0, now - self.last_token_time) / new_tokens)
            self.last_token_time = now
        self.num_generated += new_tokens
        for c in out.outputs:  # counted per sequence: with n > 1 each sample ends on its own
            if c.finish_reason is not None:
                m.request_success.labels(name, c.finish_reason).inc()
        if out.finished:
            self._finish(out, now)

    def abandoned(self, num_prompt_tokens: int, num_sequences: int) -> None:
        """The caller left before the end (client disconnect): count it as aborted."""
        if self.done:
            return
        self.done = True
        m, name = self.metrics, self.metrics.model_name
        m.e2e.labels(name).observe(max(0.0, time.time() - self.start))
        m.prompt_tokens.labels(name).inc(num_prompt_tokens)
        m.generation_tokens.labels(name).inc(self.num_generated)
        m.request_success.labels(name, "abort").inc(num_sequences)

    def _arrival(self, out: RequestOutput) -> float:
        rm = out.metrics
        return rm.arrival_time if rm is not None and rm.arrival_time else self.start

    def _finish(self, out: RequestOutput, now: float) -> None:
        self.done = True
        m, name = self.metrics, self.metrics.model_name
        arrival = self._arrival(out)
        rm = out.metrics
        if not self.streaming and rm is not None and rm.first_token_time is not None:
            # One final output: the frontend's request metrics hold the token times.
            m.ttft.labels(name).observe(max(0.0, rm.first_token_time - arrival))
            n_gen = rm.num_generation_tokens
            if n_gen > 1 and rm.last_token_time is not None:
                m.itl.labels(name).observe(max(0.0, rm.last_token_time - rm.first_token_time) / (n_gen - 1))
        m.e2e.labels(name).observe(max(0.0, now - arrival))
        m.prompt_tokens.labels(name).inc(len(out.prompt_token_ids or []))
        m.generation_tokens.labels(name).inc(self.num_generated)
