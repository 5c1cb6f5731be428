"""Frontend side of the core's outputs: ids in, `RequestOutput`s out.

Per request it keeps a detokenizer (text, stop strings) and a logprobs
processor; per batch of core outputs it builds the caller's outputs in the
requested kind (CUMULATIVE / DELTA / FINAL_ONLY), gathers n > 1 children under
their parent, and tells the engine which requests a stop string ended (the
core is still running those and must abort them).
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Union

from vllm_lite.client.detokenizer import IncrementalDetokenizer
from vllm_lite.client.logprobs import LogprobsProcessor, TokenTextCache
from vllm_lite.client.parallel_sampling import ParentRequest, merge_delta
from vllm_lite.client.pooling import PoolingRequestState
from vllm_lite.core.messages import EngineCoreOutput, EngineCoreRequest, FinishReason
from vllm_lite.outputs import CompletionOutput, RequestMetrics, RequestOutput
from vllm_lite.sampling_params import RequestOutputKind


class RequestOutputCollector:
    """One request's mailbox for AsyncLLM: the producer never blocks, the consumer awaits.

    If the consumer falls behind, DELTA outputs are merged into one (nothing is
    lost) and CUMULATIVE/FINAL outputs simply replace the older snapshot.
    `put` may be called from the event loop's thread or any other thread.
    """

    def __init__(self, output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE) -> None:
        self.merge_deltas = output_kind == RequestOutputKind.DELTA
        self._item: Union[RequestOutput, Exception, None] = None
        self._lock = threading.Lock()
        self._event: Optional[asyncio.Event] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None

    def put(self, item: Union[RequestOutput, Exception]) -> None:
        with self._lock:
            cur = self._item
            if cur is None or isinstance(item, Exception) or isinstance(cur, Exception):
                # An exception always wins: the consumer must see it.
                self._item = item if not isinstance(cur, Exception) else cur
            elif self.merge_deltas:
                self._item = merge_request_outputs(cur, item)
            else:
                self._item = item
            event, loop = self._event, self._loop
        if event is not None and loop is not None:
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is loop:
                event.set()
            elif not loop.is_closed():
                loop.call_soon_threadsafe(event.set)

    def get_nowait(self) -> Optional[RequestOutput]:
        """The pending output, if any (raises a pending exception)."""
        with self._lock:
            item, self._item = self._item, None
            if self._event is not None:
                self._event.clear()
        if isinstance(item, Exception):
            raise item
        return item

    async def get(self) -> RequestOutput:
        """Wait for the next output (merged if several arrived); raises a put exception."""
        if self._event is None:
            with self._lock:
                self._loop = asyncio.get_running_loop()
                self._event = asyncio.Event()
                if self._item is not None:
                    self._event.set()
        while True:
            item = self.get_nowait()
            if item is not None:
                return item
            await self._event.wait()


def merge_request_outputs(old: RequestOutput, new: RequestOutput) -> RequestOutput:
    """Fold a later DELTA output into an earlier, not yet consumed one."""
    by_index = {c.index: c for c in old.outputs}
    for c in new.outputs:
        prev = by_index.get(c.index)
        by_index[c.index] = c if prev is None else merge_delta(prev, c)
    prompt_logprobs = old.prompt_logprobs
    if new.prompt_logprobs:
        prompt_logprobs = (old.prompt_logprobs or []) + new.prompt_logprobs
    return RequestOutput(
        request_id=new.request_id,
        prompt=new.prompt,
        prompt_token_ids=new.prompt_token_ids,
        prompt_logprobs=prompt_logprobs,
        outputs=[by_index[i] for i in sorted(by_index)],
        finished=new.finished,
        metrics=new.metrics,
        num_cached_tokens=new.num_cached_tokens,
        error=new.error or old.error,
    )


@dataclass
class FinishedRequestStats:
    finish_reason: str
    e2e_latency_s: float
    num_prompt_tokens: int
    num_generation_tokens: int
    # Phases on the core's clock (vLLM's request_{queue,prefill,decode,inference}_time); None if unknown.
    queue_time_s: Optional[float] = None
    prefill_time_s: Optional[float] = None
    decode_time_s: Optional[float] = None
    inference_time_s: Optional[float] = None


@dataclass
class IterationStats:
    """What one batch of outputs did, for the metrics loggers (filled when log_stats)."""

    num_prompt_tokens: int = 0  # prompts that got their first token in this batch
    num_generation_tokens: int = 0
    time_to_first_tokens_s: list[float] = field(default_factory=list)
    inter_token_latencies_s: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)


@dataclass
class OutputProcessorOutput:
    request_outputs: list[RequestOutput]
    reqs_to_abort: list[str]
    iteration_stats: Optional[IterationStats] = None


def _phase_times(m: RequestMetrics) -> tuple[Optional[float], ...]:
    """(queue, prefill, decode, inference) seconds as vLLM defines them, from the core's timestamps."""
    if not m.scheduled_ts or m.queued_ts is None:
        return (None, None, None, None)
    queue = max(0.0, m.scheduled_ts - m.queued_ts)
    if m.first_token_ts is None or m.last_token_ts is None:
        return (queue, None, None, None)
    return (
        queue,
        max(0.0, m.first_token_ts - m.scheduled_ts),
        max(0.0, m.last_token_ts - m.first_token_ts),
        max(0.0, m.last_token_ts - m.scheduled_ts),
    )


