"""Small async helpers for the HTTP layer: merging generators, SSE framing, client disconnects."""

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
