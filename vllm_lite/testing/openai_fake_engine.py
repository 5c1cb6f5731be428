"""A model-free engine with AsyncLLM's interface, for fast tests of the HTTP layer.

It uses the real tokenizer and `Processor` of the tiny test checkpoint (so
validation errors are the real ones) and "generates" a deterministic token
sequence: token k of sample j is (prompt[-1] + 7 * (k + 1) + j) % 1000 + 100.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncGenerator, Optional

from vllm_lite.client.exceptions import EngineDeadError
from vllm_lite.client.processor import Processor
from vllm_lite.client.tokenizer import get_tokenizer
from vllm_lite.engine_args import EngineArgs
from vllm_lite.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from vllm_lite.sampling_params import RequestOutputKind, SamplingParams


def fake_token(prompt_ids: list[int], k: int, j: int) -> int:
    return (prompt_ids[-1] + 7 * (k + 1) + j) % 1000 + 100


def fake_logprob(k: int) -> float:
    return -0.5 - 0.1 * k


class FakeAsyncLLM:
    def __init__(self, model: str, max_model_len: int = 128) -> None:
        cfg = EngineArgs(model=model, max_model_len=max_model_len).create_engine_config()
        self.model_config = cfg.model_config
        self.tokenizer = get_tokenizer(model)
        self.processor = Processor(self.model_config, self.tokenizer)
        self.errored = False
        self.is_running = True
        self.hang = False  # requests produce nothing until aborted
        self.stuck = False  # get_stats reports pending work but the step counter never moves
        # When set, the output of this step (0-based) fails: it carries its token with the error, as
        # AsyncLLM hands over a failure merged behind deltas the frontend had not read yet.
        self.fail_at_step: Optional[int] = None
        self.step_counter = 0
        self.running: set[str] = set()
        self.aborted: list[str] = []
        self.requests: dict[str, tuple[Any, SamplingParams]] = {}
        self._abort_events: dict[str, asyncio.Event] = {}

    async def get_tokenizer(self) -> Any:
        return self.tokenizer

    async def generate(
        self, prompt: Any, sampling_params: SamplingParams, request_id: str, priority: int = 0
    ) -> AsyncGenerator[RequestOutput, None]:
        if self.errored:
            raise EngineDeadError()
        prompt_text, req = self.processor.process_inputs(request_id, prompt, sampling_params)
        params = req.sampling_params
        self.requests[request_id] = (prompt, params)
        ids = req.prompt_token_ids
        self.running.add(request_id)
        aborted = self._abort_events.setdefault(request_id, asyncio.Event())
        metrics = RequestMetrics(arrival_time=req.arrival_time)
        try:
            if self.hang:
                await aborted.wait()
                yield self._out(
                    request_id,
                    prompt_text,
                    ids,
                    [CompletionOutput(j, "", [], None, None, "abort") for j in range(params.n)],
                    True,
                    metrics,
                )
                return
            assert params.max_tokens is not None
            samples = [[fake_token(ids, k, j) for k in range(params.max_tokens)] for j in range(params.n)]
            delta = params.output_kind == RequestOutputKind.DELTA
            for k in range(params.max_tokens):
                await asyncio.sleep(0)
                if self.errored:
                    raise EngineDeadError()
                if aborted.is_set():
                    return
                self.step_counter += 1
                now = time.time()
                metrics.first_token_time = metrics.first_token_time or now
                metrics.last_token_time = now
                metrics.num_generation_tokens += 1
                last = k == params.max_tokens - 1
                if not delta and not last:
                    continue
                outs = []
                for j, toks in enumerate(samples):
                    new = toks[k : k + 1] if delta else toks
                    start = k if delta else 0
                    lps = None
                    if params.logprobs is not None:
                        lps = [self._position_lps(t, start + i, params.logprobs) for i, t in enumerate(new)]
                    text = self.tokenizer.decode(new) if delta else self.tokenizer.decode(toks)
                    outs.append(
                        CompletionOutput(
                            index=j,
                            text=text,
                            token_ids=list(new),
                            cumulative_logprob=None,
                            logprobs=lps,
                            finish_reason="length" if last else None,
                            stop_reason=None,
                        )
                    )
                prompt_lps = None
                if params.prompt_logprobs is not None and (k == 0 or not delta):
                    prompt_lps = [None] + [
                        self._position_lps(t, i, params.prompt_logprobs) for i, t in enumerate(ids[1:])
                    ]
                failed = k == self.fail_at_step
                if failed:
                    for o in outs:
                        o.finish_reason = "abort"
                out = self._out(request_id, prompt_text, ids, outs, last or failed, metrics)
                out.prompt_logprobs = prompt_lps
                if failed:
                    out.error = "RuntimeError: injected failure"
                yield out
                if failed:
                    return
        finally:
            self.running.discard(request_id)

    def _position_lps(self, token: int, k: int, num: int) -> dict[int, Logprob]:
        d = {token: Logprob(logprob=fake_logprob(k), rank=1, decoded_token=self.tokenizer.decode([token]))}
        for r in range(2, num + 1):
            alt = 3 + r
            d.setdefault(alt, Logprob(logprob=fake_logprob(k) - r, rank=r, decoded_token=self.tokenizer.decode([alt])))
        return d

    @staticmethod
    def _out(
        rid: str,
        text: Optional[str],
        ids: list[int],
        outs: list[CompletionOutput],
        finished: bool,
        metrics: RequestMetrics,
    ) -> RequestOutput:
        return RequestOutput(rid, text, ids, None, outs, finished, metrics=metrics)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self._abort_events.setdefault(request_id, asyncio.Event()).set()

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        if self.errored:
            raise EngineDeadError()
        if method == "get_stats":
            pending = len(self.running) + (1 if self.stuck else 0)
            return {
                "num_running_reqs": pending,
                "num_waiting_reqs": 0,
                "kv_cache_usage": 0.25,
                "step_counter": self.step_counter,
            }
        raise ValueError(f"unknown utility method {method!r}")

    def shutdown(self) -> None:
        self.is_running = False
