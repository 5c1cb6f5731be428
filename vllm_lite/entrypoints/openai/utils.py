"""Small async helpers for the HTTP layer: merging generators, SSE framing, client disconnects, stopping a
background task."""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncGenerator, AsyncIterator, Awaitable, Callable, Optional, TypeVar

import anyio
from pydantic import BaseModel

T = TypeVar("T")


async def merge_async_iterators(*iterators: AsyncIterator[T]) -> AsyncGenerator[tuple[int, T], None]:
    """Yield (source index, item) from several async iterators as items arrive.

    Used to serve a multi-prompt completion: each prompt is its own engine
    request, and their outputs interleave. Closing this generator cancels the rest.
    """
    if len(iterators) == 1:
        it = iterators[0]
        try:
            async for item in it:
                yield 0, item
        finally:
            aclose = getattr(it, "aclose", None)
            if aclose is not None:
                await shielded(aclose())
        return
    loop = asyncio.get_running_loop()
    pending: dict[asyncio.Future, int] = {
        loop.create_task(_anext(it)): i
        for i, it in enumerate(iterators)  # type: ignore[arg-type]
    }
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                i = pending.pop(fut)
                try:
                    item = fut.result()
                except StopAsyncIteration:
                    continue
                pending[loop.create_task(_anext(iterators[i]))] = i  # type: ignore[arg-type]
                yield i, item
    finally:
        for fut in pending:
            fut.cancel()


async def _anext(it: AsyncIterator[T]) -> T:
    return await it.__anext__()


def sse(payload: BaseModel | dict[str, Any] | str) -> str:
    """One server-sent event ("data: ...\\n\\n")."""
    if isinstance(payload, BaseModel):
        body = payload.model_dump_json(exclude_unset=False)
    elif isinstance(payload, dict):
        body = json.dumps(payload)
    else:
        body = payload
    return f"data: {body}\n\n"


SSE_DONE = "data: [DONE]\n\n"

# The C string encoder json.dumps(s, ensure_ascii=False) uses: the same escapes as pydantic's JSON (", \\,
# \b \f \n \r \t, other control characters as \u00xx) and every other character as it is.
_json_str = json.encoder.encode_basestring  # type: ignore[attr-defined]


def _json_scalar(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, str):
        return _json_str(v)
    return str(int(v))


class StreamChunkWriter:
    """The SSE event of a plain streamed choice (text only: no logprobs, token ids or usage), written from
    prebuilt JSON fragments instead of a pydantic model a chunk. Byte for byte what `sse()` of the
    CompletionStreamResponse / ChatCompletionStreamResponse with that one choice gives (tests compare them)."""

    def __init__(self, chat: bool, response_id: str, created: int, model: str) -> None:
        kind = "chat.completion.chunk" if chat else "text_completion"
        self._head = (
            f'data: {{"id":{_json_str(response_id)},"object":"{kind}","created":{int(created)},'
            f'"model":{_json_str(model)},"choices":[{{"index":'
        )
        self._text_key = ',"delta":{"role":null,"content":' if chat else ',"text":'
        self._after_text = '},"logprobs":null,"finish_reason":' if chat else ',"logprobs":null,"finish_reason":'
        self._tail = (
            ',"token_ids":null}],"usage":null,"prompt_token_ids":null}\n\n'
            if chat
            else ',"token_ids":null,"prompt_token_ids":null}],"usage":null}\n\n'
        )

    def event(self, index: int, text: str, finish_reason: Optional[str], stop_reason: Any) -> str:
        return (
            f"{self._head}{int(index)}{self._text_key}{_json_str(text)}{self._after_text}"
            f'{_json_scalar(finish_reason)},"stop_reason":{_json_scalar(stop_reason)}{self._tail}'
        )


class DisconnectWatcher:
    """Polls the HTTP connection and runs `on_disconnect` once when the client has gone.

    Starlette cancels a streaming body when the client leaves, but a request
    still queued in the engine (no chunk to write yet) or a non-streaming one
    would otherwise run to the end: this frees its engine slot at once.
    """

    def __init__(self, raw_request: Any, on_disconnect: Callable[[], Awaitable[None]], interval_s: float = 0.5):
        self.raw_request = raw_request
        self.on_disconnect = on_disconnect
        self.interval_s = interval_s
        self.disconnected = False
        self._task: Optional[asyncio.Task] = None

    async def __aenter__(self) -> "DisconnectWatcher":
        if self.raw_request is not None and hasattr(self.raw_request, "is_disconnected"):
            self._task = asyncio.get_running_loop().create_task(self._watch())
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            if await self.raw_request.is_disconnected():
                self.disconnected = True
                await self.on_disconnect()
                return


async def shielded(coro: Awaitable[Any]) -> None:
    """Await `coro` even inside a cancelled scope (cleanup after a client left); never raises."""
    with anyio.CancelScope(shield=True):
        try:
            await coro
        except Exception:
            pass


async def cancel_and_wait(task: Optional[asyncio.Task]) -> None:
    """Cancel a background task (None: nothing to do) and wait until it has finished; its cancellation, or any
    error it ended with, is not raised here."""
    if task is None:
        return
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):
        pass