# The hot path builds these two positionally: their leading fields must stay in this order.
_COMPLETION_FIELDS = ("index", "text", "token_ids", "cumulative_logprob", "logprobs", "finish_reason", "stop_reason")
_REQUEST_OUTPUT_FIELDS = (
    "request_id",
    "prompt",
    "prompt_token_ids",
    "prompt_logprobs",
    "outputs",
    "finished",
    "metrics",
    "num_cached_tokens",
    "error",
)


def _check_positional_fields() -> None:
    for cls, names in ((CompletionOutput, _COMPLETION_FIELDS), (RequestOutput, _REQUEST_OUTPUT_FIELDS)):
        have = tuple(f.name for f in dataclasses.fields(cls))[: len(names)]
        if have != names:
            raise ImportError(f"output_processor builds {cls.__name__} positionally as {names}, its fields are {have}")


_check_positional_fields()


class RequestState:
    """Everything the frontend tracks for one core request (one child when n > 1)."""

    def __init__(
        self,
        request: EngineCoreRequest,
        prompt: Optional[str],
        text_cache: TokenTextCache,
        tokenizer: Any,
        parent_req: Optional[ParentRequest],
        request_index: int,
        queue: Optional[RequestOutputCollector],
    ) -> None:
        params = request.sampling_params
        self.request_id = request.request_id
        self.parent_req = parent_req
        self.request_index = request_index
        self.output_kind = params.output_kind
        self.prompt = prompt
        self.prompt_token_ids = request.prompt_token_ids
        self.detokenizer = IncrementalDetokenizer.from_new_request(tokenizer, request)
        self.logprobs_processor = LogprobsProcessor.from_new_request(request, text_cache)
        self.queue = queue
        self.num_cached_tokens = 0
        self.metrics = RequestMetrics(arrival_time=request.arrival_time)
        self._delta_token_start = 0  # output ids already returned as deltas
        # process_outputs' one-token fast path: 1 = a DELTA output a step, 2 = FINAL_ONLY (nothing until the
        # finish), 0 = the general path (parent of n > 1, logprobs, CUMULATIVE). Stop strings are the detokenizer's
        # `plain`, checked at each step.
        lp = self.logprobs_processor
        self.fast = 0
        if parent_req is None and lp.logprobs is None and lp.prompt_logprobs is None:
            if self.output_kind == RequestOutputKind.DELTA:
                self.fast = 1
            elif self.output_kind == RequestOutputKind.FINAL_ONLY:
                self.fast = 2

    def update(
        self, out: EngineCoreOutput, now: float, stats: Optional[IterationStats], core_ts: Optional[float] = None
    ) -> Optional[str]:
        """Feed one core output; return the stop string a stop-string match ended on, if any."""
        m = self.metrics
        if out.scheduled_ts:
            m.queued_ts, m.scheduled_ts = out.queued_ts, out.scheduled_ts
        new_ids = out.new_token_ids
        if new_ids:
            if core_ts is not None:
                if m.first_token_ts is None:
                    m.first_token_ts = core_ts
                m.last_token_ts = core_ts
            if m.first_token_time is None:
                m.first_token_time = now
                self.num_cached_tokens = out.num_cached_tokens
                if stats is not None:
                    stats.num_prompt_tokens += len(self.prompt_token_ids)
                    stats.time_to_first_tokens_s.append(now - m.arrival_time)
            elif stats is not None and m.last_token_time is not None:
                stats.inter_token_latencies_s.append(now - m.last_token_time)
            m.last_token_time = now
            m.num_generation_tokens += len(new_ids)
            if stats is not None:
                stats.num_generation_tokens += len(new_ids)
        if out.new_logprobs is not None or out.new_prompt_logprobs_tensors is not None:
            self.logprobs_processor.update_from_output(out)
        # The core finishes with STOP only on EOS or a stop token id: the last id is that token.
        finish = out.finish_reason
        return self.detokenizer.update(new_ids, finish is not None and finish == FinishReason.STOP)

    def make_completion(
        self, finish_reason: Optional[FinishReason], stop_reason: Union[int, str, None]
    ) -> Optional[CompletionOutput]:
        """This request's CompletionOutput for the caller's output kind; None when nothing is due."""
        finished = finish_reason is not None
        kind = self.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = kind == RequestOutputKind.DELTA
        detok = self.detokenizer
        text = detok.get_next_output_text(finished, delta)
        lp = self.logprobs_processor
        if delta:
            ids = detok.token_ids[self._delta_token_start :]
            self._delta_token_start += len(ids)
            logprobs = None if lp.logprobs is None else lp.pop_sample_delta()
            if not ids and not text and not finished:
                return None
        else:
            ids = list(detok.token_ids)
            logprobs = list(lp.logprobs) if lp.logprobs is not None else None
        if not finished:  # positional: half the cost of keywords, once per request and step (fields checked below)
            return CompletionOutput(self.request_index, text, ids, lp.cumulative_logprob, logprobs, None, None)
        return CompletionOutput(
            self.request_index, text, ids, lp.cumulative_logprob, logprobs, str(finish_reason), stop_reason
        )

    def prompt_logprobs_for_output(self):
        lp = self.logprobs_processor
        if lp.prompt_logprobs is None:  # none asked for (either kind's answer)
            return None
        if self.output_kind == RequestOutputKind.DELTA:
            return lp.pop_prompt_delta()
        return list(lp.prompt_logprobs) if lp.prompt_logprobs is not None else None

    def make_request_output(
        self, request_id: str, outputs: list[CompletionOutput], finished: bool, error: Optional[str] = None
    ) -> RequestOutput:
        lp = None if self.logprobs_processor.prompt_logprobs is None else self.prompt_logprobs_for_output()
        return RequestOutput(  # positional, as in make_completion
            request_id,
            self.prompt,
            self.prompt_token_ids,
            lp,
            outputs,
            finished,
            self.metrics,
            self.num_cached_tokens,
            error,
        )


