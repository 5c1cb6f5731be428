"""Chat conversations -> prompts, through the tokenizer's chat template (for `LLM.chat`).

Rendering happens in the frontend: the template turns messages into text, and the
text is tokenized *without* adding special tokens, because a chat template already
writes the ones it wants (BOS, role markers); adding them again would double them.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional, Sequence, Union

Message = dict[str, Any]
Conversation = list[Message]


def is_batch_of_conversations(messages: Any) -> bool:
    """True for a list of conversations, False for one conversation (a list of message dicts)."""
    if not isinstance(messages, (list, tuple)):
        raise TypeError(
            f"messages must be a list of message dicts or a list of such lists, got {type(messages).__name__}."
        )
    if not messages:
        raise ValueError("messages is empty: pass at least one message.")
    if all(isinstance(m, dict) for m in messages):
        return False
    if all(isinstance(m, (list, tuple)) for m in messages):
        return True
    raise TypeError(
        "messages must be either one conversation (a list of {'role', 'content'} dicts) or a list of "
        f"conversations, not a mix; got element types {sorted({type(m).__name__ for m in messages})}."
    )


def _content_text(content: Any, where: str) -> str:
    """Message content as text: a string, or OpenAI-style parts of which only text parts are supported."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        texts = []
        for j, part in enumerate(content):
            if isinstance(part, str):
                texts.append(part)
                continue
            if not isinstance(part, dict):
                raise TypeError(f"{where}.content[{j}] must be a dict or str, got {type(part).__name__}.")
            kind = part.get("type", "text")
            if kind != "text":
                raise ValueError(f"{where}.content[{j}] has type {kind!r}; only 'text' parts are supported.")
            text = part.get("text")
            if not isinstance(text, str):
                raise TypeError(f"{where}.content[{j}].text must be a str, got {type(text).__name__}.")
            texts.append(text)
        # Several text parts become separate lines, as vLLM's "string" content format does.
        return "\n".join(texts)
    raise TypeError(f"{where}.content must be a str, a list of text parts or None, got {type(content).__name__}.")


def normalize_conversation(conversation: Sequence[Any], index: int = 0) -> Conversation:
    """Validated copy of one conversation: every message has a str role and str content."""
    where = f"messages[{index}]"
    if not isinstance(conversation, (list, tuple)):
        raise TypeError(f"{where} must be a list of message dicts, got {type(conversation).__name__}.")
    if not conversation:
        raise ValueError(f"{where} is an empty conversation: pass at least one message.")
    out: Conversation = []
    for i, msg in enumerate(conversation):
        mwhere = f"{where}[{i}]"
        if not isinstance(msg, dict):
            raise TypeError(f"{mwhere} must be a dict with 'role' and 'content', got {type(msg).__name__}.")
        role = msg.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"{mwhere}.role must be a non-empty str, got {role!r}.")
        if "content" not in msg and not msg.get("tool_calls"):
            raise ValueError(f"{mwhere} has no 'content'.")
        norm = with_tool_call_arguments_parsed(msg)  # other keys (name, tool_call_id, ...) go to the template
        norm["content"] = _content_text(msg.get("content"), mwhere)
        out.append(norm)
    return out


def with_tool_call_arguments_parsed(message: Message) -> Message:
    """A copy whose `tool_calls[*].function.arguments` are objects, not OpenAI's JSON text.

    Chat templates (Hermes, Qwen, Llama 3) write the arguments with `tojson` and expect a mapping,
    as vLLM hands them over; arguments that are not JSON are left as they came.
    """
    out = dict(message)
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return out
    parsed_calls = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        arguments = function.get("arguments") if isinstance(function, dict) else None
        if isinstance(arguments, str):
            try:
                call = {**call, "function": {**function, "arguments": json.loads(arguments)}}
            except ValueError:
                pass
        parsed_calls.append(call)
    out["tool_calls"] = parsed_calls
    return out


def resolve_chat_template(tokenizer: Any, chat_template: Optional[str]) -> str:
    """The Jinja template to use: the caller's (text, or a path to a file), else the tokenizer's."""
    if chat_template is not None:
        if not isinstance(chat_template, str) or not chat_template:
            raise TypeError(
                f"chat_template must be a non-empty str (template text or file path), got {chat_template!r}."
            )
        if os.path.isfile(chat_template):
            with open(chat_template, encoding="utf-8") as f:
                return f.read()
        return chat_template
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # some tokenizers keep named templates; "default" is the chat one
        template = template.get("default")
    if not template:
        raise ValueError(
            "This model's tokenizer has no chat_template; pass chat_template=... or use generate() with plain prompts."
        )
    return template


def render_conversation(
    tokenizer: Any,
    conversation: Conversation,
    chat_template: str,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: Optional[dict[str, Any]] = None,
) -> str:
    """One conversation as prompt text."""
    kwargs = dict(chat_template_kwargs or {})
    for reserved in ("tokenize", "chat_template", "conversation", "add_generation_prompt", "continue_final_message"):
        if reserved in kwargs:
            raise ValueError(f"chat_template_kwargs must not set {reserved!r}; it is an argument of chat() itself.")
    try:
        text = tokenizer.apply_chat_template(
            conversation,
            chat_template=chat_template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **kwargs,
        )
    except (ValueError, TypeError):
        raise
    except Exception as e:  # jinja2's TemplateError and friends
        raise ValueError(f"Could not apply the chat template: {type(e).__name__}: {e}") from e
    if not isinstance(text, str):
        raise ValueError(f"The chat template rendered to {type(text).__name__}, not text.")
    return text


def chat_prompts(
    tokenizer: Any,
    messages: Union[Conversation, Sequence[Conversation]],
    chat_template: Optional[str] = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: Optional[dict[str, Any]] = None,
) -> list[dict[str, Any]]:
    """Prompts for the engine, one per conversation: {"prompt": text, "prompt_token_ids": ids}."""
    if not isinstance(add_generation_prompt, bool):
        raise TypeError(f"add_generation_prompt must be a bool, got {add_generation_prompt!r}.")
    if not isinstance(continue_final_message, bool):
        raise TypeError(f"continue_final_message must be a bool, got {continue_final_message!r}.")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be True.")
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
        raise TypeError(f"chat_template_kwargs must be a dict or None, got {type(chat_template_kwargs).__name__}.")
    conversations = list(messages) if is_batch_of_conversations(messages) else [messages]
    template = resolve_chat_template(tokenizer, chat_template)
    prompts = []
    for i, conv in enumerate(conversations):
        norm = normalize_conversation(conv, i)
        if continue_final_message and norm[-1]["role"] != "assistant":
            raise ValueError(f"messages[{i}]: continue_final_message needs the last message to be the assistant's.")
        text = render_conversation(
            tokenizer, norm, template, add_generation_prompt, continue_final_message, chat_template_kwargs
        )
        ids = list(tokenizer.encode(text, add_special_tokens=False))
        if not ids:
            raise ValueError(f"messages[{i}] rendered to an empty prompt.")
        prompts.append({"prompt": text, "prompt_token_ids": ids})
    return prompts
