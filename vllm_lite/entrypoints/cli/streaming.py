"""Run one request on an LLMEngine and write its text to a stream as tokens arrive."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional, TextIO


class RequestFailedError(RuntimeError):
    """The engine reported an error for this request only (the engine itself is still up)."""


@dataclass
class StreamResult:
    """What came back, and how fast (for --verbose)."""

    text: str
    num_tokens: int
    finish_reason: Optional[str]
    seconds: float
    first_token_seconds: Optional[float]

    @property
    def tokens_per_second(self) -> float:
        return self.num_tokens / self.seconds if self.seconds > 0 else 0.0


def stream_request(engine: Any, request_id: str, prompt: Any, params: Any, out: Optional[TextIO]) -> StreamResult:
    """Add the request, step the engine until it finishes, echo each new piece to `out`.

    With a DELTA `params.output_kind` text appears as it is generated; with
    FINAL_ONLY it appears at the end. On KeyboardInterrupt the request is aborted
    (its KV blocks freed) before the interrupt propagates.
    """
    from vllm_lite.sampling_params import RequestOutputKind

    delta = params.output_kind == RequestOutputKind.DELTA
    start = time.perf_counter()
    first: Optional[float] = None
    pieces: list[str] = []
    num_tokens = 0
    finish_reason: Optional[str] = None
    engine.add_request(request_id, prompt, params)
    try:
        done = False
        while not done and engine.has_unfinished_requests():
            for ro in engine.step():
                if ro.request_id != request_id:
                    continue
                if ro.error:
                    raise RequestFailedError(f"request {request_id} failed in the engine: {ro.error}")
                comp = ro.outputs[0]
                piece = comp.text
                if delta:
                    num_tokens += len(comp.token_ids)
                else:
                    pieces.clear()
                    num_tokens = len(comp.token_ids)
                if comp.token_ids and first is None:
                    first = time.perf_counter() - start
                if piece:
                    pieces.append(piece)
                    if out is not None:
                        out.write(piece)
                        out.flush()
                if ro.finished:
                    finish_reason = comp.finish_reason
                    done = True
    except BaseException:
        if engine.has_unfinished_requests():
            engine.abort_request(request_id)
        raise
    return StreamResult("".join(pieces), num_tokens, finish_reason, time.perf_counter() - start, first)