class OutputProcessor:
    """Turns `EngineCoreOutput`s into `RequestOutput`s for every request of one frontend."""

    def __init__(self, tokenizer: Any, log_stats: bool = False) -> None:
        self.tokenizer = tokenizer
        self.log_stats = log_stats
        self.text_cache = TokenTextCache(tokenizer) if tokenizer is not None else None
        self.request_states: dict[str, RequestState] = {}
        self.parent_requests: dict[str, ParentRequest] = {}

    # ------------------------------------------------------------------ bookkeeping
    def get_num_unfinished_requests(self) -> int:
        return len(self.request_states)

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def add_request(
        self,
        request: EngineCoreRequest,
        prompt: Optional[str],
        parent_req: Optional[ParentRequest] = None,
        request_index: int = 0,
        queue: Optional[RequestOutputCollector] = None,
    ) -> None:
        """Start tracking a core request (for n > 1: each child, with its parent and index)."""
        rid = request.request_id
        if request.pooling_params is not None:  # one output, no text: a state of its own
            if rid in self.request_states or rid in self.parent_requests:
                raise ValueError(f"request_id {rid!r} is already in use by an unfinished request.")
            self.request_states[rid] = PoolingRequestState(request, prompt, queue)  # type: ignore[assignment]
            return
        if parent_req is not None:
            if not 0 <= request_index < parent_req.num_children:
                raise ValueError(f"request_index must be in [0, {parent_req.num_children}), got {request_index!r}.")
            known = self.parent_requests.get(parent_req.request_id)
            if known is not None and known is not parent_req or parent_req.request_id in self.request_states:
                raise ValueError(f"request_id {parent_req.request_id!r} is already in use by an unfinished request.")
        if rid in self.request_states or (parent_req is None and rid in self.parent_requests):
            raise ValueError(f"request_id {rid!r} is already in use by an unfinished request.")
        if parent_req is not None:
            self.parent_requests[parent_req.request_id] = parent_req
        self.request_states[request.request_id] = RequestState(
            request, prompt, self.text_cache, self.tokenizer, parent_req, request_index, queue
        )

    def abort_requests(self, request_ids: Iterable[str]) -> list[str]:
        """Forget these requests (parent ids abort all their children); returns the core ids to abort.

        A caller waiting on a queue gets a final output with finish_reason "abort".
        """
        to_abort: list[str] = []
        for rid in request_ids:
            parent = self.parent_requests.pop(rid, None)
            if parent is not None:
                ids = [cid for cid in parent.child_ids if cid in self.request_states]
            else:
                ids = [rid] if rid in self.request_states else []
            for cid in ids:
                state = self.request_states.pop(cid)
                to_abort.append(cid)
                self._finish_aborted(state)
        return to_abort

    def _finish_aborted(self, state: RequestState) -> None:
        if isinstance(state, PoolingRequestState):
            if state.queue is not None:
                state.queue.put(state.make_aborted())
            return
        parent = state.parent_req
        now = time.time()
        state.metrics.finished_time = now
        completion = state.make_completion(FinishReason.ABORT, None)
        if parent is None:
            if state.queue is not None and completion is not None:
                state.queue.put(state.make_request_output(state.request_id, [completion], True))
            return
        if completion is not None:
            parent.add_child_output(state.request_id, completion)
        if parent.finished:
            self.parent_requests.pop(parent.request_id, None)
        if state.queue is not None:
            outs = parent.take_outputs()
            if outs is not None:
                state.queue.put(state.make_request_output(parent.request_id, outs, parent.finished))

    def propagate_error(self, exc: Exception) -> None:
        """The engine died or failed: every waiting caller gets the exception."""
        seen: set[int] = set()
        for state in self.request_states.values():
            if state.queue is not None and id(state.queue) not in seen:
                seen.add(id(state.queue))
                state.queue.put(exc)

    # ------------------------------------------------------------------ the hot path
    def process_outputs(
        self, engine_core_outputs: list[EngineCoreOutput], engine_core_timestamp: Optional[float] = None
    ) -> OutputProcessorOutput:
        """Apply one batch of core outputs; outputs of queued (async) requests go to their queues."""
        now = time.time()
        stats = IterationStats() if self.log_stats else None
        request_outputs: list[RequestOutput] = []
        reqs_to_abort: list[str] = []
        # Parents touched in this batch, with the child state that represents them.
        touched_parents: dict[str, tuple[ParentRequest, RequestState]] = {}

        get_state = self.request_states.get
        for out in engine_core_outputs:
            state = get_state(out.request_id)
            if state is None:  # aborted or stop-string-finished already: late outputs are dropped
                continue
            if (
                state.__class__ is RequestState
                and state.fast
                and out.finish_reason is None
                and len(new_ids := out.new_token_ids) == 1
                and state.metrics.first_token_time is not None
                and state.detokenizer.plain
            ):
                # The decode step's case: one more token of a running request with no stop strings, logprobs or
                # parent. State.update, make_completion and make_request_output, unrolled for it.
                m = state.metrics
                if out.scheduled_ts:
                    m.queued_ts, m.scheduled_ts = out.queued_ts, out.scheduled_ts
                if engine_core_timestamp is not None:
                    if m.first_token_ts is None:
                        m.first_token_ts = engine_core_timestamp
                    m.last_token_ts = engine_core_timestamp
                if stats is not None:
                    stats.inter_token_latencies_s.append(now - m.last_token_time)  # type: ignore[operator]
                    stats.num_generation_tokens += 1
                m.last_token_time = now
                m.num_generation_tokens += 1
                tid = new_ids[0]
                text = state.detokenizer.step_plain(tid)
                if state.fast == 2:  # FINAL_ONLY: nothing before the finish
                    continue
                state._delta_token_start += 1
                ro = RequestOutput(  # positional, as in make_request_output
                    out.request_id,
                    state.prompt,
                    state.prompt_token_ids,
                    None,
                    [CompletionOutput(state.request_index, text, [tid], None, None, None, None)],
                    False,
                    m,
                    state.num_cached_tokens,
                    out.error,
                )
                if state.queue is not None:
                    state.queue.put(ro)
                else:
                    request_outputs.append(ro)
                continue
            if isinstance(state, PoolingRequestState):  # its one output: the pooled data (or its error)
                if out.finish_reason is not None:
                    del self.request_states[out.request_id]
                    if stats is not None:  # its prompt counts, and it finished (vLLM's pooling metrics)
                        n = len(state.prompt_token_ids)
                        stats.num_prompt_tokens += n
                        e2e = now - state.metrics.arrival_time
                        stats.finished_requests.append(FinishedRequestStats(str(out.finish_reason), e2e, n, 0))
                    self._emit(state, state.make_output(out), request_outputs)  # type: ignore[arg-type]
                continue
            stop_str = state.update(out, now, stats, engine_core_timestamp)
            finish_reason, stop_reason = out.finish_reason, out.stop_reason
            if stop_str is not None:
                finish_reason, stop_reason = FinishReason.STOP, stop_str
                if out.finish_reason is None:
                    reqs_to_abort.append(out.request_id)  # the core does not know it stopped
            finished = finish_reason is not None
            if finished:
                state.metrics.finished_time = now
                del self.request_states[out.request_id]
                if stats is not None:
                    stats.finished_requests.append(
                        FinishedRequestStats(
                            str(finish_reason),
                            now - state.metrics.arrival_time,
                            len(state.prompt_token_ids),
                            state.metrics.num_generation_tokens,
                            *_phase_times(state.metrics),
                        )
                    )
            completion = state.make_completion(finish_reason, stop_reason)
            parent = state.parent_req
            if parent is None:
                if completion is None:
                    continue
                ro = state.make_request_output(out.request_id, [completion], finished, out.error)
                if state.queue is not None:  # _emit, inlined
                    state.queue.put(ro)
                else:
                    request_outputs.append(ro)
                continue
            if completion is not None:
                parent.add_child_output(out.request_id, completion)
            if parent.request_id not in touched_parents or out.error:
                touched_parents[parent.request_id] = (parent, state)

        for parent_id, (parent, state) in touched_parents.items():
            outs = parent.take_outputs()
            if parent.finished:
                self.parent_requests.pop(parent_id, None)
            if outs is None:
                continue
            errors = [o.error for o in engine_core_outputs if o.error and o.request_id in parent.child_ids]
            ro = state.make_request_output(parent_id, outs, parent.finished, errors[0] if errors else None)
            if state.output_kind == RequestOutputKind.DELTA:
                # Every child carries the same prompt: its logprobs go out once per parent.
                if parent.prompt_logprobs_sent:
                    ro.prompt_logprobs = None
                elif ro.prompt_logprobs is not None:
                    parent.prompt_logprobs_sent = True
            self._emit(state, ro, request_outputs)

        return OutputProcessorOutput(request_outputs, reqs_to_abort, stats)

    @staticmethod
    def _emit(state: RequestState, ro: RequestOutput, request_outputs: list[RequestOutput]) -> None:
        if state.queue is not None:
            state.queue.put(ro)
        else:
            request_outputs.append(ro)
