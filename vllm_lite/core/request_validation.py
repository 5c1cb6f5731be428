"""Checks an `EngineCoreRequest` against the model itself before it may reach a step.

The core trusts no frontend: a request decoded from the wire (or handed over in
process, where nothing re-ran `SamplingParams`' own checks after a field was
set) may carry any value its types allow. Everything the worker indexes with
(token ids), sizes arrays by (logprob counts), stores in fixed-width arrays
(counts, seeds) or computes with in float32 (temperature, penalties, biases)
is checked here, so a request that passes cannot fail inside a step. Each
failure is a `ValueError` that names the field; the core turns it into an
error output for that request alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from vllm_lite.core.messages import EngineCoreRequest
from vllm_lite.core.pooling_validation import validate_pooling_request
from vllm_lite.sampling_params import SamplingParams

_INT64_MIN = -(1 << 63)
_INT64_MAX = (1 << 63) - 1
# torch.Generator.manual_seed takes [-2**63, 2**64); SamplingParams allows the same.
_SEED_MIN = -(1 << 63)
_SEED_MAX = (1 << 64) - 1
# The sampler computes in float32: a larger finite float64 becomes inf there.
_FLOAT32_MAX = 3.4028234663852886e38


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask of this core. Caps follow vLLM and the OpenAI API where they have one."""

    vocab_size: int
    # Prompt plus output; the scheduler's value (capped by the KV cache's capacity).
    max_model_len: int
    # vLLM's ModelConfig.max_logprobs default; the frontend's Processor uses the same.
    max_logprobs: int = 20
    # OpenAI caps n at 128; best_of runs that many sequences for one request, so the same cap.
    max_n: int = 128
    max_best_of: int = 128
    max_stop_strings: int = 128
    max_stop_string_chars: int = 1024
    # stop_token_ids and the frontend's filled-in list (stop ids plus extra EOS ids).
    max_stop_token_ids: int = 1024
    max_bad_words: int = 1024
    max_bad_word_chars: int = 1024
    # The frontend tokenizes each bad word twice (at text start and after a space).
    max_bad_words_token_ids: int = 2048
    max_cache_salt_chars: int = 1024
    max_request_id_chars: int = 1024
    # Priorities sort requests; a 64-bit range is what every encoder and the API can carry.
    min_priority: int = _INT64_MIN
    max_priority: int = _INT64_MAX
    # "generate" or "pooling": which of sampling_params / pooling_params this core's model takes.
    runner_type: str = "generate"
    # A pooling prompt runs whole in one step: at most this many tokens (None: max_model_len).
    max_pooling_tokens: Optional[int] = None


def validate_request(request: EngineCoreRequest, limits: RequestLimits) -> None:
    """Raise ValueError naming the first field of `request` that this core cannot run."""
    rid = request.request_id
    if type(rid) is not str or not rid:
        raise ValueError(f"request_id must be a non-empty str, got {rid!r}.")
    if len(rid) > limits.max_request_id_chars:
        raise ValueError(f"request_id must be at most {limits.max_request_id_chars} characters, got {len(rid)}.")
    try:
        _validate_fields(request, limits)
    except ValueError as e:
        raise ValueError(f"request {rid!r}: {e}") from None


def _validate_fields(request: EngineCoreRequest, limits: RequestLimits) -> None:
    vocab = limits.vocab_size
    prompt = _id_list("prompt_token_ids", request.prompt_token_ids, vocab, max_len=None)
    if not prompt:
        raise ValueError("prompt_token_ids must not be empty.")
    pooling = validate_pooling_request(request, limits)
    if not pooling and len(prompt) >= limits.max_model_len:
        raise ValueError(
            f"prompt_token_ids has {len(prompt)} tokens, which leaves no room to generate in "
            f"max_model_len={limits.max_model_len}."
        )
    if request.eos_token_id is not None:
        _token_id("eos_token_id", request.eos_token_id, vocab)
    _bounded_int("priority", request.priority, limits.min_priority, limits.max_priority)
    _bounded_int("client_index", request.client_index, 0, _INT64_MAX)
    _finite_float("arrival_time", request.arrival_time)
    salt = request.cache_salt
    if salt is not None:
        if type(salt) is not str:
            raise ValueError(f"cache_salt must be a str or None, got {type(salt).__name__}.")
        if len(salt) > limits.max_cache_salt_chars:
            raise ValueError(f"cache_salt must be at most {limits.max_cache_salt_chars} characters, got {len(salt)}.")
    params = request.sampling_params
    if pooling:
        return
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}.")
    _validate_sampling_params(params, limits)


