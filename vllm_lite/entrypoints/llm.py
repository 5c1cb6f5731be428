"""The offline `LLM` class: batch generation with vLLM's signature."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

from tqdm.auto import tqdm

from vllm_lite.client.llm_engine import LLMEngine
from vllm_lite.client.processor import PromptType
from vllm_lite.engine_args import LLM_CLASS, EngineArgs
from vllm_lite.entrypoints import llm_pooling
from vllm_lite.lora.request import LoRARequest
from vllm_lite.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringRequestOutput,
)
from vllm_lite.pooling_params import PoolingParams
from vllm_lite.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from vllm_lite.client.beam_search import BeamSearchOutput


class LLM:
    """An LLM for offline inference: `LLM(model=...).generate(prompts, SamplingParams(...))`.

    `multiprocess=True` (the default) runs the engine core in its own process;
    `multiprocess=False` keeps it in this process for debugging. Results are the same; there an explicit
    `num_threads=N` sets this process's torch threads (the engine computes on them) until `shutdown()`
    (the in-process client's rule, InprocClient, for every in-process engine).
    `data_parallel_size=D` starts D private cores (a model copy and KV cache each; CPU threads
    shared out, or one CUDA device each) and spreads requests over them.
    `LLM(engine_address="tcp://127.0.0.1:8100", auth_token=...)` attaches to a running
    `vllm-lite serve` daemon instead (its engine arguments are the daemon's; `shutdown()`
    detaches). With no model and no address, the bundled default model is used.
    """

    def __init__(
        self,
        model: Optional[str] = None,
        *,
        multiprocess: bool = True,
        engine_address: Optional[Union[str, Sequence[str]]] = None,
        auth_token: Optional[str] = None,
        data_parallel_size: int = 1,
        **kwargs: Any,
    ) -> None:
        self._counter = itertools.count()
        if engine_address is not None:
            if model is not None or kwargs or not multiprocess:
                given = (["model"] if model is not None else []) + (["multiprocess"] if not multiprocess else [])
                given += sorted(kwargs)
                raise TypeError(
                    f"LLM(engine_address=...) attaches to a running core whose engine arguments are fixed by the "
                    f"daemon; do not also pass {given}."
                )
            self.engine_args = None
            self.llm_engine = LLMEngine.attach(engine_address, auth_token, data_parallel_size=data_parallel_size)
            return
        if auth_token is not None:
            raise TypeError("auth_token is only for LLM(engine_address=...): a private engine core makes its own.")
        fields = EngineArgs.__dataclass_fields__
        unknown = sorted(set(kwargs) - set(fields))
        if unknown:
            raise TypeError(f"LLM() got unknown engine arguments {unknown}; known: {sorted(fields)}")
        if model is None:
            from vllm_lite.default_model import DEFAULT_MODEL_NAME, default_model_path

            model = default_model_path()
            kwargs.setdefault("served_model_name", DEFAULT_MODEL_NAME)
        self.engine_args = EngineArgs(model=model, data_parallel_size=data_parallel_size, **kwargs)
        self.llm_engine = LLMEngine.from_engine_args(
            self.engine_args, multiprocess_mode=multiprocess, usage_context=LLM_CLASS
        )

    def get_tokenizer(self):
        return self.llm_engine.get_tokenizer()

    def get_default_sampling_params(self) -> SamplingParams:
        return self.llm_engine.processor.get_default_sampling_params()

    def generate(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        sampling_params: Optional[Union[SamplingParams, Sequence[SamplingParams]]] = None,
        use_tqdm: bool = True,
        lora_request: Optional[Union[LoRARequest, Sequence[LoRARequest]]] = None,
        priority: Optional[list[int]] = None,
    ) -> list[RequestOutput]:
        """Generate for one prompt or a list; returns RequestOutputs in input order.

        ``lora_request``: one adapter for every prompt, or a list with one per prompt (None: the base model).
        """
        llm_pooling.check_runner(self.llm_engine.vllm_config.model_config, "generate", "generate")
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"got {len(params_list)} SamplingParams for {len(prompt_list)} prompts; pass one or one per prompt"
                )
        if priority is not None and len(priority) != len(prompt_list):
            raise ValueError(f"got {len(priority)} priorities for {len(prompt_list)} prompts")
        return self._run(prompt_list, params_list, priority, use_tqdm, _lora_list(lora_request, len(prompt_list)))

    def _run(
        self,
        prompts: list[PromptType],
        params: Sequence[Union[SamplingParams, PoolingParams]],
        priority: Optional[list[int]],
        use_tqdm: bool,
        lora_requests: Optional[list[Optional[LoRARequest]]] = None,
    ) -> list[Any]:
        engine = self.llm_engine
        # Validate everything before anything runs: a bad prompt names its index and nothing is queued.
        processed = []
        for i, (p, sp) in enumerate(zip(prompts, params)):
            if isinstance(sp, SamplingParams):
                sp = _final_only(sp)
            elif not isinstance(sp, PoolingParams):
                raise TypeError(f"sampling_params[{i}] must be SamplingParams, got {type(sp).__name__}")
            rid = str(next(self._counter))
            try:
                lora = lora_requests[i] if lora_requests else None
                prio = priority[i] if priority else 0
                processed.append(engine.process_request(rid, p, sp, priority=prio, lora_request=lora))
            except (ValueError, TypeError) as e:
                raise type(e)(f"prompt {i}: {e}") from e
        ids = [req.request_id for _, req in processed]
        # One batch: the core schedules all of it before its first step, as vLLM's LLM adds every request
        # before stepping, so which requests share a step (and the bf16 sums) does not depend on timing.
        engine.add_processed_requests(processed)
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm)
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        bar.update(1)
        except BaseException:
            engine.abort_request([r for r in ids if r not in finished])
            raise
        finally:
            bar.close()
        return [finished[r] for r in ids]

    def chat(
        self,
        messages: Union[list[dict[str, Any]], Sequence[list[dict[str, Any]]]],
        sampling_params: Optional[Union[SamplingParams, Sequence[SamplingParams]]] = None,
        chat_template: Optional[str] = None,
        add_generation_prompt: bool = True,
        use_tqdm: bool = True,
        chat_template_kwargs: Optional[dict[str, Any]] = None,
        continue_final_message: bool = False,
        lora_request: Optional[Union[LoRARequest, Sequence[LoRARequest]]] = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a batch of them, rendered with the chat template."""
        from vllm_lite.entrypoints.chat_utils import chat_prompts

        prompts = chat_prompts(
            self.get_tokenizer(),
            messages,
            chat_template,
            add_generation_prompt,
            continue_final_message,
            chat_template_kwargs,
        )
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def beam_search(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        params: BeamSearchParams,
        use_tqdm: bool = False,
        early_stopping: Union[bool, str] = False,
    ) -> list["BeamSearchOutput"]:
        """Beam search per prompt (HF semantics; early_stopping as in HF's generate); best beams first."""
        from vllm_lite.client.beam_search import beam_search

        engine = self.llm_engine
        return beam_search(
            lambda ps, sps: self._run(ps, sps, None, False),
            self.get_tokenizer(),
            _as_prompt_list(prompts),
            params,
            eos_token_id=engine.processor.eos_token_id,
            max_model_len=engine.processor.max_model_len,
            early_stopping=early_stopping,
            max_logprobs=engine.processor.max_logprobs,
            use_tqdm=use_tqdm,
        )

    # ------------------------------------------------------------------ pooling models (runner="pooling")
    def _pooling(self, method: str, prompts: Any) -> list[PromptType]:
        llm_pooling.check_runner(self.llm_engine.vllm_config.model_config, method, "pooling")
        return _as_prompt_list(prompts)

    def _run_pooling(self, prompts: list[Any], params: list[PoolingParams], use_tqdm: bool) -> list[Any]:
        return self._run(prompts, params, None, use_tqdm)

    def encode(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        pooling_params: Optional[Union[PoolingParams, Sequence[PoolingParams]]] = None,
        *,
        truncate_prompt_tokens: Optional[int] = None,
        use_tqdm: bool = True,
        pooling_task: str = "encode",
    ) -> list[PoolingRequestOutput]:
        """The model's pooled hidden states (`PoolingRequestOutput.outputs.data`), one per prompt in input order."""
        prompt_list = self._pooling("encode", prompts)
        params = llm_pooling.params_for(len(prompt_list), pooling_params, pooling_task, truncate_prompt_tokens)
        return llm_pooling.encode(self._run_pooling, prompt_list, params, use_tqdm)

    def embed(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        *,
        truncate_prompt_tokens: Optional[int] = None,
        use_tqdm: bool = True,
        pooling_params: Optional[Union[PoolingParams, Sequence[PoolingParams]]] = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (`.outputs.embedding`), normalised unless the model or params say otherwise."""
        prompt_list = self._pooling("embed", prompts)
        params = llm_pooling.params_for(len(prompt_list), pooling_params, "embed", truncate_prompt_tokens)
        return llm_pooling.embed(self._run_pooling, prompt_list, params, use_tqdm)

    def classify(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        *,
        truncate_prompt_tokens: Optional[int] = None,
        use_tqdm: bool = True,
        pooling_params: Optional[Union[PoolingParams, Sequence[PoolingParams]]] = None,
    ) -> list[ClassificationRequestOutput]:
        """Class probabilities per prompt (`.outputs.probs`) from a *ForSequenceClassification model."""
        prompt_list = self._pooling("classify", prompts)
        params = llm_pooling.params_for(len(prompt_list), pooling_params, "classify", truncate_prompt_tokens)
        mc = self.llm_engine.vllm_config.model_config
        return llm_pooling.classify(self._run_pooling, mc, prompt_list, params, use_tqdm)

    def reward(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        *,
        truncate_prompt_tokens: Optional[int] = None,
        use_tqdm: bool = True,
        pooling_params: Optional[Union[PoolingParams, Sequence[PoolingParams]]] = None,
    ) -> list[PoolingRequestOutput]:
        """Per-token rewards ([tokens, num_labels] in `.outputs.data`): the classifier head over every token."""
        prompt_list = self._pooling("reward", prompts)
        mc = self.llm_engine.vllm_config.model_config
        params = llm_pooling.params_for(len(prompt_list), pooling_params, "token_classify", truncate_prompt_tokens)
        return llm_pooling.classify_tokens(self._run_pooling, mc, prompt_list, params, use_tqdm)

    def score(
        self,
        text_1: Union[str, Sequence[str]],
        text_2: Union[str, Sequence[str]],
        /,
        *,
        truncate_prompt_tokens: Optional[int] = None,
        use_tqdm: bool = True,
        pooling_params: Optional[Union[PoolingParams, Sequence[PoolingParams]]] = None,
    ) -> list[ScoringRequestOutput]:
        """Similarity of each (text_1, text_2) pair: cosine of embeddings, or a cross-encoder's relevance score."""
        mc = self.llm_engine.vllm_config.model_config
        llm_pooling.check_runner(mc, "score", "pooling")
        return llm_pooling.score(
            self._run_pooling,
            mc,
            self.get_tokenizer(),
            text_1,
            text_2,
            pooling_params,
            truncate_prompt_tokens,
            use_tqdm,
        )

    def reset_prefix_cache(self) -> bool:
        return self.llm_engine.reset_prefix_cache()

    def start_profile(self) -> None:
        """vLLM's: start torch.profiler in the engine core (in-process or its own process; every data-parallel
        rank). The core's environment must set VLLM_TORCH_PROFILER_DIR (ValueError otherwise)."""
        self.llm_engine.start_profile()

    def stop_profile(self) -> None:
        """Stop it: the core writes one Chrome trace (.pt.trace.json.gz) into $VLLM_TORCH_PROFILER_DIR."""
        self.llm_engine.stop_profile()

    def shutdown(self) -> None:
        self.llm_engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:
            pass


def _final_only(sp: SamplingParams) -> SamplingParams:
    """Offline generate returns only finished outputs, whatever kind the caller set."""
    if sp.output_kind == RequestOutputKind.FINAL_ONLY:
        return sp
    out = sp.clone()
    out.output_kind = RequestOutputKind.FINAL_ONLY
    return out


def _lora_list(
    lora_request: Optional[Union[LoRARequest, Sequence[Optional[LoRARequest]]]], n: int
) -> Optional[list[Optional[LoRARequest]]]:
    """One adapter for all prompts or one per prompt (vLLM's rule); None: the base model for all."""
    if lora_request is None:
        return None
    if isinstance(lora_request, LoRARequest):
        return [lora_request] * n
    if not isinstance(lora_request, (list, tuple)):
        raise TypeError(f"lora_request must be a LoRARequest or a list of them, got {type(lora_request).__name__}.")
    if len(lora_request) != n:
        raise ValueError(f"got {len(lora_request)} lora_request entries for {n} prompts; pass one or one per prompt")
    return list(lora_request)


def _as_prompt_list(prompts: Union[PromptType, Sequence[PromptType]]) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        if not prompts:
            raise ValueError("prompts is empty")
        if all(isinstance(t, int) for t in prompts):
            return [list(prompts)]  # a single prompt given as token ids
        return list(prompts)
    raise TypeError(f"prompts must be a string, token ids, a dict or a list of them, got {type(prompts).__name__}")
