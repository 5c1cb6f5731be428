"""EngineCore: the schedule -> execute_model -> update loop, in whatever process hosts it."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable, Optional

from vllm_lite.config import VllmConfig
from vllm_lite.core.lora_utilities import lora_utilities
from vllm_lite.core.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    SchedulerStats,
)
from vllm_lite.core.request import Request, RequestStatus
from vllm_lite.core.request_validation import RequestLimits, validate_request
from vllm_lite.core.sched.scheduler import Scheduler
from vllm_lite.core.step_recovery import RecoveredStep, recover_failed_step
from vllm_lite.spec_decode.metrics import SpecDecodingStats
from vllm_lite.worker.executor import get_executor_class

logger = logging.getLogger("vllm_lite.engine_core")
# Longest a step with nothing to run waits for a compiling grammar (new input is read between steps).
_GRAMMAR_WAIT_S = 0.01


class EngineCore:
    """Owns the model (through the executor), the KV cache and the scheduler."""

    def __init__(self, vllm_config: VllmConfig, executor_class: Optional[Callable[[VllmConfig], Any]] = None) -> None:
        """``executor_class``: as vLLM's; None picks one for the parallel config (tests pass a model-free one)."""
        t0 = time.perf_counter()
        self.config = vllm_config
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
        return self.scheduler.has_unfinished_requests()

    # ------------------------------------------------------------------ step
    def step(self) -> dict[int, EngineCoreOutputs]:
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
        self._stats_log.record(scheduler_output.total_num_scheduled_tokens, outputs)
        return outputs

    # ------------------------------------------------------------------ utility calls
    def call_utility(self, method: str, args: list[Any]) -> Any:
        fn: Callable[..., Any] | None = self._utilities().get(method)
        if fn is None:
            raise ValueError(f"unknown utility method {method!r}; known: {sorted(self._utilities())}")
        return fn(*args)

    def _utilities(self) -> dict[str, Callable[..., Any]]:
        return {
            "ping": lambda: True,
            "get_stats": lambda: _stats_dict(self.scheduler.make_stats(reset=False)),
            "reset_prefix_cache": self.scheduler.reset_prefix_cache,
            "get_num_free_blocks": lambda: self.scheduler.num_free_blocks,
            "get_num_total_blocks": lambda: self.scheduler.num_total_blocks,
            "get_model_facts": lambda: dict(self.model_facts),
            "get_num_unfinished_requests": self.scheduler.get_num_unfinished_requests,
            **lora_utilities(self.executor, self.config.lora_config),
        }

    def shutdown(self) -> None:
        self.scheduler.structured_output_manager.shutdown()
        self.executor.shutdown()


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

    def record(self, num_scheduled_tokens: int, outputs: dict[int, EngineCoreOutputs]) -> None:
        stats = None
        gen = 0
        for o in outputs.values():
            gen += sum(len(x.new_token_ids) for x in o.outputs)
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
