"""LLMEngine: the synchronous frontend loop (add_request / step), as in vLLM."""

from __future__ import annotations

import time
from typing import Any, Iterable, Optional, Union

import msgspec

from vllm_lite.client.core_client import EngineCoreClient, make_client
from vllm_lite.client.output_processor import OutputProcessor
from vllm_lite.client.parallel_sampling import ParentRequest
from vllm_lite.client.processor import Processor, PromptType
from vllm_lite.client.startup import load_while_starting
from vllm_lite.client.tokenizer import get_tokenizer
from vllm_lite.config import VllmConfig
from vllm_lite.core.messages import EngineCoreRequest
from vllm_lite.engine_args import EngineArgs
from vllm_lite.lora.request import LoRARequest
from vllm_lite.outputs import PoolingRequestOutput, RequestOutput
from vllm_lite.pooling_params import PoolingParams
from vllm_lite.sampling_params import SamplingParams


class LLMEngine:
    """Tokenizes in, detokenizes out; the engine core (its own process by default) does the rest."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        multiprocess_mode: bool = True,
        client: Optional[EngineCoreClient] = None,
    ) -> None:
        self.vllm_config = vllm_config
        mc = vllm_config.model_config
        if client is None and multiprocess_mode:
            # The core process starts (imports, model load) while this process loads the tokenizer. Not with the
            # core in this process: two threads importing transformers at once can see it half initialised.
            self.tokenizer, client = load_while_starting(
                lambda: get_tokenizer(mc.tokenizer),
                lambda: make_client(vllm_config, multiprocess=multiprocess_mode, asyncio_mode=False),
                lambda c: c.shutdown(),
            )
        else:
            self.tokenizer = get_tokenizer(mc.tokenizer)
            client = client or make_client(vllm_config, multiprocess=multiprocess_mode, asyncio_mode=False)
        self.engine_core = client
        # Offline frontends answer every step that gave a stop-string request a token before the core steps
        # again (StopVerdict), so a stopped request leaves the batch at the same step every run (issue 15).
        self._stop_verdicts = bool(getattr(client, "supports_stop_verdicts", False))
        try:
            self.processor = Processor(mc, self.tokenizer, lora_config=vllm_config.lora_config)
            self.output_processor = OutputProcessor(self.tokenizer, log_stats=False)
        except BaseException:
            client.shutdown()
            raise

    @classmethod
    def from_engine_args(
        cls, engine_args: EngineArgs, multiprocess_mode: bool = True, usage_context: Optional[str] = None
    ) -> "LLMEngine":
        """Start a private engine core (or, with data_parallel_size D > 1, D of them, requests routed over them).

        ``usage_context``: vLLM's (the offline LLM passes LLM_CLASS: it picks the default step budget).
        """
        configs = engine_args.create_dp_engine_configs(usage_context)
        if len(configs) == 1:
            return cls(configs[0], multiprocess_mode=multiprocess_mode)
        if not multiprocess_mode:
            raise ValueError(
                f"data_parallel_size={len(configs)} runs one engine core process per rank; "
                "it cannot run in this process (multiprocess=False)."
            )
        from vllm_lite.client.private_dp import make_private_dp_client

        client = make_private_dp_client(configs, asyncio_mode=False)
        try:
            return cls(configs[0], client=client)
        except BaseException:
            client.shutdown()
            raise

    @classmethod
    def attach(
        cls,
        address: str,
        auth_token: Optional[str] = None,
        *,
        data_parallel_size: int = 1,
        client_name: str = "",
        **client_kwargs: Any,
    ) -> "LLMEngine":
        """Attach to a running engine core (``vllm-lite serve``) at ``tcp://HOST:PORT`` or ``ipc:///PATH``.

        ``data_parallel_size`` > 1 (or a comma-separated list of addresses) attaches to
        every core of a data-parallel daemon and spreads requests over them. The
        tokenizer comes from the path the core reports, so this process must see the
        same files. ``shutdown()`` detaches (the core keeps serving others).
        """
        from vllm_lite.client.dp_client import make_attached_client

        client = make_attached_client(
            address,
            auth_token,
            data_parallel_size=data_parallel_size,
            asyncio_mode=False,
            client_name=client_name,
            **client_kwargs,
        )
        try:
            return cls(attached_frontend_config(client), client=client)
        except BaseException:
            client.shutdown()
            raise

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: Union[SamplingParams, PoolingParams],
        arrival_time: Optional[float] = None,
        priority: int = 0,
        lora_request: Optional[LoRARequest] = None,
    ) -> None:
        """Validate and send one request (n > 1 fans out into child requests sharing the prompt)."""
        prompt_text, request = self.process_request(
            request_id, prompt, params, arrival_time, priority, lora_request=lora_request
        )
        self.add_processed_request(prompt_text, request)

    def process_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: Union[SamplingParams, PoolingParams],
        arrival_time: Optional[float] = None,
        priority: int = 0,
        lora_request: Optional[LoRARequest] = None,
    ) -> tuple[Optional[str], EngineCoreRequest]:
        """Validate and tokenize without sending: raises ValueError/TypeError on bad input."""
        if not isinstance(params, (SamplingParams, PoolingParams)):
            raise TypeError(f"params must be SamplingParams or PoolingParams, got {type(params).__name__}")
        return self.processor.process_inputs(
            request_id,
            prompt,
            params,
            arrival_time=arrival_time or time.time(),
            priority=priority,
            client_index=self.client_index,
            lora_request=lora_request,
        )

    def add_processed_request(self, prompt_text: Optional[str], request: EngineCoreRequest) -> None:
        for core_request in self._track(prompt_text, request):
            self.engine_core.add_request(core_request)

    def add_processed_requests(self, processed: list[tuple[Optional[str], EngineCoreRequest]]) -> None:
        """Send processed requests as one batch, which the core schedules whole (offline ``LLM``): its
        first steps then hold the same requests every run, so greedy bf16 tokens repeat exactly."""
        batch: list[EngineCoreRequest] = []
        for prompt_text, request in processed:
            batch.extend(self._track(prompt_text, request))
        self.engine_core.add_requests(batch)

    def _track(self, prompt_text: Optional[str], request: EngineCoreRequest) -> list[EngineCoreRequest]:
        """Register a request with the output processor; returns what the core runs (n > 1: the children)."""
        request_id = request.request_id
        if request_id in getattr(self.output_processor, "request_states", {}):
            raise ValueError(f"duplicate request id {request_id!r}: a request with this id is still running")
        if self._stop_verdicts and request.sampling_params is not None and request.sampling_params.stop:
            request.await_stop_verdict = True  # n > 1: every child carries it
        if request.sampling_params is None or request.sampling_params.num_samples == 1:  # pooling, or one sample
            self.output_processor.add_request(request, prompt_text)
            return [request]
        parent, children = ParentRequest.make_child_requests(request_id, request.sampling_params)
        core_requests = []
        for index, (child_id, child_params) in enumerate(children):
            child = msgspec.structs.replace(request, request_id=child_id, sampling_params=child_params)
            self.output_processor.add_request(child, prompt_text, parent, index)
            core_requests.append(child)
        return core_requests

    def abort_request(self, request_ids: Union[str, Iterable[str]]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        to_abort = self.output_processor.abort_requests(ids)
        if to_abort:
            self.engine_core.abort_requests(list(to_abort))

    def step(self) -> list[Union[RequestOutput, PoolingRequestOutput]]:
        """One engine step's worth of outputs (blocks until the core sends some)."""
        outputs = self.engine_core.get_output()
        processed = self.output_processor.process_outputs(outputs.outputs, outputs.timestamp)
        if outputs.stop_verdict_step:  # the core waits for this answer (aborts included) before it steps again
            self.engine_core.send_stop_verdict(outputs.stop_verdict_step, processed.reqs_to_abort)
        elif processed.reqs_to_abort:
            self.engine_core.abort_requests(processed.reqs_to_abort)
        return processed.request_outputs

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    # ------------------------------------------------------------------ misc
    @property
    def client_index(self) -> int:
        return self.engine_core.client_index

    def get_tokenizer(self):
        return self.tokenizer

    def call_utility(self, method: str, *args):
        return self.engine_core.call_utility(method, *args)

    def reset_prefix_cache(self) -> bool:
        return bool(self.engine_core.call_utility("reset_prefix_cache"))

    # ------------------------------------------------------------------ profiling (vLLM's names)
    def start_profile(self) -> None:
        """Start torch.profiler in the engine core (every data-parallel rank); needs $VLLM_TORCH_PROFILER_DIR
        in the core's environment (ValueError otherwise)."""
        self.engine_core.profile(True)

    def stop_profile(self) -> None:
        """Stop it: each core writes its Chrome trace into $VLLM_TORCH_PROFILER_DIR."""
        self.engine_core.profile(False)

    # ------------------------------------------------------------------ LoRA adapters (vLLM's names)
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter into the engine's host cache ahead of its requests; True if it was not loaded yet."""
        self.processor.check_lora_request(lora_request)
        return bool(self.engine_core.call_utility("add_lora", lora_request))

    def remove_lora(self, lora_id: int) -> bool:
        """Drop an adapter from the engine (host cache and device slot); True if it was loaded."""
        self.processor.forget_lora(lora_id)
        return bool(self.engine_core.call_utility("remove_lora", lora_id))

    def list_loras(self) -> set[int]:
        """Ids of the adapters the engine holds loaded."""
        return set(self.engine_core.call_utility("list_loras"))

    def pin_lora(self, lora_id: int) -> bool:
        """Keep an adapter in its device slot: LRU eviction passes it over."""
        return bool(self.engine_core.call_utility("pin_lora", lora_id))

    def shutdown(self) -> None:
        self.engine_core.shutdown()


def attached_frontend_config(client: Any, override_generation_config: Optional[dict[str, Any]] = None) -> VllmConfig:
    """The frontend's config for an attached core, from the facts its handshake reported.

    The frontend computes nothing on a device, so it is always a CPU config. ``override_generation_config``: the
    request defaults `serve` was given (a frontend-side setting the core does not report).
    """
    facts = client.model_facts
    config = EngineArgs(
        model=client.model_path,
        tokenizer=client.tokenizer_path or None,
        max_model_len=facts["max_model_len"],
        block_size=facts["block_size"],
        max_logprobs=int(facts.get("max_logprobs", 20)),  # the core's request rules, applied here first
        generation_config=str(facts.get("generation_config", "auto")),
        override_generation_config=override_generation_config,
        runner=str(facts.get("runner_type", "auto")),
        convert=str(facts.get("convert_type", "auto")),
        pooler_config=facts.get("pooler_config"),
        device="cpu",
        # The core's LoRA limits: this frontend refuses what the core would (enable_lora off when None).
        **({"enable_lora": True, **lora} if (lora := facts.get("lora_config")) else {}),
    ).create_engine_config()
    if facts["model"] != config.model_config.model:
        config.model_config.served_model_name = facts["model"]
    return config
