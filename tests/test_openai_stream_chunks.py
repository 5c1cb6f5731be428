"""StreamChunkWriter writes a text-only streamed choice from prebuilt JSON: it must be byte for byte the event
`sse()` makes of the pydantic chunk (CompletionStreamResponse / ChatCompletionStreamResponse) for any text,
finish and stop reason, id, model and index."""

from __future__ import annotations

import random

import pytest

from vllm_lite.entrypoints.openai.protocol import (
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
    DeltaMessage,
)
from vllm_lite.entrypoints.openai.utils import StreamChunkWriter, sse

SPECIAL = [
    '"',
    "\\",
    "\n",
    "\r",
    "\t",
    "\b",
    "\f",
    "\x00",
    "\x1f",
    "\x7f",
    "\u2028",
    "\u2029",
    "\ufffd",
    "é",
    "日",
    "😀",
    "/",
    "</",
]


def random_text(rng: random.Random) -> str:
    out = []
    for _ in range(rng.randrange(0, 12)):
        r = rng.random()
        if r < 0.4:
            out.append(rng.choice(SPECIAL))
        elif r < 0.6:
            out.append(chr(rng.randrange(0, 0x80)))
        elif r < 0.8:
            out.append(chr(rng.randrange(0x80, 0xD800)))
        else:
            out.append(chr(rng.randrange(0xE000, 0x110000)))
    return "".join(out)


def completion_event(rid, created, model, index, text, finish, stop) -> str:
    choice = CompletionResponseStreamChoice(
        index=index, text=text, logprobs=None, finish_reason=finish, stop_reason=stop, token_ids=None
    )
    return sse(CompletionStreamResponse(id=rid, created=created, model=model, choices=[choice]))


def chat_event(rid, created, model, index, text, finish, stop) -> str:
    choice = ChatCompletionResponseStreamChoice(
        index=index, delta=DeltaMessage(content=text), logprobs=None, finish_reason=finish, stop_reason=stop
    )
    return sse(ChatCompletionStreamResponse(id=rid, created=created, model=model, choices=[choice]))


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_writer_events_equal_the_pydantic_chunks(chat):
    rng = random.Random(7)
    reference = chat_event if chat else completion_event
    for case in range(600):
        rid = "cmpl-" + random_text(rng) if case % 7 == 0 else f"chatcmpl-{case:08x}"
        model = random_text(rng) if case % 5 == 0 else "models/qwen2-bench"
        created = rng.randrange(0, 2**31)
        index = rng.randrange(0, 40)
        text = random_text(rng)
        finish = rng.choice([None, None, "stop", "length", "abort"])
        stop = rng.choice([None, None, 2, 151643, "</s>", random_text(rng)])
        writer = StreamChunkWriter(chat, rid, created, model)
        assert writer.event(index, text, finish, stop) == reference(rid, created, model, index, text, finish, stop)
