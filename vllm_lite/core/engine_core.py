"""EngineCore: the schedule -> execute_model -> update loop, in whatever process hosts it."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Optional

from vllm_lite.config import VllmConfig, verify_async_scheduling
from vllm_lite.core.gc_heap import gc_state, raise_gc_threshold
from vllm_lite.core.lora_utilities import lora_utilities
from vllm_lite.core.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    SchedulerStats,
)
from vllm_lite.core.profiler import EngineCoreProfiler
from vllm_lite.core.profiler import warm_up as profiler_warm_up
from vllm_lite.core.request import Request, RequestStatus
from vllm_lite.core.request_validation import RequestLimits, validate_request
from vllm_lite.core.sched.scheduler import Scheduler
from vllm_lite.core.step_recovery import RecoveredStep, recover_failed_step
from vllm_lite.spec_decode.metrics import SpecDecodingStats
from vllm_lite.worker.executor import get_executor_class
from vllm_lite.worker.step import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger("vllm_lite.engine_core")
# Longest a step with nothing to run waits for a compiling grammar (new input is read between steps).
_GRAMMAR_WAIT_S = 0.01
# Async scheduling: steps launched and not yet updated, at most (step N+1 runs while step N's output is read).
MAX_STEPS_IN_FLIGHT = 2
# Utility calls that only read counters: they do not wait for the steps in flight (every other one does).
_NO_DRAIN_UTILITIES = frozenset({"ping", "get_stats", "get_model_facts", "get_gc_state"})


@dataclass
class _LaunchedStep:
    """A step launched without waiting (async scheduling): its schedule and the executor's handle on its output
    (`get_output()` blocks until it is known)."""

    scheduler_output: SchedulerOutput
    handle: Any


class _Raise:
    """The handle of a step whose launch raised: get_output() raises the same."""

    def __init__(self, exc: Exception) -> None:
        self._exc = exc

    def get_output(self) -> ModelRunnerOutput:
        raise self._exc


class EngineCore:
    """Owns the model (through the executor), the KV cache and the scheduler."""

    def __init__(self, vllm_config: VllmConfig, executor_class: Optional[Callable[[VllmConfig], Any]] = None) -> None:
        """``executor_class``: as vLLM's; None picks one for the parallel config (tests pass a model-free one)."""
        t0 = time.perf_counter()
        self.config = vllm_config
        verify_async_scheduling(vllm_config)
        profiler_warm_up(vllm_config.device_config.device)  # CUDA + $VLLM_TORCH_PROFILER_DIR only
        self.executor = (executor_class or get_executor_class(vllm_config))(vllm_config)
        num_gpu, num_cpu = self.executor.determine_num_blocks()
        vllm_config.cache_config.num_gpu_blocks = num_gpu
        vllm_config.cache_config.num_cpu_blocks = num_cpu
        self.executor.initialize_cache(num_gpu, num_cpu)
        self.scheduler = Scheduler(vllm_config)
        mc = vllm_config.model_config
        # The scheduler's max_model_len: the configured one, capped by what the KV cache holds.
        self.request_limits = RequestLimits(
            vocab_size=mc.vocab_size,
            max_model_len=self.scheduler.max_model_len,
            max_logprobs=mc.max_logprobs,
            runner_type=mc.runner_type,
            max_pooling_tokens=vllm_config.scheduler_config.max_num_batched_tokens,
        )
        self.model_facts: dict[str, Any] = {
            "model": mc.name,
            "max_model_len": mc.max_model_len,
            "block_size": vllm_config.cache_config.block_size,
            "num_gpu_blocks": num_gpu,
            "vocab_size": mc.vocab_size,
            "max_logprobs": mc.max_logprobs,
            "generation_config": mc.generation_config,
            "runner_type": mc.runner_type,
            "convert_type": mc.convert_type,
            "pooler_config": dataclasses.asdict(mc.pooler_config) if mc.pooler_config is not None else None,
            # LoRAConfig's fields (None: LoRA off), so an attached frontend checks adapters as this core will.
            "lora_config": dataclasses.asdict(lc) if (lc := vllm_config.lora_config) is not None else None,
        }
        self._stats_log = _StatsLogger(vllm_config.scheduler_config.log_stats_interval_s)
        self._num_generation_tokens_logged = 0  # the scheduler's num_generation_tokens at the last record
        # Async scheduling: steps launched, oldest first, and outputs of steps finished early (a drain before a
        # utility call), handed out one per step() call ahead of anything else.
        self.async_scheduling = vllm_config.scheduler_config.async_scheduling
        self.batch_queue: deque[_LaunchedStep] = deque()
        self._ready_outputs: deque[dict[int, EngineCoreOutputs]] = deque()
        self.max_steps_in_flight_seen = 0  # the deepest the batch queue has been (tests check the bound)
        # vLLM's profile(is_start) utility: torch.profiler in this process, traces into $VLLM_TORCH_PROFILER_DIR.
        self.profiler = EngineCoreProfiler(
            vllm_config.device_config.device, lambda: self.scheduler.make_stats(reset=False).step_counter
        )
        logger.info("async scheduling: %s", "on" if self.async_scheduling else "off")
        # A step allocates ~1,300 short-lived containers at batch 256: few young collections from here (the core's
        # own process also freezes its heap: gc_heap.freeze_gc_heap in run_engine_core). Given back at shutdown,
        # or when a core never shut down is collected.
        self._gc_release = raise_gc_threshold(self)
        self.startup_time_s = time.perf_counter() - t0
        logger.info(
            "engine core ready in %.2fs: model=%s dtype=%s kv_blocks=%d (block_size=%d) swap_blocks=%d",
            self.startup_time_s,
            mc.model,
            str(mc.dtype).replace("torch.", ""),
            num_gpu,
            vllm_config.cache_config.block_size,
            num_cpu,
        )

    # ------------------------------------------------------------------ requests
    def add_request(self, request: EngineCoreRequest, tenant_salt: Optional[bytes] = None) -> None:
        """Validate against the model and queue; a bad request raises ValueError and leaves everything else untouched.

        ``tenant_salt``: the sending frontend's prefix-cache salt, from the core (see engine_core_proc).
        """
        validate_request(request, self.request_limits)
        rid = request.request_id
        if self.scheduler.get_request(rid) is not None:
            raise ValueError(f"duplicate request id {rid!r}: a request with this id is still running")
        self.scheduler.add_request(Request.from_engine_core_request(request, tenant_salt))

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        """Requests in the scheduler, or (async scheduling) a step in flight or outputs not handed out yet."""
        return self.scheduler.has_unfinished_requests() or bool(self.batch_queue) or bool(self._ready_outputs)

    # ------------------------------------------------------------------ step
    def step(self, allow_overlap: bool = True) -> dict[int, EngineCoreOutputs]:
        """One engine step's outputs. With async scheduling, step N+1 is scheduled and launched before step N's
        output is awaited (`allow_overlap=False`, or a batch that needs it, runs the plain synchronous step
        once the steps in flight are done)."""
        if self._ready_outputs:
            return self._ready_outputs.popleft()
        if self.async_scheduling:
            return self._step_with_batch_queue(allow_overlap)
        return self._step_sync()

    def _step_sync(self) -> dict[int, EngineCoreOutputs]:
        if not self.scheduler.has_unfinished_requests():
            return {}
        scheduler_output = self.scheduler.schedule()
        recovered = None
        try:
            model_output = self.executor.execute_model(scheduler_output)
        except Exception as exc:
            # Defence in depth (validation should have stopped it): pin the failure to its request(s),
            # or let it kill the core as before when it belongs to none.
            recovered = recover_failed_step(self.scheduler, self.executor, scheduler_output, exc)
            if recovered is None:
                raise
            model_output = recovered.model_output
        outputs = self.scheduler.update_from_output(scheduler_output, model_output)
        if recovered is not None:
            _add_error_outputs(outputs, recovered)
        if scheduler_output.total_num_scheduled_tokens == 0:
            # Only grammars compiling (or nothing runnable): wait briefly for one rather than spin.
            self.scheduler.wait_for_grammar(_GRAMMAR_WAIT_S)
        self._record_stats(scheduler_output.total_num_scheduled_tokens, outputs)
        return outputs

    # ------------------------------------------------------------------ async scheduling
    def _step_with_batch_queue(self, allow_overlap: bool) -> dict[int, EngineCoreOutputs]:
        """vLLM's step_with_batch_queue: schedule and launch step N+1, then wait for step N and update from it.

        Order (the executor relies on it): execute(N+1, non_block) may come before get_output(N); get_output(N)
        always comes before execute(N+2). A batch that cannot overlap (`Scheduler.must_sync`, or
        allow_overlap=False) first lets the steps in flight finish, one per call, then runs synchronously."""
        sched = self.scheduler
        if not allow_overlap or sched.must_sync():
            if self.batch_queue:
                return self._finish_oldest()
            return self._step_sync()
        if len(self.batch_queue) < MAX_STEPS_IN_FLIGHT and sched.has_unfinished_requests():
            so = sched.schedule()
            try:
                handle = self.executor.execute_model(so, non_block=True)
            except Exception as exc:
                return self._launch_failed(so, exc)
            self.batch_queue.append(_LaunchedStep(so, handle))
            self.max_steps_in_flight_seen = max(self.max_steps_in_flight_seen, len(self.batch_queue))
            if len(self.batch_queue) == 1:
                return {}  # the pipeline just started (or refilled): the next call launches N+1, then waits on N
        if not self.batch_queue:
            return {}
        return self._finish_oldest()

    def _finish_oldest(self) -> dict[int, EngineCoreOutputs]:
        """Wait for the oldest step in flight and update the scheduler from it."""
        launched = self.batch_queue.popleft()
        so = launched.scheduler_output
        recovered = None
        try:
            model_output = launched.handle.get_output()
        except Exception as exc:
            model_output, recovered = self._output_failed(so, exc)
        outputs = self.scheduler.update_from_output(so, model_output)
        if recovered is not None:
            _add_error_outputs(outputs, recovered)
        self._record_stats(so.total_num_scheduled_tokens, outputs)
        return outputs

    def _record_stats(self, num_scheduled_tokens: int, outputs: dict[int, EngineCoreOutputs]) -> None:
        """The stats line's counters for one updated step: its sampled tokens are the scheduler's count since the
        last record (every update_from_output is recorded once), not a walk over the step's outputs."""
        total = self.scheduler.num_generation_tokens
        generated = total - self._num_generation_tokens_logged
        self._num_generation_tokens_logged = total
        self._stats_log.record(num_scheduled_tokens, outputs, generated)

    def _launch_failed(self, so: SchedulerOutput, exc: Exception) -> dict[int, EngineCoreOutputs]:
        """Launching step N+1 raised: finish step N first, then recover N+1 exactly as the synchronous step does
        (no step in flight by then). N's outputs are this call's, N+1's (with its culprits' errors) the next's."""
        self.batch_queue.append(_LaunchedStep(so, _Raise(exc)))
        outputs = self._finish_oldest() if len(self.batch_queue) > 1 else {}
        if not self.batch_queue:
            return outputs  # step N failed too: N+1 was taken back (_output_failed) and is scheduled again
        self.batch_queue.pop()
        recovered = recover_failed_step(self.scheduler, self.executor, so, exc, async_step=True)
        if recovered is None:
            raise exc
        later = self.scheduler.update_from_output(so, recovered.model_output)
        _add_error_outputs(later, recovered)
        self._record_stats(so.total_num_scheduled_tokens, later)
        if not outputs:
            return later
        self._ready_outputs.append(later)
        return outputs

    def _output_failed(self, so: SchedulerOutput, exc: Exception) -> tuple[ModelRunnerOutput, RecoveredStep]:
        """Reading step N's output raised. Step N+1 (launched on N's tokens) is waited for and taken back (its
        requests rewind and go to the worker in full again), then step N is recovered as a synchronous step."""
        if self.batch_queue:
            newer = self.batch_queue.pop()
            assert not self.batch_queue
            try:
                newer.handle.get_output()
            except Exception:  # noqa: BLE001 -- it ran on the failed step's tokens: taken back either way
                logger.warning("the step after a failed one failed too; both are taken back", exc_info=True)
            if newer.scheduler_output.blocks_to_swap_out:
                raise exc  # its swap-out copied what the failed step wrote: nothing to replay from
            self.scheduler.unschedule_last(newer.scheduler_output)
        recovered = recover_failed_step(self.scheduler, self.executor, so, exc, async_step=True)
        if recovered is None:
            raise exc
        return recovered.model_output, recovered

    def drain(self) -> None:
        """Finish every step in flight (their outputs come with the next step() calls): before anything that
        touches the scheduler's or the worker's state from outside the step loop."""
        while self.batch_queue:
            self._ready_outputs.append(self._finish_oldest())

    def take_ready_outputs(self) -> list[dict[int, EngineCoreOutputs]]:
        """The finished steps' outputs not handed out yet (drain() leaves them here), oldest first, now: whoever
        answers a utility call sends these before the answer, so a client that hears "nothing unfinished" has
        already been sent every output of the steps before it."""
        ready = list(self._ready_outputs)
        self._ready_outputs.clear()
        return ready

    # ------------------------------------------------------------------ utility calls
    def call_utility(self, method: str, args: list[Any]) -> Any:
        fn: Callable[..., Any] | None = self._utilities().get(method)
        if fn is None:
            raise ValueError(f"unknown utility method {method!r}; known: {sorted(self._utilities())}")
        if method not in _NO_DRAIN_UTILITIES:
            self.drain()
        return fn(*args)

    def _utilities(self) -> dict[str, Callable[..., Any]]:
        return {
            "ping": lambda: True,
            "get_stats": lambda: _stats_dict(self.scheduler.make_stats(reset=False)),
            "reset_prefix_cache": self.scheduler.reset_prefix_cache,
            "get_num_free_blocks": lambda: self.scheduler.num_free_blocks,
            "get_num_total_blocks": lambda: self.scheduler.num_total_blocks,
            "get_model_facts": lambda: dict(self.model_facts),
            "get_gc_state": gc_state,
            "get_num_unfinished_requests": self.scheduler.get_num_unfinished_requests,
            "profile": self.profile,
            **lora_utilities(self.executor, self.config.lora_config),
        }

    def profile(self, is_start: bool = True) -> Optional[str]:
        """vLLM's EngineCore.profile: start, or stop torch.profiler and write this core's Chrome trace into
        $VLLM_TORCH_PROFILER_DIR (the path is returned). A utility call, so the steps in flight are drained
        first (the window holds whole steps). ValueError when the variable is unset; RuntimeError on a start
        while running or a stop while not."""
        return self.profiler.profile(bool(is_start))

    def shutdown(self) -> None:
        try:
            self.drain()
        except Exception:  # noqa: BLE001 -- shutting down: a failed step in flight must not stop the rest
            logger.exception("a step in flight failed during shutdown")
        try:
            self.profiler.shutdown()
            self.scheduler.structured_output_manager.shutdown()
            self.executor.shutdown()
        finally:
            if getattr(self, "_gc_release", None) is not None:  # a finalizer: once, however often it is called
                self._gc_release()