def _validate_sampling_params(p: SamplingParams, limits: RequestLimits) -> None:
    vocab = limits.vocab_size
    _bounded_int("n", p.n, 1, limits.max_n)
    if p.best_of is not None:
        _bounded_int("best_of", p.best_of, max(p.n, 1), limits.max_best_of)

    _float_in("temperature", p.temperature, 0.0, _FLOAT32_MAX)
    _float_in("top_p", p.top_p, 0.0, 1.0, low_open=True)
    _float_in("min_p", p.min_p, 0.0, 1.0)
    _bounded_int("top_k", p.top_k, -1, _INT64_MAX)
    _float_in("presence_penalty", p.presence_penalty, -2.0, 2.0)
    _float_in("frequency_penalty", p.frequency_penalty, -2.0, 2.0)
    _float_in("repetition_penalty", p.repetition_penalty, 0.0, _FLOAT32_MAX, low_open=True)
    if p.seed is not None:
        _bounded_int("seed", p.seed, _SEED_MIN, _SEED_MAX)

    if p.max_tokens is not None:
        _bounded_int("max_tokens", p.max_tokens, 1, _INT64_MAX)
    # More than max_model_len tokens can never be generated; the worker keeps the count in int64.
    _bounded_int("min_tokens", p.min_tokens, 0, limits.max_model_len)
    if p.max_tokens is not None and p.min_tokens > p.max_tokens:
        raise ValueError(f"min_tokens must be at most max_tokens={p.max_tokens}, got {p.min_tokens}.")
    for field in ("logprobs", "prompt_logprobs"):
        value = getattr(p, field)
        if value is not None:
            _bounded_int(field, value, 0, limits.max_logprobs)

    stop = p.stop
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        _sized_list("stop", stop, limits.max_stop_strings)
        for s in stop:
            if type(s) is not str or not s or len(s) > limits.max_stop_string_chars:
                raise ValueError(
                    f"stop must hold non-empty strings of at most {limits.max_stop_string_chars} characters, "
                    f"got {_short(s)}."
                )
    _id_list("stop_token_ids", p.stop_token_ids, vocab, limits.max_stop_token_ids, optional=True)
    _id_list("all_stop_token_ids", p._all_stop_token_ids, vocab, limits.max_stop_token_ids, optional=True)
    if p.allowed_token_ids is not None:
        ids = _id_list("allowed_token_ids", p.allowed_token_ids, vocab, max_len=vocab)
        if not ids:
            raise ValueError("allowed_token_ids must not be empty (nothing could be sampled).")
    _validate_logit_bias(p.logit_bias, vocab)
    if p.bad_words is not None:
        _sized_list("bad_words", p.bad_words, limits.max_bad_words)
        for w in p.bad_words:
            if type(w) is not str or not w or len(w) > limits.max_bad_word_chars:
                raise ValueError(
                    f"bad_words must hold non-empty strings of at most {limits.max_bad_word_chars} characters, "
                    f"got {_short(w)}."
                )
    if p._bad_words_token_ids is not None:
        seqs = _sized_list("bad_words_token_ids", p._bad_words_token_ids, limits.max_bad_words_token_ids)
        for seq in seqs:
            if not _id_list("bad_words_token_ids", seq, vocab, max_len=limits.max_model_len):
                raise ValueError("bad_words_token_ids must not hold an empty sequence.")


def _validate_logit_bias(bias: Any, vocab: int) -> None:
    if bias is None:
        return
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a dict of token id -> bias, got {type(bias).__name__}.")
    if len(bias) > vocab:
        raise ValueError(f"logit_bias must have at most vocab_size={vocab} entries, got {len(bias)}.")
    if bias:
        _id_list("logit_bias", list(bias), vocab, max_len=None)
    for value in bias.values():
        _float_in("logit_bias", value, -100.0, 100.0)


# ---------------------------------------------------------------------------- field checks


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _bounded_int(field: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{field} must be an integer, got {_short(value)}.")
    if not lo <= value <= hi:
        raise ValueError(f"{field} must be in [{lo}, {hi}], got {_short(value)}.")
    return value


def _finite_float(field: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{field} must be a number, got {_short(value)}.")
    if not math.isfinite(value):
        raise ValueError(f"{field} must be finite, got {value!r}.")
    return float(value)


def _float_in(field: str, value: Any, lo: float, hi: float, *, low_open: bool = False) -> float:
    v = _finite_float(field, value)
    if v < lo or v > hi or (low_open and v == lo):
        bracket = "(" if low_open else "["
        raise ValueError(f"{field} must be in {bracket}{lo}, {hi}], got {value!r}.")
    return v


def _sized_list(field: str, value: Any, max_len: Optional[int]) -> list[Any]:
    if not isinstance(value, list):
        raise ValueError(f"{field} must be a list, got {type(value).__name__}.")
    if max_len is not None and len(value) > max_len:
        raise ValueError(f"{field} must have at most {max_len} entries, got {len(value)}.")
    return value


def _token_id(field: str, value: Any, vocab: int) -> int:
    if type(value) is not int:
        raise ValueError(f"{field} must be a token id (int), got {_short(value)}.")
    if not 0 <= value < vocab:
        raise ValueError(f"{field} holds token id {value}, out of vocabulary (size {vocab}).")
    return value


def _id_list(field: str, value: Any, vocab: int, max_len: Optional[int], *, optional: bool = False) -> list[int]:
    """A list of in-vocabulary token ids; its element types are checked in C (`map(type)`), then min/max."""
    if value is None and optional:
        return []
    ids = _sized_list(field, value, max_len)
    if not ids:
        return ids
    if not set(map(type, ids)) <= {int}:
        bad = next(t for t in ids if type(t) is not int)
        raise ValueError(f"{field} must hold token ids (int), got {_short(bad)}.")
    lo, hi = min(ids), max(ids)
    if lo < 0 or hi >= vocab:
        raise ValueError(f"{field} holds token id {lo if lo < 0 else hi}, out of vocabulary (size {vocab}).")
    return ids
