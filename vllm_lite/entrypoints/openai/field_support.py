"""What this server does with every field of OpenAI's completions and chat schemas and vLLM's extras.

One table per endpoint: each field "works", is "400" (accepted by the schema so the error can name
it and say why, rather than the request being silently misread), or is "n/a" (an OpenAI platform
feature with no meaning for a self-hosted model: accepted and has no effect). Fields in no table
are unknown and get a 400 too, as OpenAI's own API answers ("Unrecognized request argument").
README's request-field table is `render_markdown()`; a test keeps the two equal.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

WORKS, REFUSED, NOT_APPLICABLE = "works", "400", "n/a"

_ONE_CONSTRAINT = "one output constraint per request"


def _is_none_or(*harmless: Any) -> Callable[[Any], bool]:
    """A refused field that is still fine at these values (e.g. tool_choice="none")."""
    return lambda v: v is None or v in harmless


def _empty(v: Any) -> bool:
    return v is None or v == [] or v == {}


# name -> (status, note, accepts(value) for refused fields: True where the value asks for nothing).
Rule = tuple[str, str, Optional[Callable[[Any], bool]]]

_COMMON: dict[str, Rule] = {
    "model": (WORKS, "one of the served model names (--served-model-name)", None),
    "n": (WORKS, "", None),
    "stream": (WORKS, "", None),
    "stream_options": (WORKS, "include_usage; vLLM's continuous_usage_stats", None),
    "temperature": (WORKS, "unset: generation_config default", None),
    "top_p": (WORKS, "unset: generation_config default", None),
    "frequency_penalty": (WORKS, "", None),
    "presence_penalty": (WORKS, "", None),
    "seed": (WORKS, "", None),
    "stop": (WORKS, "", None),
    "logit_bias": (WORKS, "", None),
    "user": (NOT_APPLICABLE, "accepted, no effect", None),
    # vLLM's extra sampling fields.
    "top_k": (WORKS, "vLLM extra", None),
    "min_p": (WORKS, "vLLM extra", None),
    "repetition_penalty": (WORKS, "vLLM extra", None),
    "stop_token_ids": (WORKS, "vLLM extra", None),
    "include_stop_str_in_output": (WORKS, "vLLM extra", None),
    "ignore_eos": (WORKS, "vLLM extra", None),
    "min_tokens": (WORKS, "vLLM extra", None),
    "skip_special_tokens": (WORKS, "vLLM extra", None),
    "spaces_between_special_tokens": (WORKS, "vLLM extra", None),
    "truncate_prompt_tokens": (WORKS, "vLLM extra: keep the prompt's last k tokens", None),
    "allowed_token_ids": (WORKS, "vLLM extra", None),
    "bad_words": (WORKS, "vLLM extra", None),
    "add_special_tokens": (WORKS, "vLLM extra", None),
    "priority": (WORKS, "vLLM extra (--scheduling-policy priority)", None),
    "return_token_ids": (WORKS, "vLLM extra", None),
    "use_beam_search": (REFUSED, "beam search is offline only (LLM.beam_search)", _is_none_or(False)),
    "length_penalty": (REFUSED, "applies to beam search only", _is_none_or(1.0)),
    "prompt_logprobs": (REFUSED, "use echo with logprobs (completions) for prompt logprobs", None),
    "response_format": (WORKS, f"text, json_object, json_schema; {_ONE_CONSTRAINT}", None),
    "structured_outputs": (WORKS, f"vLLM extra: json, regex, choice, grammar, json_object; {_ONE_CONSTRAINT}", None),
    "guided_json": (WORKS, "vLLM extra (older spelling of structured_outputs.json)", None),
    "guided_regex": (WORKS, "vLLM extra (older spelling of structured_outputs.regex)", None),
    "guided_choice": (WORKS, "vLLM extra (older spelling of structured_outputs.choice)", None),
    "guided_grammar": (WORKS, "vLLM extra (older spelling of structured_outputs.grammar)", None),
    "guided_whitespace_pattern": (WORKS, "vLLM extra: with a JSON constraint", None),
    "guided_decoding_backend": (
        REFUSED,
        "the backend is chosen at launch (--structured-outputs-backend), not per request",
        None,
    ),
    "logits_processors": (REFUSED, "no custom logits processors (no code from requests)", _empty),
    "return_tokens_as_token_ids": (REFUSED, "not implemented", _is_none_or(False)),
    "cache_salt": (REFUSED, "the prefix cache is salted per frontend; per-request salts are not exposed", None),
    "kv_transfer_params": (REFUSED, "no disaggregated prefill", None),
    "vllm_xargs": (REFUSED, "no extension arguments", _empty),
    "prompt_embeds": (REFUSED, "prompts are text or token ids only", None),
}

COMPLETION_FIELDS: dict[str, Rule] = {
    "prompt": (WORKS, "text, token ids, or a list of either", None),
    "max_tokens": (WORKS, "default 16; 0 with echo returns the prompt and its logprobs only", None),
    "logprobs": (WORKS, "", None),
    "echo": (WORKS, "with logprobs: the prompt's logprobs too", None),
    "best_of": (WORKS, "the best n of best_of by cumulative logprob; not with stream", None),
    "suffix": (REFUSED, "insertion (fill-in-the-middle) is not implemented", _is_none_or("")),
    **_COMMON,
}

CHAT_FIELDS: dict[str, Rule] = {
    "messages": (WORKS, "text content (strings or text parts)", None),
    "max_tokens": (WORKS, "deprecated by OpenAI for max_completion_tokens", None),
    "max_completion_tokens": (WORKS, "", None),
    "logprobs": (WORKS, "", None),
    "top_logprobs": (WORKS, "", None),
    "add_generation_prompt": (WORKS, "vLLM extra", None),
    "continue_final_message": (WORKS, "vLLM extra", None),
    "chat_template": (WORKS, "vLLM extra: overrides --chat-template", None),
    "chat_template_kwargs": (WORKS, "vLLM extra", None),
    "metadata": (NOT_APPLICABLE, "accepted, no effect (OpenAI's stored completions)", None),
    "store": (NOT_APPLICABLE, "accepted, no effect (OpenAI's stored completions)", None),
    "service_tier": (NOT_APPLICABLE, "accepted, no effect", None),
    "prompt_cache_key": (NOT_APPLICABLE, "accepted, no effect (the prefix cache needs no key)", None),
    "safety_identifier": (NOT_APPLICABLE, "accepted, no effect", None),
    "parallel_tool_calls": (NOT_APPLICABLE, "accepted, no effect (as in vLLM, replies may hold several calls)", None),
    "include_reasoning": (NOT_APPLICABLE, "vLLM extra; accepted, no effect (no reasoning parser)", None),
    "tools": (WORKS, "function tools; given to the chat template as `tools`", None),
    "tool_choice": (
        WORKS,
        "none; auto (--enable-auto-tool-choice --tool-call-parser); required and a named function "
        "(through a JSON-schema constraint)",
        None,
    ),
    "functions": (REFUSED, "deprecated by OpenAI: use tools", _empty),
    "function_call": (REFUSED, "deprecated by OpenAI: use tool_choice", _is_none_or("none", "auto")),
    "audio": (REFUSED, "text output only", None),
    "modalities": (REFUSED, "text output only", lambda v: v is None or v == ["text"]),
    "prediction": (REFUSED, "predicted outputs are not implemented", None),
    "web_search_options": (REFUSED, "no web search", None),
    "reasoning_effort": (REFUSED, "no reasoning models", None),
    "verbosity": (REFUSED, "no reasoning models", None),
    "echo": (REFUSED, "echo is a completions feature here", _is_none_or(False)),
    "best_of": (REFUSED, "best_of is a completions feature here", lambda v: v is None or v == 1),
    "documents": (REFUSED, "no document (RAG) templates", None),
    "mm_processor_kwargs": (REFUSED, "text-only models", None),
    "request_id": (REFUSED, "the server assigns request ids", None),
    **_COMMON,
}


def refused_field(rules: dict[str, Rule], request: Any) -> Optional[tuple[str, str]]:
    """(field, reason) for the first refused field this request actually uses, else None."""
    for name, (status, note, accepts) in rules.items():
        if status != REFUSED:
            continue
        value = getattr(request, name, None)
        if value is None or (accepts is not None and accepts(value)):
            continue
        return name, note
    return None


def render_markdown() -> str:
    """README's table: one row per field, both endpoints side by side."""
    names = list(dict.fromkeys([*COMPLETION_FIELDS, *CHAT_FIELDS]))
    rows = ["| field | /v1/completions | /v1/chat/completions |", "|---|---|---|"]

    def cell(rules: dict[str, Rule], name: str) -> str:
        if name not in rules:
            return "400: unknown field"
        status, note, _ = rules[name]
        return f"{status}: {note}" if note else status

    for name in names:
        rows.append(f"| `{name}` | {cell(COMPLETION_FIELDS, name)} | {cell(CHAT_FIELDS, name)} |")
    return "\n".join(rows)
