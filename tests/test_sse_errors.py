"""A stream whose request fails after its first chunks: an SSE error event, then `data: [DONE]`, then the end.

The failure is a real one inside the engine core: the core serves in a thread of this process with
its executor wrapped so that steps holding a poisoned request (its prompt holds MARK's tokens) raise
once that request has produced some tokens. The core pins the failure on that request (step
recovery) and finishes it with an error output; the HTTP server, attached to the core as any
frontend is, has long sent its 200 and first chunks, so the error can only travel as an event.
A healthy request streaming beside it must finish normally.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
from collections import Counter
from typing import Any, Iterator

import httpx
import pytest
import torch

from vllm_lite.core.engine_core_proc import CoreProcOptions, EngineCoreProc
from vllm_lite.endpoints import CoreAddresses
from vllm_lite.engine_args import EngineArgs
from vllm_lite.testing.checkpoints import get_checkpoint
from vllm_lite.testing.openai_server import ServerThread
from vllm_lite.worker.step import ModelRunnerOutput, SchedulerOutput

MARK = "Zqxjv"  # a word no other test prompt holds
GOOD_STEPS = 4  # a poisoned request runs this many steps (its prefill and 3 tokens), then fails
DEADLINE_S = 120.0
USAGE = {"include_usage": True, "continuous_usage_stats": True}  # every chunk says how many tokens so far


class FailingAfterTokens:
    """The core's executor, except that a step holding a poisoned request past GOOD_STEPS raises."""

    def __init__(self, inner: Any, mark: list[int]) -> None:
        self.inner = inner
        self.mark = mark
        self.poisoned: set[str] = set()
        self.steps: Counter = Counter()

    def execute_model(self, so: SchedulerOutput, non_block: bool = False) -> ModelRunnerOutput:
        self.poisoned |= {r.req_id for r in so.scheduled_new_reqs if self._marked(r.prompt_token_ids)}
        bad = False
        for rid in self.poisoned & set(so.num_scheduled_tokens):
            self.steps[rid] += 1
            bad = bad or self.steps[rid] > GOOD_STEPS
        if bad:
            raise RuntimeError("injected worker failure for a poisoned request")
        if non_block:  # async scheduling (the default on CUDA): a handle, as the real executor gives
            return self.inner.execute_model(so, non_block=True)
        return self.inner.execute_model(so)

    def _marked(self, ids: list[int]) -> bool:
        n = len(self.mark)
        return any(ids[i : i + n] == self.mark for i in range(len(ids) - n + 1))

    def shutdown(self) -> None:
        self.inner.shutdown()


class PoisonedCoreProc(EngineCoreProc):
    def _make_engine_core(self, vllm_config: Any) -> Any:
        from transformers import AutoTokenizer

        mark = AutoTokenizer.from_pretrained(vllm_config.model_config.tokenizer).encode(MARK, add_special_tokens=False)
        core = super()._make_engine_core(vllm_config)
        core.executor = FailingAfterTokens(core.executor, mark)
        return core


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    tmpdir = tempfile.mkdtemp(prefix="vlt-sse-")
    base = f"ipc://{tmpdir}/core"
    # num_threads as now: the core's thread policy then leaves this process's torch threads as they are.
    args = EngineArgs(
        model=get_checkpoint("llama"), dtype="float32", max_model_len=128, num_threads=torch.get_num_threads()
    )
    proc = PoisonedCoreProc(args.create_engine_config(), CoreAddresses.from_base(base), CoreProcOptions())
    thread = threading.Thread(target=proc.run_busy_loop, daemon=True, name="poisoned-core")
    thread.start()
    srv = None
    try:
        from vllm_lite.client.async_llm import AsyncLLM

        srv = ServerThread(lambda: AsyncLLM.attach(base))
        yield srv
    finally:
        if srv is not None:
            srv.stop()
        proc.request_shutdown()
        thread.join(30)
        shutil.rmtree(tmpdir, ignore_errors=True)
    assert not thread.is_alive()


def sse_events(server: ServerThread, endpoint: str, body: dict[str, Any]) -> list[str]:
    """Every `data:` payload of one streamed response, in order, read to the end of the stream."""
    with httpx.stream("POST", server.base_url + endpoint, json=body, timeout=DEADLINE_S) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]


def assert_chunks_then_error_then_done(events: list[str], text_of: Any) -> None:
    assert events[-1] == "[DONE]", f"the stream did not end with [DONE]: {events[-3:]}"
    error = json.loads(events[-2])
    assert set(error) == {"error"}, f"expected an error event before [DONE], got {error}"
    # A generic message with an error id (the log has the details): internals never reach the client.
    assert "injected" not in error["error"]["message"] and "error id err-" in error["error"]["message"]
    assert error["error"]["code"] == 500 and error["error"]["type"]
    chunks = [json.loads(e) for e in events[:-2]]
    assert chunks and all("error" not in c for c in chunks)
    texts = [text_of(c) for c in chunks]
    # Tokens, not chunks: under load the server may coalesce several tokens into one chunk. Each
    # chunk's continuous usage says how many completion tokens had been streamed by then.
    streamed = max(c["usage"]["completion_tokens"] for c in chunks)
    assert streamed >= 2 and "".join(texts), f"the failure came before tokens were streamed: {streamed} {texts}"


def test_completion_stream_failing_after_tokens_ends_with_error_event_then_done(server: ServerThread) -> None:
    url = server.base_url + "/v1/completions"
    body = {"max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": True}
    results: dict[str, Any] = {}
    healthy = threading.Thread(
        target=lambda: results.update(ok=sse_events(server, "/v1/completions", {**body, "prompt": [5, 6, 7, 8]}))
    )
    healthy.start()
    events = sse_events(server, "/v1/completions", {**body, "prompt": f"{MARK} says", "stream_options": USAGE})
    healthy.join(DEADLINE_S)
    assert_chunks_then_error_then_done(events, lambda c: c["choices"][0]["text"] if c["choices"] else "")
    # The request beside it finished normally, and the server still serves.
    ok = results["ok"]
    assert ok[-1] == "[DONE]" and all("error" not in json.loads(e) for e in ok[:-1])
    assert json.loads(ok[-2])["choices"][0]["finish_reason"] == "length"
    after = httpx.post(url, json={**body, "stream": False, "prompt": [5, 6]}, timeout=DEADLINE_S)
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 12


def test_chat_stream_failing_after_tokens_ends_with_error_event_then_done(server: ServerThread) -> None:
    body = {
        "messages": [{"role": "user", "content": f"{MARK} says"}],
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": USAGE,
    }
    events = sse_events(server, "/v1/chat/completions", body)
    assert_chunks_then_error_then_done(
        events, lambda c: (c["choices"][0]["delta"].get("content") or "") if c["choices"] else ""
    )
