"""The interface every engine-core client offers, whatever the transport or I/O style.

Callers (``LLMEngine``, ``AsyncLLM``, the HTTP server) use only what is declared here, so they
never probe a client with ``getattr``: a client that does not know a fact answers the default
(one core, never dead, no model path).
"""

from __future__ import annotations

import asyncio
import queue
from abc import ABC, abstractmethod
from typing import Any, Callable, Optional, Union

from vllm_lite.client.exceptions import EngineDeadError
from vllm_lite.core.messages import EngineCoreOutputs, EngineCoreRequest


class EngineCoreClient(ABC):
    """The frontend's handle on one engine core (or on several, routed as one)."""

    model_facts: dict[str, Any]
    client_index: int = 0
    # Where the core loaded the model and tokenizer from (an attached frontend builds its tokenizer from these).
    model_path: Optional[str] = None
    tokenizer_path: Optional[str] = None

    @abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None: ...

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        """Add requests as one batch (offline ``LLM.generate``): a process client sends them in one
        ADD_BATCH, which the core admits whole before its next step, so the batches it forms do not
        depend on timing. Here (no core of its own to step early): one by one."""
        for request in requests:
            self.add_request(request)

    @abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None: ...

    @abstractmethod
    def get_output(self) -> EngineCoreOutputs: ...

    @abstractmethod
    def call_utility(self, method: str, *args: Any) -> Any: ...

    @abstractmethod
    def shutdown(self) -> None: ...

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        raise NotImplementedError(f"{type(self).__name__} is synchronous; use AsyncMPClient.")

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        raise NotImplementedError(f"{type(self).__name__} is synchronous; use AsyncMPClient.")

    async def get_output_async(self) -> EngineCoreOutputs:
        raise NotImplementedError(f"{type(self).__name__} is synchronous; use AsyncMPClient.")

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} is synchronous; use AsyncMPClient.")

    def profile(self, is_start: bool = True) -> Any:
        """vLLM's ``EngineCoreClient.profile``: start (or stop, writing a trace) torch.profiler in the engine
        core(s) (data parallel: every rank), through the utility call ``"profile"``."""
        return self.call_utility("profile", is_start)

    async def profile_async(self, is_start: bool = True) -> Any:
        return await self.call_utility_async("profile", is_start)

    @property
    def is_dead(self) -> bool:
        """True once the engine core is known to be gone (calls then raise EngineDeadError)."""
        return False

    def core_for(self, request_id: str) -> Optional[int]:
        """Data parallel: the rank a live request was routed to (0 for a single core)."""
        return 0


class AsyncOnlyClient(EngineCoreClient):
    """An asyncio client: the blocking API would stall the event loop, so it refuses it."""

    def add_request(self, request: EngineCoreRequest) -> None:
        raise NotImplementedError(f"{type(self).__name__}: use await add_request_async().")

    def abort_requests(self, request_ids: list[str]) -> None:
        raise NotImplementedError(f"{type(self).__name__}: use await abort_requests_async().")

    def get_output(self) -> EngineCoreOutputs:
        raise NotImplementedError(f"{type(self).__name__}: use await get_output_async().")

    def call_utility(self, method: str, *args: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__}: use await call_utility_async().")


# What a client's output queue holds: outputs, or the error that ended the client.
OutputItem = Union[EngineCoreOutputs, Exception]


def shut_down_error() -> EngineDeadError:
    """What calls on a client raise after ``shutdown()``."""
    return EngineDeadError("This engine core client was shut down.")


def output_or_raise(item: OutputItem, put_back: Callable[[OutputItem], None]) -> EngineCoreOutputs:
    """An item taken from an output queue: outputs are returned; an error is put back (every
    later caller sees it too) and raised."""
    if isinstance(item, Exception):
        put_back(item)
        raise item
    return item


def take_output(outputs: "queue.Queue[OutputItem]", timeout: Optional[float]) -> EngineCoreOutputs:
    """Block for the next item of a client's output queue; TimeoutError after ``timeout``."""
    try:
        item = outputs.get(timeout=timeout)
    except queue.Empty:
        raise TimeoutError(f"No engine core output within {timeout} s.") from None
    return output_or_raise(item, outputs.put)


def running_loop() -> Optional[asyncio.AbstractEventLoop]:
    """The event loop running in this thread, or None (shutdown may come from inside or outside it)."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
