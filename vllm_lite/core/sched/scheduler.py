"""The V1 scheduler: one token budget per step, shared by decodes and prefill chunks.

Each step running requests are served first (a running request may still be
prefilling its prompt in chunks), then swapped-out ones are brought back, then
waiting ones are admitted (prefix-cache hits skip their cached blocks). A
running request that cannot get KV blocks preempts the lowest-priority running
request (possibly itself) by recompute or swap. `num_computed_tokens` advances
when a step is scheduled (as in vLLM), and blocks enter the prefix cache only
after the step that wrote them has come back.

Structured outputs (vLLM V1): a constrained request waits in WAITING_FOR_FSM, outside the waiting
queue, while the StructuredOutputManager compiles its grammar in a thread pool; it joins the queue
once ready (or finishes with the compiler's error). Each step the scheduler fills one bitmask row per
constrained request that samples, and advances each matcher on the tokens that come back.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import defaultdict, deque
from typing import Iterable, Optional

import msgspec
import numpy as np

from vllm_lite.config import VllmConfig
from vllm_lite.core.kv_cache_manager import KVCacheManager
from vllm_lite.core.kv_cache_utils import KVCacheBlock
from vllm_lite.core.messages import EngineCoreOutput, EngineCoreOutputs, SchedulerStats
from vllm_lite.core.request import Request, RequestStatus
from vllm_lite.core.sched.pooling import finish_pooling_request
from vllm_lite.core.sched.request_queue import RequestQueue, create_request_queue
from vllm_lite.core.sched.spec_decode import SpecDecodeScheduling, grammar_bitmask_with_drafts
from vllm_lite.structured_output.manager import StructuredOutputManager
from vllm_lite.worker.models.rope_regime import rope_recompute_at
from vllm_lite.worker.models.sliding_window import uniform_sliding_window
from vllm_lite.worker.step import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput

logger = logging.getLogger("vllm_lite.scheduler")


class _InFlightStep:
    """One scheduled step not yet updated: the request objects it ran (guards against an id reused after an
    abort) and, with async scheduling, which of them sample a token (each holds a placeholder for it).

    A step whose every request went through schedule's decode fast path (a whole-step decode) keeps their ids and
    requests in the step's order (that of num_scheduled_tokens), `fast_ids` and `fast_reqs`, and the scheduler's
    release count then (`Scheduler._num_released`): while it is unchanged every one of them is still live, and
    update_from_output skips its per-request lookups. Such a step builds `requests` and `samplers` from those lists
    only when something reads them (the whole-step update and `_scheduled_later` do not)."""

    __slots__ = ("scheduler_output", "_requests", "_samplers", "fast_ids", "fast_reqs", "release_mark", "_sample_all")

    def __init__(self, scheduler_output: Optional[SchedulerOutput], requests: dict[str, Request]) -> None:
        self.scheduler_output = scheduler_output
        self._requests: Optional[dict[str, Request]] = requests
        self._samplers: Optional[set[str]] = set()
        self.fast_ids: Optional[list[str]] = None
        self.fast_reqs: Optional[list[Request]] = None
        self.release_mark = -1
        self._sample_all = False

    def set_whole_step(self, ids: list[str], reqs: list[Request], release_mark: int, sample_all: bool) -> None:
        """A whole-step decode: `requests` is (ids -> reqs), `samplers` every id (`sample_all`, async) or none,
        both built when first read."""
        self.fast_ids = ids
        self.fast_reqs = reqs
        self.release_mark = release_mark
        self._requests = None
        self._samplers = None
        self._sample_all = sample_all

    @property
    def is_lazy(self) -> bool:
        """A whole-step decode whose `requests` nobody has read yet."""
        return self._requests is None

    @property
    def requests(self) -> dict[str, Request]:
        r = self._requests
        if r is None:
            assert self.fast_ids is not None and self.fast_reqs is not None
            r = self._requests = dict(zip(self.fast_ids, self.fast_reqs))
        return r

    @property
    def samplers(self) -> set[str]:
        s = self._samplers
        if s is None:
            s = self._samplers = set(self.fast_ids or ()) if self._sample_all else set()
        return s


def new_request_data(r: Request, block_ids: list[int]) -> NewRequestData:
    """The worker's copy of a request joining its batch (step recovery re-sends the same when it probes)."""
    return NewRequestData(
        req_id=r.request_id,
        prompt_token_ids=list(r.prompt_token_ids),
        output_token_ids=list(r.output_token_ids),
        sampling_params=r.sampling_params,
        block_ids=block_ids,
        num_computed_tokens=r.num_computed_tokens,
        eos_token_id=r.eos_token_id,
        pooling_params=r.pooling_params,
        compressed_token_type_ids=r.compressed_token_type_ids,
        lora_request=r.lora_request,
    )


