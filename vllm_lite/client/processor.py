"""Frontend request intake: validate, tokenize, and build the core's `EngineCoreRequest`.

Everything that needs the tokenizer or the model's limits happens here, once,
so the core can trust what it receives (ids in range, lengths that fit).
"""

from __future__ import annotations

import json
import numbers
import os
import time
import weakref
from typing import Any, Optional, Union

from vllm_lite.client.pooling import make_pooling_request
from vllm_lite.client.token_types import prompt_token_type_boundary
from vllm_lite.config import GENERATION_CONFIG_DEFAULTS, LoRAConfig, ModelConfig
from vllm_lite.core.messages import EngineCoreRequest
from vllm_lite.lora.request import LoRARequest
from vllm_lite.pooling_params import GENERATE_ON_POOLING, PoolingParams
from vllm_lite.sampling_params import SamplingParams

PromptType = Union[str, list[int], dict]

# OpenAI's cap on n; best_of runs as many sequences, so the same. The core refuses more per request
# (request_validation.RequestLimits), but n > 1 fans out here into n one-sample requests: cap it here.
MAX_N = 128
MAX_BEST_OF = 128
# vLLM's bounds for priority (msgpack carries a 64-bit signed integer).
PRIORITY_MIN, PRIORITY_MAX = -(2**63), 2**63 - 1
# Slack for normalizers that shrink text before tokenizing (NFKC composing a base and its marks).
PROMPT_CHARS_SLACK = 4
_chars_per_token: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()


def max_chars_per_token(tokenizer: Any) -> int:
    """The longest token's text in this tokenizer's vocabulary (its own spelling: >= the decoded length)."""
    try:
        return _chars_per_token[tokenizer]
    except (KeyError, TypeError):
        pass
    try:
        vocab = tokenizer.get_vocab()
        longest = max((len(t) for t in vocab if isinstance(t, str)), default=1)
    except Exception:  # a tokenizer without a vocabulary to read: no bound from it
        longest = 1 << 16
    longest = max(1, longest)
    try:
        _chars_per_token[tokenizer] = longest
    except TypeError:  # not weak-referenceable: computed again next time
        pass
    return longest


def max_prompt_chars(max_model_len: int, tokenizer: Any) -> int:
    """Characters past which a text must tokenize to more than max_model_len tokens (so it cannot fit)."""
    return max_model_len * max_chars_per_token(tokenizer) * PROMPT_CHARS_SLACK


def check_prompt_text(text: str, max_model_len: int, tokenizer: Any, field: str = "prompt") -> None:
    """Refuse, before the tokenizer runs, a text that cannot fit or is not valid Unicode.

    Tokenizing 10 MB takes seconds only to learn that it is too long; a lone surrogate (JSON allows
    ``\\ud800``) makes the tokenizer raise an internal error that means nothing to the caller.
    """
    limit = max_prompt_chars(max_model_len, tokenizer)
    if len(text) > limit:
        raise ValueError(
            f"The {field} is too long: {len(text)} characters, more than max_model_len={max_model_len} tokens "
            f"can hold (at most {limit} characters for this tokenizer). Please reduce the length of the {field}."
        )
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"The {field} is not valid Unicode text: it contains a lone surrogate "
            f"(U+{ord(text[e.start]):04X}) at character {e.start}, which cannot be encoded as UTF-8."
        ) from None


def check_priority(priority: Any) -> int:
    """priority as vLLM takes it: an int that fits in 64 bits (TypeError/ValueError naming it otherwise)."""
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise TypeError(f"priority must be an int, got {priority!r}.")
    if not PRIORITY_MIN <= priority <= PRIORITY_MAX:
        raise ValueError(f"priority must be between {PRIORITY_MIN} and {PRIORITY_MAX} (64-bit), got {priority}.")
    return priority


# generation_config.json keys that vLLM turns into default sampling params (config.py: EngineArgs checks
# --override-generation-config against the same keys).
_GEN_CONFIG_DEFAULTS = GENERATION_CONFIG_DEFAULTS