def _add_error_outputs(outputs: dict[int, EngineCoreOutputs], recovered: RecoveredStep) -> None:
    """One ERROR output per culprit, to the frontend that sent it."""
    for rid, (client, message) in recovered.failed.items():
        out = EngineCoreOutput(rid, [], finish_reason=FinishReason.ERROR, error=message)
        if client in outputs:
            outputs[client].outputs.append(out)
        else:
            outputs[client] = EngineCoreOutputs(outputs=[out])


def _stats_dict(stats: SchedulerStats) -> dict[str, Any]:
    return {f: getattr(stats, f) for f in stats.__struct_fields__}


class _StatsLogger:
    """A periodic structured log line: throughput, running/waiting, KV usage, prefix-cache hit rate."""

    def __init__(self, interval_s: Optional[float]) -> None:
        self.interval_s = interval_s
        self.last_log = time.monotonic()
        self.prompt_tokens = 0
        self.gen_tokens = 0
        self.queries = 0
        self.hits = 0
        self.preemptions = 0
        self.spec: Optional[SpecDecodingStats] = None  # speculative decoding counters since the last line

    def record(
        self, num_scheduled_tokens: int, outputs: dict[int, EngineCoreOutputs], num_generated: Optional[int] = None
    ) -> None:
        """``num_generated``: the step's sampled tokens when the caller knows them (the engine core: from the
        scheduler); None counts them in ``outputs``."""
        if self.interval_s is None:  # no log line: nothing to count (a pass over every output a step)
            return
        stats = None
        gen = 0
        for o in outputs.values():
            if num_generated is None:
                gen += sum([len(x.new_token_ids) for x in o.outputs])  # a list: faster than a generator here
            stats = o.scheduler_stats or stats
            if o.scheduler_stats is not None:  # the step's counters ride on one frontend's batch only
                self.queries += o.scheduler_stats.prefix_cache_queries
                self.hits += o.scheduler_stats.prefix_cache_hits
                self.preemptions += o.scheduler_stats.num_preemptions
                spec = o.scheduler_stats.spec_decoding_stats
                if spec is not None:
                    if self.spec is None:
                        self.spec = SpecDecodingStats.new(spec.num_spec_tokens)
                    self.spec.merge(spec)
                    num_scheduled_tokens -= spec.num_draft_tokens - spec.num_accepted_tokens  # not prompt tokens
        if num_generated is not None:
            gen = num_generated
        self.gen_tokens += gen
        self.prompt_tokens += max(0, num_scheduled_tokens - gen)
        now = time.monotonic()
        if stats is None or self.interval_s is None or now - self.last_log < self.interval_s:
            return
        dt = now - self.last_log
        hit_rate = self.hits / self.queries if self.queries else 0.0
        logger.info(
            "engine stats: prompt_tput=%.1f tok/s gen_tput=%.1f tok/s running=%d waiting=%d kv_usage=%.1f%% "
            "prefix_cache_hit_rate=%.1f%% preemptions=%d",
            self.prompt_tokens / dt,
            self.gen_tokens / dt,
            stats.num_running_reqs,
            stats.num_waiting_reqs,
            100 * stats.kv_cache_usage,
            100 * hit_rate,
            self.preemptions,
        )
        if self.spec is not None:
            logger.info(self.spec.log_message(dt))
            self.spec = None
        self.last_log = now
        self.prompt_tokens = self.gen_tokens = self.queries = self.hits = self.preemptions = 0
