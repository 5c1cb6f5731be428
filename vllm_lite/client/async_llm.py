"""AsyncLLM: the asyncio frontend (the OpenAI server's engine), as in vLLM V1.

Each ``generate()`` call tokenizes, registers the request with the
OutputProcessor together with its own ``RequestOutputCollector`` mailbox, sends
it to the core, then yields from the mailbox. One output-handler task per
event loop pulls ``EngineCoreOutputs``, runs ``process_outputs`` (which fills
the mailboxes) and sends aborts for requests a stop string ended. Leaving a
generator early (task cancelled, ``aclose()``, ``break``) aborts the request
in the core. When the core dies every waiting generator gets EngineDeadError.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing
from typing import Any, AsyncGenerator, Iterable, Optional, Union

import msgspec

from vllm_lite.client.core_client import EngineCoreClient, make_client
from vllm_lite.client.exceptions import EngineDeadError
from vllm_lite.client.output_processor import OutputProcessor, RequestOutputCollector
from vllm_lite.client.parallel_sampling import ParentRequest
from vllm_lite.client.processor import Processor, PromptType
from vllm_lite.client.tokenizer import get_tokenizer
from vllm_lite.config import ModelConfig, VllmConfig
from vllm_lite.core.messages import EngineCoreRequest, SchedulerStats
from vllm_lite.engine_args import EngineArgs
from vllm_lite.lora.request import LoRARequest
from vllm_lite.outputs import PoolingRequestOutput, RequestOutput
from vllm_lite.pooling_params import PoolingParams
from vllm_lite.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Core outputs processed per slice before the output handler lets other tasks run.
_OUTPUT_CHUNK = 256


class AsyncLLM:
    """Many concurrent streaming requests over one engine core (its own process)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        *,
        client: Optional[EngineCoreClient] = None,
        log_stats: bool = False,
        **client_kwargs: Any,
    ) -> None:
        self.vllm_config = vllm_config
        self.model_config: ModelConfig = vllm_config.model_config
        self.tokenizer = get_tokenizer(self.model_config.tokenizer)
        self.processor = Processor(self.model_config, self.tokenizer, lora_config=vllm_config.lora_config)
        self.output_processor = OutputProcessor(self.tokenizer, log_stats=log_stats)
        self.engine_core: EngineCoreClient = client or make_client(
            vllm_config, multiprocess=True, asyncio_mode=True, **client_kwargs
        )
        self.last_scheduler_stats: Optional[SchedulerStats] = None
        self._stat_loggers: list[Any] = []
        self._handler: Optional[asyncio.Task] = None
        self._handler_loop: Optional[asyncio.AbstractEventLoop] = None
        self._dead: Optional[EngineDeadError] = None
        self._closed = False
        self._background: set[asyncio.Task] = set()

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, **kwargs: Any) -> "AsyncLLM":
        """Spawn a private engine core for these arguments (data_parallel_size D > 1: D cores, requests routed)."""
        configs = engine_args.create_dp_engine_configs()
        if len(configs) == 1 or "client" in kwargs:
            return cls(configs[0], **kwargs)
        from vllm_lite.client.private_dp import make_private_dp_client

        log_stats = kwargs.pop("log_stats", False)
        client = make_private_dp_client(configs, asyncio_mode=True, **kwargs)  # the rest are client options
        try:
            return cls(configs[0], client=client, log_stats=log_stats)
        except BaseException:
            client.shutdown()
            raise

    @classmethod
    def attach(
        cls, address: str, auth_token: Optional[str] = None, *, data_parallel_size: int = 1, **kwargs: Any
    ) -> "AsyncLLM":
        """Attach to a running engine core (``vllm-lite serve``) at ``tcp://HOST:PORT`` or ``ipc:///PATH``.

        Request ids get this frontend's private namespace in the shared core, and with
        ``data_parallel_size`` > 1 requests are spread over the daemon's cores. The
        tokenizer and model config come from the paths the core reports, so this
        frontend must see the same files (same host or shared storage).
        """
        from vllm_lite.client.dp_client import make_attached_client
        from vllm_lite.client.llm_engine import attached_frontend_config

        client = make_attached_client(address, auth_token, data_parallel_size=data_parallel_size, asyncio_mode=True)
        try:
            return cls(attached_frontend_config(client), client=client, **kwargs)
        except BaseException:
            client.shutdown()
            raise

    # ------------------------------------------------------------------ state
    @property
    def errored(self) -> bool:
        return self._dead is not None or self.engine_core.is_dead

    @property
    def is_running(self) -> bool:
        """Not shut down and the engine alive (vLLM: the output handler still runs)."""
        return not self._closed and not self.errored

    @property
    def is_stopped(self) -> bool:
        return self.errored

    @property
    def dead_error(self) -> EngineDeadError:
        return self._dead or EngineDeadError()

    async def get_tokenizer(self) -> Any:
        """Awaited, as vLLM's AsyncLLM.get_tokenizer (``self.tokenizer`` is the same object)."""
        return self.tokenizer

    async def get_model_config(self) -> ModelConfig:
        return self.model_config

    async def get_vllm_config(self) -> VllmConfig:
        return self.vllm_config

    async def check_health(self) -> None:
        """Raises EngineDeadError unless the core answers (vLLM checks only its own flag; we also ping)."""
        if self.errored:
            raise self.dead_error
        await self.engine_core.call_utility_async("ping")

    def add_stat_logger(self, stat_logger: Any) -> None:
        """`stat_logger.record(scheduler_stats, iteration_stats)` runs for every batch of core outputs
        (vLLM's StatLoggerBase shape); registering one turns on per-iteration stats."""
        self._stat_loggers.append(stat_logger)
        self.output_processor.log_stats = True

    # ------------------------------------------------------------------ requests
    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        priority: int = 0,
        lora_request: Optional[LoRARequest] = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream this request's outputs in ``sampling_params.output_kind``; the last one has finished=True.

        Bad input raises ValueError/TypeError before anything is sent. Stopping the
        iteration early (cancel, aclose, break) aborts the request in the core.
        """
        if self.errored:
            raise self.dead_error
        if self._closed:
            raise EngineDeadError("AsyncLLM was shut down.")
        self._ensure_output_handler()
        if not isinstance(sampling_params, SamplingParams):
            raise TypeError(f"sampling_params must be SamplingParams, got {type(sampling_params).__name__}.")
        prompt_text, request = self.processor.process_inputs(
            request_id,
            prompt,
            sampling_params,
            priority=priority,
            client_index=self.engine_core.client_index,
            lora_request=lora_request,
        )
        queue = RequestOutputCollector(request.sampling_params.output_kind)
        await self._add_request(prompt_text, request, queue)
        async with aclosing(self._stream(queue, request_id)) as stream:  # an early close aborts now, not at GC
            async for out in stream:
                yield out

    async def encode(
        self,
        prompt: PromptType,
        pooling_params: PoolingParams,
        request_id: str,
        priority: int = 0,
        truncate_prompt_tokens: Optional[int] = None,
    ) -> AsyncGenerator[PoolingRequestOutput, None]:
        """A pooling model's output for one prompt (vLLM's ``AsyncLLM.encode``): yields one finished
        PoolingRequestOutput. Set ``pooling_params.task`` ("embed", "classify", ...) as the caller needs.

        Bad input raises ValueError/TypeError before anything is sent; closing the iteration early aborts it.
        """
        if self.errored:
            raise self.dead_error
        if self._closed:
            raise EngineDeadError("AsyncLLM was shut down.")
        self._ensure_output_handler()
        if not isinstance(pooling_params, PoolingParams):
            raise TypeError(f"pooling_params must be PoolingParams, got {type(pooling_params).__name__}.")
        if truncate_prompt_tokens is not None:
            pooling_params = pooling_params.clone()
            pooling_params.truncate_prompt_tokens = truncate_prompt_tokens
            pooling_params.verify()
        prompt_text, request = self.processor.process_inputs(
            request_id, prompt, pooling_params, priority=priority, client_index=self.engine_core.client_index
        )
        queue = RequestOutputCollector()
        await self._add_request(prompt_text, request, queue)
        async with aclosing(self._stream(queue, request_id)) as stream:  # an early close aborts now, not at GC
            async for out in stream:
                yield out

    async def _stream(self, queue: RequestOutputCollector, request_id: str) -> AsyncGenerator[Any, None]:
        """A request's outputs until the finished one; cancelled, closed early or failed: abort it in the core."""
        finished = False
        try:
            while not finished:
                out = queue.get_nowait() or await queue.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self._abort_nowait([request_id])  # never blocks

    async def _add_request(
        self, prompt_text: Optional[str], request: EngineCoreRequest, queue: RequestOutputCollector
    ) -> None:
        params = request.sampling_params
        if params is None or params.num_samples == 1:  # a pooling request, or one sample
            pieces = [(request, None, 0)]
        else:
            parent, children = ParentRequest.make_child_requests(request.request_id, params)
            pieces = [
                (msgspec.structs.replace(request, request_id=cid, sampling_params=cparams), parent, i)
                for i, (cid, cparams) in enumerate(children)
            ]
        # Register every piece first: a clashing id fails before anything reaches the core.
        for child, parent_req, index in pieces:
            try:
                self.output_processor.add_request(child, prompt_text, parent_req, index, queue)
            except ValueError:
                self.output_processor.abort_requests([c.request_id for c, _, i in pieces[:index]])
                raise
        try:
            for child, _, _ in pieces:
                await self.engine_core.add_request_async(child)
        except BaseException:
            self._abort_nowait([request.request_id])
            raise

    async def abort(self, request_id: Union[str, Iterable[str]]) -> None:
        """Abort requests (parent ids abort all their n > 1 children); unknown ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        core_ids = self.output_processor.abort_requests(ids)
        if core_ids and not self.errored and not self._closed:
            await self.engine_core.abort_requests_async(core_ids)

    def _abort_nowait(self, request_ids: list[str]) -> None:
        core_ids = self.output_processor.abort_requests(request_ids)
        if not core_ids or self.errored or self._closed:
            return
        try:
            task = asyncio.get_running_loop().create_task(self.engine_core.abort_requests_async(core_ids))
        except RuntimeError:  # no running loop (generator finalized late): nothing to send with
            return
        self._background.add(task)
        task.add_done_callback(self._background_done)

    def _background_done(self, task: asyncio.Task) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None and not self.errored:
            logger.warning("Sending an abort to the engine core failed: %s", task.exception())

    # ------------------------------------------------------------------ the output handler
    def _ensure_output_handler(self) -> None:
        loop = asyncio.get_running_loop()
        if self._handler is not None and self._handler_loop is loop and not self._handler.done():
            return
        self._handler_loop = loop
        self._handler = loop.create_task(self._run_output_handler(), name="async-llm-output-handler")

    async def _run_output_handler(self) -> None:
        """Core outputs -> per-request mailboxes; stop strings -> aborts; death -> everyone's error."""
        engine_core, processor = self.engine_core, self.output_processor
        try:
            while True:
                outputs = await engine_core.get_output_async()
                if outputs.scheduler_stats is not None:
                    self.last_scheduler_stats = outputs.scheduler_stats
                outs = outputs.outputs
                # A huge step is handled in slices, yielding in between, so the server stays responsive.
                for start in range(0, len(outs), _OUTPUT_CHUNK):
                    if start:
                        await asyncio.sleep(0)
                    processed = processor.process_outputs(outs[start : start + _OUTPUT_CHUNK], outputs.timestamp)
                    for stat_logger in self._stat_loggers:
                        stat_logger.record(outputs.scheduler_stats if not start else None, processed.iteration_stats)
                    if processed.reqs_to_abort:
                        await engine_core.abort_requests_async(processed.reqs_to_abort)
        except asyncio.CancelledError:
            raise
        except EngineDeadError as e:
            self._fail_all(e)
        except Exception as e:  # noqa: BLE001 -- a frontend bug must not leave callers hanging
            logger.exception("AsyncLLM output handler failed.")
            self._fail_all(EngineDeadError(f"The AsyncLLM output handler failed: {type(e).__name__}: {e}"))

    def _fail_all(self, err: EngineDeadError) -> None:
        if self._dead is None:
            self._dead = err
        self.output_processor.propagate_error(self._dead)

    # ------------------------------------------------------------------ utilities
    async def call_utility_async(self, method: str, *args: Any) -> Any:
        if self.errored:
            raise self.dead_error
        return await self.engine_core.call_utility_async(method, *args)

    async def reset_prefix_cache(self) -> bool:
        return bool(await self.call_utility_async("reset_prefix_cache"))

    async def get_stats(self) -> dict[str, Any]:
        return await self.call_utility_async("get_stats")

    async def start_profile(self) -> None:
        """vLLM's: start torch.profiler in the engine core(s); needs $VLLM_TORCH_PROFILER_DIR in the core's
        environment (ValueError otherwise)."""
        if self.errored:
            raise self.dead_error
        await self.engine_core.profile_async(True)

    async def stop_profile(self) -> None:
        """Stop it: each core writes its Chrome trace into $VLLM_TORCH_PROFILER_DIR."""
        if self.errored:
            raise self.dead_error
        await self.engine_core.profile_async(False)

    # ------------------------------------------------------------------ LoRA adapters (vLLM's names)
    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter into the engine ahead of its requests; True if it was not loaded yet."""
        self.processor.check_lora_request(lora_request)
        return bool(await self.call_utility_async("add_lora", lora_request))

    async def remove_lora(self, lora_id: int) -> bool:
        """Drop an adapter from the engine; True if it was loaded."""
        self.processor.forget_lora(lora_id)
        return bool(await self.call_utility_async("remove_lora", lora_id))

    async def list_loras(self) -> set[int]:
        return set(await self.call_utility_async("list_loras"))

    async def pin_lora(self, lora_id: int) -> bool:
        return bool(await self.call_utility_async("pin_lora", lora_id))

    # ------------------------------------------------------------------ shutdown
    def shutdown(self) -> None:
        """Stop the output handler and the engine core; waiting generators get EngineDeadError."""
        if self._closed:
            return
        self._closed = True
        handler = self._handler
        if handler is not None and not handler.done():
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is self._handler_loop:
                handler.cancel()
            elif self._handler_loop is not None and not self._handler_loop.is_closed():
                self._handler_loop.call_soon_threadsafe(handler.cancel)
        self.engine_core.shutdown()
        if self._dead is None:
            self._fail_all(EngineDeadError("AsyncLLM was shut down."))