class Scheduler:
    # update_from_output's decode fast path (False: every request takes the general path; tests compare the two).
    decode_fast_path = True

    def __init__(self, vllm_config: VllmConfig) -> None:
        cc = vllm_config.cache_config
        sc = vllm_config.scheduler_config
        if not isinstance(cc.num_gpu_blocks, int) or cc.num_gpu_blocks < 2:
            raise ValueError(
                f"cache_config.num_gpu_blocks must be set to an integer >= 2 before the scheduler is built, "
                f"got {cc.num_gpu_blocks!r}."
            )
        if cc.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {cc.preemption_mode!r}.")
        if sc.policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling policy must be 'fcfs' or 'priority', got {sc.policy!r}.")
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            v = getattr(sc, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"scheduler_config.{name} must be a positive integer, got {v!r}.")
        if not isinstance(sc.long_prefill_token_threshold, int) or sc.long_prefill_token_threshold < 0:
            raise ValueError(
                f"long_prefill_token_threshold must be a non-negative integer, got {sc.long_prefill_token_threshold!r}."
            )
        self.vllm_config = vllm_config
        self.block_size = cc.block_size
        self.policy = sc.policy
        self.preemption_mode = cc.preemption_mode
        self.max_num_batched_tokens = sc.max_num_batched_tokens
        self.max_num_seqs = sc.max_num_seqs
        self.long_prefill_token_threshold = sc.long_prefill_token_threshold
        # vLLM's enable_chunked_prefill. False: a prompt runs whole in one step or waits (see schedule's step 2).
        self.enable_chunked_prefill = bool(sc.enable_chunked_prefill)
        self.kv_cache_manager = KVCacheManager(
            num_blocks=cc.num_gpu_blocks,
            block_size=cc.block_size,
            enable_caching=cc.enable_prefix_caching,
            num_cpu_blocks=cc.num_cpu_blocks or 0,
            sliding_window=uniform_sliding_window(vllm_config.model_config.hf_config),
        )
        # A request alone must always fit in the cache, or it could never finish: cap the length there.
        capacity = self.kv_cache_manager.num_total_blocks * self.block_size
        self.max_model_len = min(sc.max_model_len, capacity)
        if capacity < sc.max_model_len:
            logger.warning(
                "KV cache holds only %d tokens (%d blocks of %d), less than max_model_len=%d: "
                "requests are capped at %d tokens",
                capacity,
                self.kv_cache_manager.num_total_blocks,
                self.block_size,
                sc.max_model_len,
                capacity,
            )

        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than max_model_len "
                f"({self.max_model_len}): with enable_chunked_prefill=False a prompt runs whole in one step, so "
                "longer ones could never run."
            )
        if not self.enable_chunked_prefill and self.long_prefill_token_threshold:
            raise ValueError(
                f"long_prefill_token_threshold={self.long_prefill_token_threshold} cuts prompts into chunks, which "
                "enable_chunked_prefill=False forbids."
            )

        self.requests: dict[str, Request] = {}
        self.waiting: RequestQueue = create_request_queue(self.policy)
        self.swapped: RequestQueue = create_request_queue(self.policy)
        self.running: list[Request] = []
        # Requests the worker holds in its persistent batch, and those it must drop at the next step.
        self._in_worker: set[str] = set()
        self._finished_req_ids: set[str] = set()
        # Steps scheduled and not yet updated, oldest first: one in sync mode, at most two with async scheduling
        # (step N+1 is scheduled before step N's output is known; see `schedule` and `update_from_output`).
        self.async_scheduling = bool(sc.async_scheduling)
        self._in_flight: deque[_InFlightStep] = deque()
        self._resend: set[str] = set()  # running requests the worker dropped (unschedule_last); always empty in sync
        self._arrival_order: dict[str, int] = {}
        self._order_counter = itertools.count()
        self._num_released = 0  # requests released so far (_release): the only way one leaves self.requests
        self.num_whole_step_requests = 0  # requests update_from_output took through its whole-step decode loop
        # Sampled tokens reported in outputs so far (all steps): the engine's stats line reads the step's share
        # from it instead of walking every output of every step.
        self.num_generation_tokens = 0
        self._num_preemptions = 0
        self._step_counter = 0
        # Structured outputs: requests whose grammar is compiling, and error messages owed to finished ones.
        self.structured_output_manager = StructuredOutputManager(vllm_config)
        self._waiting_for_grammar: dict[str, Request] = {}
        # Live requests (in self.requests) with a structured_output_request, counted at add and release: must_sync
        # and the step's bitmask need not scan every request when there are none.
        self._num_constrained = 0
        self._errors: dict[str, str] = {}
        self._failed_before_running: list[Request] = []
        # Speculative decoding: drafts per request, rollback of rejected ones, acceptance counters.
        self.spec = SpecDecodeScheduling(vllm_config.speculative_config)
        # Phi-3 LongRoPE: a request growing past this length recomputes from token 0 (None: every other model).
        self.rope_recompute_at = rope_recompute_at(vllm_config.model_config.hf_config)
        # LoRA: the most distinct adapters among running requests (the worker's device slots); 0: LoRA off.
        lc = vllm_config.lora_config
        self.max_loras = lc.max_loras if lc is not None else 0

    # ------------------------------------------------------------------ requests
    def add_request(self, request: Request) -> None:
        if not isinstance(request, Request):
            raise TypeError(f"request must be a Request, got {type(request).__name__}.")
        rid = request.request_id
        if rid in self.requests:
            raise ValueError(f"request_id {rid!r} is already in the scheduler.")
        if request.num_prompt_tokens == 0:
            raise ValueError(f"request {rid!r}: prompt_token_ids is empty.")
        if request.num_tokens > self.max_model_len:
            raise ValueError(
                f"request {rid!r}: {request.num_tokens} tokens exceed max_model_len={self.max_model_len} "
                f"(the smaller of the configured max_model_len and the KV cache's capacity)."
            )
        if request.is_finished() or request.status != RequestStatus.WAITING:
            raise ValueError(f"request {rid!r}: status must be WAITING to be added, got {request.status.name}.")
        if request.lora_request is not None and not self.max_loras:
            raise ValueError(f"request {rid!r}: lora_request given but LoRA is not enabled (enable_lora).")
        self.requests[rid] = request
        self._arrival_order[rid] = next(self._order_counter)
        request.rope_recompute_at = self.rope_recompute_at
        so_params = request.sampling_params.structured_outputs
        if so_params is not None:
            request.structured_output_request = self.structured_output_manager.grammar_init(so_params)
            request.status = RequestStatus.WAITING_FOR_FSM
            self._waiting_for_grammar[rid] = request
        if request.structured_output_request is not None:
            self._num_constrained += 1
        if so_params is not None:
            return
        self.waiting.add(request)

    def finish_requests(self, request_ids: str | Iterable[str], finished_status: RequestStatus) -> list[Request]:
        """Finish (abort etc.) requests wherever they are; frees their blocks. Unknown ids are ignored."""
        if not RequestStatus.is_finished(finished_status):
            raise ValueError(f"finished_status must be a finished RequestStatus, got {finished_status!r}.")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        found: dict[str, Request] = {}
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None:
                found[rid] = req
        reqs = list(found.values())
        if not reqs:
            return []
        self.running = [r for r in self.running if r.request_id not in found]
        self.waiting.remove_requests(r for r in reqs if r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED))
        self.swapped.remove_requests(r for r in reqs if r.status == RequestStatus.SWAPPED)
        for req in reqs:
            if self._waiting_for_grammar.pop(req.request_id, None) is not None:
                assert req.structured_output_request is not None
                req.structured_output_request.cancel()
            req.status = finished_status
            self._release(req)
        return reqs

    def get_request(self, request_id: str) -> Optional[Request]:
        return self.requests.get(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_finished_requests(self) -> bool:
        """Finished ids the worker has not been told about yet (one more schedule() delivers them)."""
        return bool(self._finished_req_ids)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    @property
    def num_free_blocks(self) -> int:
        return self.kv_cache_manager.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.kv_cache_manager.num_total_blocks

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def make_stats(self, reset: bool = True) -> SchedulerStats:
        """Stats for an outputs batch; counters are per batch (reset=False peeks without consuming them)."""
        queries, hits = self.kv_cache_manager.take_prefix_cache_stats(reset)
        preemptions = self._num_preemptions
        if reset:
            self._num_preemptions = 0
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting) + len(self.swapped) + len(self._waiting_for_grammar),
            kv_cache_usage=self.kv_cache_manager.usage(),
            num_free_blocks=self.num_free_blocks,
            num_total_blocks=self.num_total_blocks,
            prefix_cache_queries=queries,
            prefix_cache_hits=hits,
            num_preemptions=preemptions,
            step_counter=self._step_counter,
            spec_decoding_stats=self.spec.take_stats(reset),
        )

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> SchedulerOutput:
        self._step_counter += 1
        self._admit_ready_grammars()
        kv = self.kv_cache_manager
        budget = self.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_blocks_of: dict[str, list[KVCacheBlock]] = {}
        to_worker_as_new: list[Request] = []  # first schedule, or resumed after preemption / swap
        swap_out: list[tuple[int, int]] = []
        swap_in: list[tuple[int, int]] = []
        preempted: list[Request] = []
        spec_tokens: dict[str, list[int]] = {}  # drafts run after each request's last token

        # 1. Running requests, in order. Loop invariants are looked up once: this loop runs once per running
        # request per step (the host's hot path at large batch).
        running = self.running  # changed in place only (preemptions)
        spec = self.spec
        spec_enabled = spec.enabled
        lookahead = spec.num_lookahead_tokens > 0  # else spec.lookahead() is 0
        rope_at = self.rope_recompute_at
        threshold = self.long_prefill_token_threshold
        max_len = self.max_model_len
        block_size = self.block_size
        # Allocator fast path: without a sliding window (nothing to free behind it), a step whose tokens fit in the
        # request's blocks needs nothing from allocate_slots, which would return [] (a decode, but for one step in
        # block_size).
        held_blocks = kv.req_to_blocks.get if kv.sliding_window is None else None
        i = 0
        # Decode fast path: the leading running requests that each run one token (every decode) are scheduled below
        # with the general loop's effects, and advanced at once (step 3 then skips them). It stops at the first
        # request that is anything else (a prompt chunk, one that must preempt): then it undoes its advances and
        # the general loop carries on from there with the same budget, tokens and new blocks.
        fast = (
            self.decode_fast_path
            and held_blocks is not None
            and not spec_enabled
            and not lookahead
            and rope_at is None
            and not self._resend
            and budget >= len(running)
        )
        num_running = len(running)
        fast_reqs: list[Request] = []
        fast_ids: list[str] = []
        fast_computed: list[int] = []
        fast_block_ids: list[list[int]] = []
        if fast:
            assert held_blocks is not None
            async_scheduling = self.async_scheduling
            skipped = 0
            add_req = fast_reqs.append
            add_id = fast_ids.append
            add_computed = fast_computed.append
            add_block_ids = fast_block_ids.append
            # One empty list for every request that gets no new block: the worker only reads the lists.
            no_block_ids: list[int] = []
            for req in running:
                placeholders = req.num_output_placeholders
                num_tokens = len(req.all_token_ids)
                if placeholders and (
                    num_tokens + placeholders >= max_len
                    or (req.max_tokens is not None and len(req.output_token_ids) + placeholders >= req.max_tokens)
                ):
                    skipped += 1  # as below: its last token is in flight and ends it
                    continue
                num_computed = req.num_computed_tokens
                if num_tokens + placeholders - num_computed != 1 or num_computed >= max_len:
                    break  # not a decode (or nothing to run): the general loop
                rid = req.request_id
                if num_computed % block_size:
                    # Mid-block: its previous token, already scheduled, sits in this token's block, which it
                    # therefore holds (a running request holds the blocks of every token scheduled so far, and
                    # without a sliding window none is freed): nothing to allocate, no lookup.
                    block_ids = no_block_ids
                elif (held := held_blocks(rid)) and num_computed // block_size < len(held):
                    block_ids = no_block_ids
                else:
                    blocks = kv.allocate_slots(req, 1)
                    if blocks is None:
                        break  # it must preempt: the general loop (allocate_slots changed nothing)
                    if blocks:
                        new_blocks_of[rid] = blocks
                    block_ids = [b.block_id for b in blocks]
                add_req(req)
                add_id(rid)
                add_computed(num_computed)
                add_block_ids(block_ids)
                req.num_computed_tokens = num_computed + 1
                if async_scheduling:  # it samples (its known tokens are all computed after this step)
                    req.num_output_placeholders = placeholders + 1
            i = len(fast_reqs) + skipped  # the request the loop stopped at (num_running: none)
            num_scheduled = dict.fromkeys(fast_ids, 1)  # it was empty: the same keys, in the same order
            budget -= len(fast_reqs)
            if i < num_running:  # stopped early: the general path advances every request in step 3
                for req in fast_reqs:
                    req.num_computed_tokens -= 1
                    if async_scheduling:
                        req.num_output_placeholders -= 1
                fast = False
        while i < len(running) and budget > 0:
            req = running[i]
            placeholders = req.num_output_placeholders
            num_tokens = len(req.all_token_ids)
            if placeholders and (  # _reaches_length_cap, inlined
                num_tokens + placeholders >= max_len
                or (req.max_tokens is not None and len(req.output_token_ids) + placeholders >= req.max_tokens)
            ):
                i += 1  # its last token is in flight and ends it (max_tokens / max_model_len): as sync, no more
                continue
            drafts = spec.drafts_for(req, max_len) if spec_enabled else ()
            if drafts and rope_at is not None and num_tokens <= rope_at:
                drafts = drafts[: rope_at - num_tokens]  # none verified past the rope switch
            # _num_new_tokens, inlined (comparisons, not min(): a builtin call per request).
            num_computed = req.num_computed_tokens
            n = num_tokens + placeholders + len(drafts) - num_computed
            if 0 < threshold < n:
                n = threshold
            if n > budget:
                if n - len(drafts) > budget and not self.enable_chunked_prefill:
                    i += 1  # a prompt rewound by unschedule_last: it runs whole in a later step, never chunked
                    continue
                n = budget
            if n > max_len - num_computed:
                n = max_len - num_computed
            if n <= 0:
                i += 1
                continue
            n_alloc = n + spec.lookahead(num_computed + n, max_len) if lookahead else n
            held = held_blocks(req.request_id) if held_blocks is not None else None
            if held and (num_computed + n_alloc + block_size - 1) // block_size <= len(held):
                blocks: Optional[list[KVCacheBlock]] = []
            else:
                blocks = kv.allocate_slots(req, n_alloc)
            while blocks is None:
                victim = self._pick_victim()
                vi = self.running.index(victim)
                del self.running[vi]
                if vi < i:
                    i -= 1
                if victim.request_id in num_scheduled:  # it ran earlier this step: give back its tokens
                    budget += num_scheduled.pop(victim.request_id)
                    new_blocks_of.pop(victim.request_id, None)
                    spec_tokens.pop(victim.request_id, None)
                self._preempt(victim, swap_out)
                preempted.append(victim)
                if victim is req:
                    break
                blocks = kv.allocate_slots(req, n_alloc)
            if blocks is None:
                continue  # req preempted itself; the next request now sits at index i
            num_scheduled[req.request_id] = n
            if blocks:
                new_blocks_of[req.request_id] = blocks
            if drafts and n > 1:  # the budget may cut the drafts short
                spec_tokens[req.request_id] = drafts[: n - 1]
            budget -= n
            i += 1

        # 2. Swapped, then waiting requests, unless this step had to preempt (no room to grow).
        if not preempted:
            blocked = False
            # Only read when a request may be admitted below, and empty without LoRA (no request has an adapter).
            loras = self._running_loras() if self.max_loras and (self.swapped or self.waiting) else set()
            skipped: list[Request] = []  # waiting requests whose adapter would be one too many this step
            while self.swapped and budget > 0 and len(self.running) < self.max_num_seqs:
                req = self.swapped.peek()
                if not self._lora_fits(req, loras):
                    blocked = True
                    break
                n = self._num_new_tokens(req, req.num_computed_tokens, budget)
                if (
                    n == budget
                    and not self.enable_chunked_prefill
                    and (req.num_tokens + req.num_output_placeholders - req.num_computed_tokens > budget)
                ):
                    blocked = True  # its rest would be cut by the budget: wait for a step with room for it whole
                    break
                pairs = kv.swap_in(req, n)
                if pairs is None:
                    blocked = True  # swapped requests go before new ones: wait for room
                    break
                self.swapped.pop()
                swap_in.extend(pairs)
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                to_worker_as_new.append(req)
                num_scheduled[req.request_id] = n
                budget -= n
                if req.lora_int_id:
                    loras.add(req.lora_int_id)

            while not blocked and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                req = self.waiting.peek()
                if not self._lora_fits(req, loras):  # vLLM V1: it waits; later requests may still go
                    skipped.append(self.waiting.pop())
                    continue
                if req.pooling_params is not None:
                    # Pooled states need every prompt token in one step: no prefix hit, no chunk; else wait.
                    hit_blocks, num_hit = [], 0
                    n = req.num_tokens if budget >= req.num_tokens else 0
                    if n == 0:
                        break
                else:
                    assert not req.num_output_placeholders, "a waiting request is re-added with known tokens only"
                    hit_blocks, num_hit = kv.get_computed_blocks(req)
                    if self.enable_chunked_prefill:
                        n = self._num_new_tokens(req, num_hit, budget)
                    else:
                        # vLLM's enable_chunked_prefill=False: its whole prompt past the cached prefix (add_request
                        # keeps it within max_model_len) runs in this step, or it waits, and those behind it too
                        # (as vLLM V1: FCFS order holds). max_num_batched_tokens >= max_model_len, so it fits
                        # a step once the running requests leave it room.
                        n = req.num_tokens - num_hit
                        if n > budget:
                            break
                n_alloc = n + self.spec.lookahead(num_hit + n, self.max_model_len)
                if kv.allocate_slots(req, n_alloc, num_hit, hit_blocks) is None:
                    break
                self.waiting.pop()
                kv.record_prefix_cache_lookup(req.num_tokens, num_hit)
                req.num_computed_tokens = num_hit
                if req.num_cached_tokens < 0:
                    req.num_cached_tokens = num_hit
                    req.scheduled_ts = time.monotonic()
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                to_worker_as_new.append(req)
                num_scheduled[req.request_id] = n
                budget -= n
                if req.lora_int_id:
                    loras.add(req.lora_int_id)
            for req in reversed(skipped):  # back at the front, in their order
                self.waiting.prepend(req)

        # 3. The diff for the worker.
        if self._resend:  # taken back from the worker (unschedule_last): they go to it in full again
            for r in self.running:
                if r.request_id in self._resend and r.request_id in num_scheduled:
                    self._resend.discard(r.request_id)
                    to_worker_as_new.append(r)
        new_ids = {r.request_id for r in to_worker_as_new}
        new_reqs = [new_request_data(r, kv.get_block_ids(r.request_id)) for r in to_worker_as_new]
        for r in preempted:
            if r.request_id in self._in_worker:
                self._in_worker.discard(r.request_id)
                self._finished_req_ids.add(r.request_id)
        finished_ids, self._finished_req_ids = self._finished_req_ids, set()
        self._in_worker.update(new_ids)

        # One pass over the running requests: the worker's diff for those it holds (their num_computed_tokens as
        # the step starts), then the step's progress.
        cached = CachedRequestData()
        cached_ids = cached.req_ids
        cached_block_ids = cached.new_block_ids
        cached_computed = cached.num_computed_tokens
        new_blocks_get = new_blocks_of.get  # only requests that got blocks are in it
        step = _InFlightStep(None, {})
        step_requests = step.requests
        async_scheduling = self.async_scheduling
        scheduled_get = num_scheduled.get
        samplers_add = step.samplers.add
        rest = self.running
        if fast:  # every running request at the step's start went through the fast path: already advanced
            cached_ids.extend(fast_ids)
            cached_block_ids.extend(fast_block_ids)
            cached_computed.extend(fast_computed)
            rest = self.running[num_running:]  # those admitted in step 2 (the fast path ran on no others)
            if not rest:  # the whole step: update_from_output may take it as one (see _InFlightStep)
                step.set_whole_step(fast_ids, fast_reqs, self._num_released, async_scheduling)
            else:
                step_requests.update(zip(fast_ids, fast_reqs))
                if async_scheduling:
                    step.samplers.update(fast_ids)
        for r in rest:
            rid = r.request_id
            n = scheduled_get(rid)
            if n is None:
                continue
            num_computed = r.num_computed_tokens
            if rid not in new_ids:
                cached_ids.append(rid)
                got = new_blocks_get(rid) if new_blocks_of else None
                cached_block_ids.append([b.block_id for b in got] if got else [])
                cached_computed.append(num_computed)
            if n:
                num_computed += n
                r.num_computed_tokens = num_computed
                step_requests[rid] = r
                if async_scheduling and num_computed >= len(r.all_token_ids) + r.num_output_placeholders:
                    # It samples: the token is unknown until this step's output comes back (update_from_output).
                    r.num_output_placeholders += 1
                    samplers_add(rid)
        if not self.async_scheduling:
            self._in_flight.clear()  # sync: the last schedule() is the step in flight (as before: replaced)
        self._in_flight.append(step)
        for r in to_worker_as_new:  # resumed after preemption: the matcher must hold exactly the kept outputs
            sor = r.structured_output_request
            if sor is not None and sor.matcher is not None and not sor.matcher.resync(r.output_token_ids):
                logger.error("request %s: its kept output tokens no longer match its grammar", r.request_id)
        so_ids, bitmask = self._grammar_bitmask(step, spec_tokens)
        step.scheduler_output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            # A whole-step decode scheduled one token for each of its requests and nothing else.
            total_num_scheduled_tokens=len(num_scheduled) if step.fast_ids is not None else sum(num_scheduled.values()),
            finished_req_ids=finished_ids,
            blocks_to_swap_out=swap_out,
            blocks_to_swap_in=swap_in,
            structured_output_request_ids=so_ids,
            grammar_bitmask=bitmask,
            scheduled_spec_decode_tokens=spec_tokens,
        )
        return step.scheduler_output

    # ------------------------------------------------------------------ async scheduling
    def must_sync(self) -> bool:
        """True when the next step must run synchronously (async scheduling cannot run it yet): a live request
        under a grammar (or waiting for one: its bitmask needs the matcher advanced on the previous token),
        speculative decoding (drafts need the last token), a model that recomputes at its rope switch."""
        return self.spec.enabled or self.rope_recompute_at is not None or self._num_constrained > 0

    @property
    def num_steps_in_flight(self) -> int:
        """Scheduled steps whose output has not been given to update_from_output yet."""
        return len(self._in_flight)

    def _scheduled_later(self, req: Request) -> int:
        """Tokens of `req` in the steps scheduled after the one being updated (async scheduling; 0 in sync)."""
        rid = req.request_id
        n = 0
        num_released = self._num_released
        for step in self._in_flight:  # a plain loop: update_from_output asks once per newly full block
            so = step.scheduler_output
            if so is None:
                continue
            if step.is_lazy and step.release_mark == num_released:
                # A whole-step decode none of whose requests was released since: the one it ran under this id is
                # still the live one, which `req` is (update_from_output asks only for live requests).
                n += so.num_scheduled_tokens.get(rid, 0)
            elif step.requests.get(rid) is req:
                n += so.num_scheduled_tokens.get(rid, 0)
        return n

    def _reaches_length_cap(self, req: Request) -> bool:
        """Its tokens in flight already bring it to max_tokens or max_model_len: it finishes when they land."""
        pending = req.num_output_placeholders
        if req.max_tokens is not None and req.num_output_tokens + pending >= req.max_tokens:
            return True
        return req.num_tokens + pending >= self.max_model_len

    def unschedule_last(self, scheduler_output: SchedulerOutput) -> None:
        """Take back the newest scheduled step, which never produced an output (async scheduling, after the
        step before it failed): its requests rewind to where it started, and each live one goes back to the
        worker in full at the next step (the worker's copy of it may hold the unfinished step)."""
        assert self._in_flight and self._in_flight[-1].scheduler_output is scheduler_output
        step = self._in_flight.pop()
        for rid, req in step.requests.items():
            if self.requests.get(rid) is not req:
                continue
            if rid in step.samplers:
                req.num_output_placeholders -= 1
            if req.status == RequestStatus.RUNNING:
                req.num_computed_tokens -= scheduler_output.num_scheduled_tokens[rid]
                if rid in self._in_worker:
                    self._in_worker.discard(rid)
                    self._finished_req_ids.add(rid)
                    self._resend.add(rid)

    # ------------------------------------------------------------------ structured outputs
    def _admit_ready_grammars(self) -> None:
        """Requests whose grammar is ready join the waiting queue; failed ones finish with the compiler's error."""
        if not self._waiting_for_grammar:
            return
        for rid, req in list(self._waiting_for_grammar.items()):
            sor = req.structured_output_request
            assert sor is not None
            if not sor.is_ready():
                continue
            del self._waiting_for_grammar[rid]
            if sor.error is not None:
                req.status = RequestStatus.FINISHED_ERROR
                self._errors[rid] = sor.error
                self._failed_before_running.append(req)
                self._release(req)
            else:
                req.status = RequestStatus.WAITING
                self.waiting.add(req)

    def wait_for_grammar(self, timeout: float) -> None:
        """Block up to `timeout` s for a grammar to finish compiling (when a step had nothing to run)."""
        if self._waiting_for_grammar:
            self.structured_output_manager.wait_for_grammar(timeout)

    def _grammar_bitmask(
        self, step: _InFlightStep, spec_tokens: dict[str, list[int]]
    ) -> tuple[dict[str, int], Optional[np.ndarray]]:
        """Bitmask rows for each constrained request that samples this step (its whole sequence is computed): one,
        plus one per draft it verifies (`grammar_bitmask_with_drafts`)."""
        if not self._num_constrained:
            return {}, None
        constrained = []
        for rid, req in step.requests.items():
            sor = req.structured_output_request
            if sor is None or sor.matcher is None or req.num_computed_tokens < req.num_tokens:
                continue
            constrained.append((rid, sor.matcher, spec_tokens.get(rid, [])))
        if not constrained:
            return {}, None
        if not any(drafts for _, _, drafts in constrained):
            return {rid: i for i, (rid, _, _) in enumerate(constrained)}, self.structured_output_manager.fill_bitmask(
                [m for _, m, _ in constrained]
            )
        return grammar_bitmask_with_drafts(self.structured_output_manager, constrained)

    def _advance_grammar(self, req: Request, token_id: int) -> bool:
        """Feed a sampled token to the request's matcher; True if the grammar finishes the request."""
        sor = req.structured_output_request
        if sor is None or sor.matcher is None:
            return False
        if not sor.matcher.accept_tokens([token_id]):
            req.status = RequestStatus.FINISHED_ERROR
            self._errors[req.request_id] = f"structured outputs: sampled token {token_id} is not allowed by the grammar"
            self._log_refused_token(req, token_id)
            return True
        # The grammar took its stop token (EOS while ignore_eos or min_tokens kept the request going): done.
        # A grammar complete before EOS runs on: its bitmask allows only EOS next, so the request ends on EOS
        # as any other does (and the frontend drops that EOS from the text).
        if token_id == req.eos_token_id and sor.matcher.is_terminated():
            req.status = RequestStatus.FINISHED_STOPPED
            return True
        return False

    def _log_refused_token(self, req: Request, token_id: int) -> None:
        """Say which side is wrong: a mask that allows what its matcher refuses is the backend's bug; a token the
        mask forbids was sampled anyway (sampler or row mapping), or the matcher moved between mask and accept."""
        sor = req.structured_output_request
        assert sor is not None and sor.matcher is not None
        row = self.structured_output_manager.fill_bitmask([sor.matcher])[0]
        allowed = token_id < row.size * 32 and bool((int(row[token_id // 32]) >> (token_id % 32)) & 1)
        logger.error(
            "request %s: its grammar refused sampled token %d after %d accepted tokens; its mask %s that token "
            "(%d tokens allowed), sampling params %s",
            req.request_id,
            token_id,
            sor.matcher.num_accepted_tokens,
            "allows" if allowed else "forbids",
            int(np.unpackbits(row.view(np.uint8)).sum()),
            req.sampling_params,
        )

    def _running_loras(self) -> set[int]:
        """Adapters of the running requests (each may run this step or the next)."""
        return {r.lora_int_id for r in self.running if r.lora_int_id}

    def _lora_fits(self, req: Request, loras: set[int]) -> bool:
        """vLLM V1's rule: at most max_loras distinct adapters among the requests that run; the base is free."""
        lid = req.lora_int_id
        return not lid or lid in loras or len(loras) < self.max_loras

    def _num_new_tokens(self, req: Request, num_computed: int, budget: int, num_draft_tokens: int = 0) -> int:
        """Tokens to run now: what is left (plus any drafts), cut by the chunk threshold, the budget and
        max_model_len."""
        n = req.num_tokens + req.num_output_placeholders + num_draft_tokens - num_computed
        if self.long_prefill_token_threshold > 0:
            n = min(n, self.long_prefill_token_threshold)
        return min(n, budget, self.max_model_len - num_computed)

    def _pick_victim(self) -> Request:
        """Lowest priority running request: largest `priority` (priority policy), then latest arrival."""
        order = self._arrival_order
        if self.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time, order[r.request_id]))
        return max(self.running, key=lambda r: (r.arrival_time, order[r.request_id]))

    def _preempt(self, req: Request, swap_out: list[tuple[int, int]]) -> None:
        """Take `req` (already out of `running`) off the device: swap if asked and room, else recompute."""
        self._num_preemptions += 1
        req.num_preemptions += 1
        req.spec_token_ids = []
        self._resend.discard(req.request_id)
        if self.preemption_mode == "swap":
            pairs = self.kv_cache_manager.swap_out(req)
            if pairs is not None:
                swap_out.extend(pairs)
                req.status = RequestStatus.SWAPPED
                self.swapped.prepend(req)
                return
        self.kv_cache_manager.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        self.waiting.prepend(req)

    def _recompute_for_long_rope(self, req: Request) -> None:
        """The request just grew past its model's rope switch point: as transformers' Phi-3 generate() drops its
        cache there, recompute every token from 0 with the long factors (blocks freed, the request first in the
        waiting queue, the worker told to drop its row). Not a preemption: the metrics do not count it."""
        self.running.remove(req)
        self.kv_cache_manager.free(req)
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.status = RequestStatus.PREEMPTED
        self.waiting.prepend(req)
        if req.request_id in self._in_worker:
            self._in_worker.discard(req.request_id)
            self._finished_req_ids.add(req.request_id)

    # ------------------------------------------------------------------ update
    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        kv = self.kv_cache_manager
        mro = model_runner_output
        if self.async_scheduling:
            step = self._in_flight.popleft() if self._in_flight else _InFlightStep(None, {})
            assert step.scheduler_output is None or step.scheduler_output is scheduler_output, (
                "update_from_output must take the steps in the order they were scheduled"
            )
        else:
            step = self._in_flight.pop() if self._in_flight else _InFlightStep(None, {})
            self._in_flight.clear()
        per_client: dict[int, list[EngineCoreOutput]] = defaultdict(list)
        stopped: list[Request] = []
        stopped_off_device: list[Request] = []  # async: preempted while this step ran, ended by its token
        # Loop invariants, looked up once (this loop runs once per request per step: the host's hot path).
        live_get = self.requests.get
        index_get = mro.req_id_to_index.get
        drafts_get = scheduler_output.scheduled_spec_decode_tokens.get
        prompt_lp_get = mro.prompt_logprobs_dict.get
        all_sampled = mro.sampled_token_ids
        # Prefix caching: a request's blocks are registered only when one more of them is full (every block_size
        # tokens), so the call is skipped while its computed tokens stay within its cached blocks (as cache_blocks
        # itself would return early; the bound is an upper one: with steps in flight fewer tokens count).
        caching = kv.enable_caching
        num_cached_get = kv.num_cached_block.get
        block_size = self.block_size
        spec_enabled = self.spec.enabled
        async_scheduling = self.async_scheduling
        RUNNING = RequestStatus.RUNNING
        # Decode fast path: in a step with no drafts, logprobs, prompt logprobs, grammars or rope switch, a request
        # that sampled at most one token (every decode) is updated below without the general path's branches.
        # Same effects, same outputs, same order: only the checks that cannot apply are skipped, and a token that
        # may end the request (EOS, a stop id, a length cap) goes through _check_stop as before.
        fast = (
            self.decode_fast_path
            and not spec_enabled
            and mro.logprobs is None
            and not mro.prompt_logprobs_dict
            and not self._num_constrained
            and self.rope_recompute_at is None
            and not scheduler_output.scheduled_spec_decode_tokens
        )
        check_stop = self._check_stop
        max_len = self.max_model_len
        errors = self._errors
        last_client = -1
        last_outs: list[EngineCoreOutput] = []
        ids = list(scheduler_output.num_scheduled_tokens)
        start = 0
        num_generated = 0  # tokens this update reports (self.num_generation_tokens)
        fast_reqs = step.fast_reqs
        steady = fast and fast_reqs is not None and step.release_mark == self._num_released and step.fast_ids == ids
        step_sampled = all_sampled
        if steady and mro.req_ids != ids:  # the runner's order (its batch rows'): each request's tokens, in ours
            try:
                step_sampled = list(map(all_sampled.__getitem__, map(mro.req_id_to_index.__getitem__, ids)))
            except (KeyError, IndexError):  # not every request in the output: the general loop looks each up
                steady = False
        if steady:
            assert fast_reqs is not None
            # Every request of the step went through schedule's decode fast path and none was released since: each
            # is still live (the lookups below would find the same request), each samples with async scheduling
            # (in sync: once its tokens are all computed), and step_sampled holds their tokens in the step's order.
            # The decode body below without the lookups, up to the first request that is anything else (preempted
            # while in flight, several tokens, pooling): the loop after this one takes it from there.
            last_max = max_len - 1
            for rid, req, sampled in zip(ids, fast_reqs, step_sampled):
                if req.status is not RUNNING or len(sampled) != 1 or req.pooling_params is not None:
                    break
                num_computed = req.num_computed_tokens
                all_ids = req.all_token_ids
                num_tokens = len(all_ids)
                if async_scheduling:
                    req.num_output_placeholders -= 1
                elif num_computed < num_tokens:
                    break
                start += 1
                # Prefix caching: every block full of known tokens is computed. Step N ran this request's last known
                # or in-flight position (a one-token decode), so the tokens computed through N (num_computed less
                # those of the steps after it, _scheduled_later) are at least its known tokens (each earlier step
                # in flight brought at most one), and the general path's min(computed, num_tokens) is num_tokens.
                if caching and num_tokens // block_size > num_cached_get(rid, 0):
                    kv.cache_blocks(req, num_tokens)
                tok = sampled[0]
                out_ids = req.output_token_ids
                out_ids.append(tok)
                all_ids.append(tok)
                n_out = len(out_ids)
                max_tokens = req.max_tokens
                stop_ids = req.sampling_params._all_stop_token_ids
                num_cached = req.num_cached_tokens
                if num_cached < 0:
                    num_cached = 0
                if (
                    tok == req.eos_token_id
                    or (stop_ids and tok in stop_ids)
                    or (max_tokens is not None and n_out >= max_tokens)
                    or num_tokens >= last_max
                ) and check_stop(req):
                    stopped.append(req)
                    out = EngineCoreOutput(
                        rid,
                        [tok],
                        None,
                        None,
                        req.get_finish_reason(),
                        req.stop_reason,
                        num_cached,
                        errors.pop(rid, None),
                        req.queued_ts if n_out == 1 else 0.0,
                        req.scheduled_ts if n_out == 1 else 0.0,
                    )
                elif n_out == 1:
                    out = EngineCoreOutput(
                        rid, [tok], None, None, None, req.stop_reason, num_cached, None, req.queued_ts, req.scheduled_ts
                    )
                else:
                    out = EngineCoreOutput(rid, [tok], None, None, None, req.stop_reason, num_cached)
                client = req.client_index
                if client != last_client:
                    last_outs = per_client[client]
                    last_client = client
                last_outs.append(out)
        # Per request: (id, the request the step ran, does it sample, the live request of that id, its index in
        # the runner's output), found by C loops (map) rather than per-request lookups in the loop below.
        if steady:
            assert fast_reqs is not None
            self.num_whole_step_requests += start
            num_generated = start
            rest_reqs = fast_reqs[start:]
            rest_ids = ids[start:]
            items: Iterable[tuple[str, Optional[Request], bool, Optional[Request], Optional[int]]] = zip(
                rest_ids,
                rest_reqs,
                itertools.repeat(async_scheduling),
                rest_reqs,
                map(index_get, rest_ids),
            )
        else:
            scheduled = step.requests
            samplers = step.samplers
            items = zip(
                ids,
                list(map(scheduled.get, ids)),
                map(samplers.__contains__, ids) if samplers else itertools.repeat(False),
                map(live_get, ids),
                map(index_get, ids),
            )
        for rid, req, samples, live, idx in items:
            if samples:  # its token is known now (or dropped with the request, or lost with the step)
                assert req is not None and req.num_output_placeholders > 0
                req.num_output_placeholders -= 1
            if req is None or live is not req:
                continue  # aborted (or finished) while the step was in flight
            if req.status != RUNNING:
                # Preempted while the step was in flight (async scheduling only): vLLM keeps its token.
                if samples and req.status in (RequestStatus.PREEMPTED, RequestStatus.SWAPPED):
                    out = self._take_off_device_token(req, mro)
                    if out is not None:
                        num_generated += 1
                        per_client[req.client_index].append(out)
                        if req.is_finished():
                            stopped_off_device.append(req)
                continue
            if fast and idx is not None and req.pooling_params is None:
                sampled = all_sampled[idx]
                if len(sampled) <= 1:
                    num_computed = req.num_computed_tokens
                    all_ids = req.all_token_ids
                    num_tokens = len(all_ids)
                    if caching and (
                        num_computed if num_computed < num_tokens else num_tokens
                    ) // block_size > num_cached_get(rid, 0):
                        computed = num_computed - self._scheduled_later(req) if self._in_flight else num_computed
                        kv.cache_blocks(req, min(computed, num_tokens))
                    if not sampled or not (samples if async_scheduling else num_computed >= num_tokens):
                        continue  # a prompt chunk: nothing to report
                    tok = sampled[0]
                    out_ids = req.output_token_ids
                    out_ids.append(tok)
                    all_ids.append(tok)
                    n_out = len(out_ids)
                    max_tokens = req.max_tokens
                    stop_ids = req.sampling_params._all_stop_token_ids
                    finished = (
                        tok == req.eos_token_id
                        or (stop_ids and tok in stop_ids)
                        or (max_tokens is not None and n_out >= max_tokens)
                        or num_tokens >= max_len - 1
                    ) and check_stop(req)
                    num_cached = req.num_cached_tokens
                    out = EngineCoreOutput(
                        rid,
                        [tok],
                        None,
                        None,
                        req.get_finish_reason() if finished else None,
                        req.stop_reason,
                        num_cached if num_cached > 0 else 0,
                        errors.pop(rid, None) if finished else None,
                        req.queued_ts if n_out == 1 else 0.0,
                        req.scheduled_ts if n_out == 1 else 0.0,
                    )
                    if finished:
                        stopped.append(req)
                    num_generated += 1
                    client = req.client_index
                    if client != last_client:
                        last_outs = per_client[client]
                        last_client = client
                    last_outs.append(out)
                    continue
            drafts = drafts_get(rid)
            if drafts:  # the rejected drafts' KV is not kept: num_computed_tokens drops back over them
                self.spec.rollback(req, len(drafts), len(all_sampled[idx]) if idx is not None else 0)
            # Only blocks full of known tokens are hashed; accepted drafts' blocks are cached at the next step.
            # Async scheduling: not the tokens of the step after this one, still in flight (it may yet fail).
            num_computed = req.num_computed_tokens
            num_tokens = len(req.all_token_ids)
            if caching and min(num_computed, num_tokens) // block_size > num_cached_get(rid, 0):
                computed = num_computed - self._scheduled_later(req) if self._in_flight else num_computed
                kv.cache_blocks(req, min(computed, num_tokens))
            if req.pooling_params is not None:  # its whole prompt ran: it finishes with its pooled output
                per_client[req.client_index].append(finish_pooling_request(req, mro, idx))
                stopped.append(req)
                continue
            sampled = all_sampled[idx] if idx is not None else []
            rope_switch = req.rope_recompute_at is not None  # only then can a token change its rope regime
            was_long_rope = rope_switch and req.uses_long_rope
            new_token_ids: list[int] = []
            finished = False
            # Tokens only count once the whole known sequence ran (a mid-prompt chunk samples nothing); with async
            # scheduling the schedule recorded which requests sample (num_computed_tokens may include the next step).
            if sampled and (samples if async_scheduling else num_computed >= num_tokens):
                for tok in sampled:
                    req.append_output_token(tok)
                    new_token_ids.append(tok)
                    if self._check_stop(req) or (
                        req.structured_output_request is not None and self._advance_grammar(req, tok)
                    ):
                        finished = True
                        break
            if spec_enabled and idx is not None:
                proposed = mro.spec_token_ids[idx] if mro.spec_token_ids is not None and not finished else []
                req.spec_token_ids = proposed
            new_logprobs = None
            if new_token_ids and mro.logprobs is not None and req.sampling_params.logprobs is not None:
                start = mro.logprobs_cu[idx] if mro.logprobs_cu is not None else idx
                new_logprobs = mro.logprobs.slice(start, start + len(new_token_ids))
            prompt_lp = prompt_lp_get(rid)
            if prompt_lp is not None and len(req.output_token_ids) > len(new_token_ids):
                prompt_lp = None  # sent whole before this recompute (preemption, rope switch): not again
            if finished:
                stopped.append(req)
            elif rope_switch and req.uses_long_rope != was_long_rope:
                self._recompute_for_long_rope(req)
            if new_token_ids or finished or prompt_lp is not None:
                num_generated += len(new_token_ids)
                first = len(new_token_ids) == len(req.output_token_ids) and bool(new_token_ids)
                per_client[req.client_index].append(
                    EngineCoreOutput(
                        request_id=rid,
                        new_token_ids=new_token_ids,
                        new_logprobs=new_logprobs,
                        new_prompt_logprobs_tensors=prompt_lp,
                        finish_reason=req.get_finish_reason() if finished else None,
                        stop_reason=req.stop_reason,
                        error=self._errors.pop(rid, None) if finished else None,
                        num_cached_tokens=max(req.num_cached_tokens, 0),
                        queued_ts=req.queued_ts if first else 0.0,
                        scheduled_ts=req.scheduled_ts if first else 0.0,
                    )
                )
        self.num_generation_tokens += num_generated
        failed, self._failed_before_running = self._failed_before_running, []
        for req in failed:  # grammar compile errors: one ERROR output each, to their own frontend
            message = self._errors.pop(req.request_id, None)
            per_client[req.client_index].append(
                EngineCoreOutput(req.request_id, [], finish_reason=req.get_finish_reason(), error=message)
            )
        if stopped:
            ids = {r.request_id for r in stopped}
            self.running = [r for r in self.running if r.request_id not in ids]
            for req in stopped:
                self._release(req)
        for req in stopped_off_device:
            self.waiting.remove_requests([req])
            self.swapped.remove_requests([req])
            self._release(req)
        if not per_client:
            return {}
        stats = self.make_stats()
        if len(per_client) == 1:
            ((c, outs),) = per_client.items()
            return {c: EngineCoreOutputs(outputs=outs, scheduler_stats=stats)}
        # The step's counters go to one frontend only, so frontends' metrics sum to the core's totals;
        # every frontend gets the gauges (running, waiting, KV usage).
        gauges_only = msgspec.structs.replace(
            stats, prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions=0, spec_decoding_stats=None
        )
        first = min(per_client)
        return {
            c: EngineCoreOutputs(outputs=outs, scheduler_stats=stats if c == first else gauges_only)
            for c, outs in per_client.items()
        }

    def _take_off_device_token(self, req: Request, mro: ModelRunnerOutput) -> Optional[EngineCoreOutput]:
        """Async scheduling: the token a request sampled in a step that was in flight when it was preempted.
        It is appended as if the step had ended before the preemption (the request then recomputes or swaps in
        with it); its stop checks run, and a request it ends leaves the waiting or swapped queue (the caller)."""
        idx = mro.req_id_to_index.get(req.request_id)
        sampled = mro.sampled_token_ids[idx] if idx is not None else []
        if not sampled:
            return None
        tok = sampled[0]
        req.append_output_token_ids(tok)
        finished = self._check_stop(req)
        new_logprobs = None
        if mro.logprobs is not None and req.sampling_params.logprobs is not None:
            start = mro.logprobs_cu[idx] if mro.logprobs_cu is not None else idx
            new_logprobs = mro.logprobs.slice(start, start + 1)
        first = req.num_output_tokens == 1
        prompt_lp = mro.prompt_logprobs_dict.get(req.request_id) if first else None
        return EngineCoreOutput(
            request_id=req.request_id,
            new_token_ids=[tok],
            new_logprobs=new_logprobs,
            new_prompt_logprobs_tensors=prompt_lp,
            finish_reason=req.get_finish_reason() if finished else None,
            stop_reason=req.stop_reason,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            queued_ts=req.queued_ts if first else 0.0,
            scheduled_ts=req.scheduled_ts if first else 0.0,
        )

    def _check_stop(self, req: Request) -> bool:
        """Sets the finished status; EOS and stop tokens only count once min_tokens are out."""
        sp = req.sampling_params
        outputs = req.output_token_ids
        last = outputs[-1]
        num_outputs = len(outputs)
        if num_outputs >= sp.min_tokens:
            if not sp.ignore_eos and req.eos_token_id is not None and last == req.eos_token_id:
                req.status = RequestStatus.FINISHED_STOPPED
                return True
            # The list itself, not the all_stop_token_ids property (a copy per call): read here, never changed.
            stop_ids = sp._all_stop_token_ids
            if stop_ids and last in stop_ids:
                req.status = RequestStatus.FINISHED_STOPPED
                req.stop_reason = last
                return True
        if req.max_tokens is not None and num_outputs >= req.max_tokens:
            req.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        if len(req.all_token_ids) >= self.max_model_len:
            req.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    def _release(self, req: Request) -> None:
        """Forget a finished request: free its blocks, tell the worker to drop it."""
        rid = req.request_id
        self._num_released += 1
        self.kv_cache_manager.free(req)
        self._resend.discard(rid)
        if rid in self._in_worker:
            self._in_worker.discard(rid)
            self._finished_req_ids.add(rid)
        if self.requests.pop(rid, None) is not None and req.structured_output_request is not None:
            self._num_constrained -= 1
        self._arrival_order.pop(rid, None)