def read_generation_config(model_dir: str) -> dict[str, Any]:
    """The checkpoint's generation_config.json, or {} when there is none (or it is unreadable)."""
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return {}
    return cfg if isinstance(cfg, dict) else {}


def _eos_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


_PLAIN_INT = frozenset((int,))


class Processor:
    """Turns (prompt, SamplingParams) into a validated `EngineCoreRequest`."""

    def __init__(
        self,
        model_config: ModelConfig,
        tokenizer: Any,
        max_logprobs: Optional[int] = None,
        lora_config: Optional[LoRAConfig] = None,
    ) -> None:
        self.model_config = model_config
        self.lora_config = lora_config
        # Adapters seen by this frontend: one id per name and one name per id (vLLM keys everything by id).
        self._lora_ids: dict[str, int] = {}
        self._lora_names: dict[int, str] = {}
        self._lora_checked: set[LoRARequest] = set()
        self.tokenizer = tokenizer
        self.max_model_len = model_config.max_model_len
        self.max_logprobs = model_config.max_logprobs if max_logprobs is None else max_logprobs
        tok_size = len(tokenizer) if tokenizer is not None else 0
        # The model's embedding decides which ids exist; the tokenizer's size is the fallback.
        self.vocab_size = model_config.vocab_size or tok_size
        # Request defaults (generation_config="vllm": none) and the checkpoint's extra EOS ids.
        gen = model_config.generation_config
        eos_config = read_generation_config(model_config.model)
        self.generation_config = eos_config if gen == "auto" else {} if gen == "vllm" else read_generation_config(gen)
        # --override-generation-config: laid over those (under "vllm" too), as vLLM's get_diff_sampling_param.
        self.generation_config = {**self.generation_config, **model_config.override_generation_config}
        self.eos_token_id: Optional[int] = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
        if self.eos_token_id is None:
            gen_eos = _eos_ids(eos_config.get("eos_token_id"))
            self.eos_token_id = gen_eos[0] if gen_eos else None
        # Extra EOS ids (generation_config lists several for chat models): stop tokens too.
        self.extra_eos_ids = [t for t in _eos_ids(eos_config.get("eos_token_id")) if t != self.eos_token_id]

    # ------------------------------------------------------------------ defaults
    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the checkpoint's recommended values (generation_config.json), else vLLM's."""
        kwargs: dict[str, Any] = {}
        for src, dst in _GEN_CONFIG_DEFAULTS.items():
            if self.generation_config.get(src) is not None:
                kwargs[dst] = self.generation_config[src]
        return SamplingParams(**kwargs)

    # ------------------------------------------------------------------ the request
    def process_inputs(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: Optional[float] = None,
        priority: int = 0,
        client_index: int = 0,
        cache_salt: Optional[str] = None,
        lora_request: Optional[LoRARequest] = None,
    ) -> tuple[Optional[str], EngineCoreRequest]:
        """Validate and tokenize; returns (prompt text if known, the request for the core)."""
        if not isinstance(request_id, str) or not request_id:
            raise TypeError(f"request_id must be a non-empty str, got {request_id!r}.")
        if not isinstance(params, (SamplingParams, PoolingParams)):
            raise TypeError(f"params must be a SamplingParams or PoolingParams, got {type(params).__name__}.")
        if isinstance(params, SamplingParams) and self.model_config.runner_type == "pooling":
            raise ValueError(GENERATE_ON_POOLING)
        check_priority(priority)
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise TypeError(f"cache_salt must be a str or None, got {cache_salt!r}.")
        if lora_request is not None:
            if isinstance(params, PoolingParams):
                raise ValueError("lora_request: LoRA adapters apply to generation, not to pooling requests.")
            self.check_lora_request(lora_request)
        prompt_text, prompt_ids = self._tokenize_prompt(prompt)
        token_types = prompt_token_type_boundary(prompt, len(prompt_ids), isinstance(params, PoolingParams))
        if isinstance(params, PoolingParams):
            self._validate_ids(prompt_ids)
            args = (arrival_time, priority, client_index, cache_salt, token_types)
            request = make_pooling_request(self.model_config, request_id, prompt_ids, params, *args)
            return prompt_text, request
        self._validate_prompt(prompt_ids)
        params = self._process_params(params, len(prompt_ids))
        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            sampling_params=params,
            eos_token_id=self.eos_token_id,
            arrival_time=time.time() if arrival_time is None else float(arrival_time),
            priority=priority,
            client_index=client_index,
            cache_salt=cache_salt,
            lora_request=lora_request,
        )
        return prompt_text, request

    def check_lora_request(self, lora_request: Any) -> None:
        """A usable adapter for this engine: LoRA on, a PEFT directory within max_lora_rank, one id per name."""
        if not isinstance(lora_request, LoRARequest):
            raise TypeError(f"lora_request must be a LoRARequest or None, got {type(lora_request).__name__}.")
        if self.lora_config is None:
            raise ValueError(
                f"lora_request ({lora_request.lora_name!r}) given but LoRA is not enabled; start the engine with "
                "enable_lora=True (--enable-lora)."
            )
        name, lid = lora_request.lora_name, lora_request.lora_int_id
        if self._lora_ids.get(name, lid) != lid:
            raise ValueError(
                f"lora_request.lora_int_id: adapter {name!r} already has id {self._lora_ids[name]}, got {lid}."
            )
        if self._lora_names.get(lid, name) != name:
            raise ValueError(
                f"lora_request.lora_name: id {lid} already belongs to adapter {self._lora_names[lid]!r}, got {name!r}."
            )
        if lora_request not in self._lora_checked:
            from vllm_lite.lora.peft_adapter import check_adapter

            check_adapter(lora_request.lora_path, self.lora_config.max_lora_rank)
            self._lora_checked.add(lora_request)
        self._lora_ids[name], self._lora_names[lid] = lid, name

    def forget_lora(self, lora_int_id: int) -> None:
        """An adapter removed from the engine: its name and id may be reused."""
        name = self._lora_names.pop(lora_int_id, None)
        if name is not None:
            self._lora_ids.pop(name, None)
        self._lora_checked = {r for r in self._lora_checked if r.lora_int_id != lora_int_id}

    def _tokenize_prompt(self, prompt: PromptType) -> tuple[Optional[str], list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                text = prompt.get("prompt")
                if text is not None and not isinstance(text, str):
                    raise TypeError(f"prompt must be a str, got {type(text).__name__}.")
                return text, self._check_id_list(ids, "prompt_token_ids")
            if "prompt" in prompt:
                prompt = prompt["prompt"]
                if not isinstance(prompt, str):
                    raise TypeError(f"prompt must be a str, got {type(prompt).__name__}.")
            else:
                raise ValueError(
                    f"a dict prompt needs a 'prompt' or 'prompt_token_ids' key, got keys {sorted(prompt)!r}."
                )
        if isinstance(prompt, str):
            if prompt == "":
                raise ValueError("Invalid prompt: prompt is empty (an empty string has no tokens).")
            if self.tokenizer is None:
                raise ValueError("A text prompt needs a tokenizer; pass prompt_token_ids instead.")
            check_prompt_text(prompt, self.max_model_len, self.tokenizer)
            return prompt, list(self.tokenizer.encode(prompt, add_special_tokens=True))
        if isinstance(prompt, (list, tuple)):
            return None, self._check_id_list(prompt, "prompt_token_ids")
        raise TypeError(
            f"prompt must be a str, a list of token ids or a dict with 'prompt'/'prompt_token_ids', "
            f"got {type(prompt).__name__}."
        )

    @staticmethod
    def _check_id_list(ids: Any, field: str) -> list[int]:
        if hasattr(ids, "tolist") and not isinstance(ids, (list, tuple)):  # numpy array / tensor
            ids = ids.tolist()
        if not isinstance(ids, (list, tuple)):
            raise TypeError(f"{field} must be a list of ints, got {type(ids).__name__}.")
        if set(map(type, ids)) <= _PLAIN_INT:  # the usual case, checked in C: no ABC isinstance per id
            return list(ids)
        if any(not isinstance(t, numbers.Integral) or isinstance(t, bool) for t in ids):
            raise TypeError(f"{field} must contain only ints, got {list(ids)[:8]!r}...")
        return [int(t) for t in ids]  # numpy ints become plain ints for msgpack

    def _validate_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("Invalid prompt: prompt is empty (no token ids).")
        # At least one position must stay free for the first generated token.
        if len(ids) > self.max_model_len - 1:
            raise ValueError(
                f"The prompt is too long: {len(ids)} tokens, but max_model_len={self.max_model_len} "
                f"allows at most {self.max_model_len - 1} prompt tokens (one position is needed to generate)."
            )
        self._validate_ids(ids)

    def _validate_ids(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("Invalid prompt: prompt is empty (no token ids).")
        lo, hi = min(ids), max(ids)
        if lo < 0 or hi >= self.vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(f"prompt_token_ids contains token id {bad}, out of vocabulary (size {self.vocab_size}).")

    def _process_params(self, params: SamplingParams, prompt_len: int) -> SamplingParams:
        """A filled-in copy: the caller's object stays untouched (it may be reused across requests)."""
        if params.n > MAX_N:
            raise ValueError(f"n must be at most {MAX_N}, got {params.n}.")
        if params.best_of is not None and params.best_of > MAX_BEST_OF:
            raise ValueError(f"best_of must be at most {MAX_BEST_OF}, got {params.best_of}.")
        if params.logprobs is not None and params.logprobs > self.max_logprobs:
            raise ValueError(f"logprobs must be at most {self.max_logprobs}, got {params.logprobs!r}.")
        if params.prompt_logprobs is not None and params.prompt_logprobs > self.max_logprobs:
            raise ValueError(f"prompt_logprobs must be at most {self.max_logprobs}, got {params.prompt_logprobs!r}.")
        params.verify_vocab(self.vocab_size)
        if params.structured_outputs is not None:  # a bad constraint fails here, with the compilers' message
            from vllm_lite.structured_output.validation import validate_structured_outputs

            validate_structured_outputs(params.structured_outputs)
        p = params.clone()
        if p.max_tokens is None:
            p.max_tokens = self.max_model_len - prompt_len
        stop_ids = list(dict.fromkeys(p.stop_token_ids or []))
        if not p.ignore_eos:
            stop_ids += [t for t in self.extra_eos_ids if t not in stop_ids]
        p._all_stop_token_ids = stop_ids
        p._bad_words_token_ids = self._tokenize_bad_words(p.bad_words or [])
        return p

    def _tokenize_bad_words(self, words: list[str]) -> Optional[list[list[int]]]:
        """Each bad word as it looks at the start of text and after a space (BPE tokens differ)."""
        if not words:
            return None
        if self.tokenizer is None:
            raise ValueError("bad_words needs a tokenizer.")
        seqs: list[list[int]] = []
        for word in words:
            if not isinstance(word, str) or not word.strip():
                raise ValueError(f"bad_words must contain non-blank strings, got {word!r}.")
            check_prompt_text(word, self.max_model_len, self.tokenizer, field="bad_words")
            core = word.lstrip()
            for text in (core, " " + core):
                ids = list(self.tokenizer.encode(text, add_special_tokens=False))
                if ids and ids not in seqs:
                    seqs.append(ids)
        for seq in seqs:
            if any(t < 0 or t >= self.vocab_size for t in seq):
                raise ValueError(f"bad_words tokenized to ids out of vocabulary (size {self.vocab_size}): {seq!r}.")
        return seqs
