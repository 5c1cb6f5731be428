"""How a frontend talks to the engine core: the client interface and the factory that picks one.

* ``InprocClient`` (``inproc_client``): the EngineCore lives in this process; ``get_output()``
  runs one step. For tests and debugging.
* ``SyncMPClient`` (``sync_mp_client``): a private core process (``private_core``, started through
  ``vllm_lite.launcher``) or an attached running one, a background thread receiving outputs.
* ``AsyncMPClient`` (``async_mp_client``): the same over asyncio sockets, for ``AsyncLLM``.

Both process clients share everything but their I/O style (``mp_client.MPClientBase``); data
parallelism routes over several of them (``dp_client``). The names are re-exported here so that
callers import every client from one place.
"""

from __future__ import annotations

from typing import Any

from vllm_lite.client.async_mp_client import AsyncMPClient
from vllm_lite.client.client_base import AsyncOnlyClient, EngineCoreClient
from vllm_lite.client.inproc_client import InprocClient
from vllm_lite.client.mp_client import DEFAULT_ENGINE_SILENCE_TIMEOUT_S, DEFAULT_HANDSHAKE_TIMEOUT_S, MPClientBase
from vllm_lite.client.private_core import (
    DEFAULT_STARTUP_TIMEOUT_S,
    ENGINE_CORE_MODULE,
    PrivateCore,
    set_frontend_thread_policy,
    spawn_private_core,
)
from vllm_lite.client.sync_mp_client import SyncMPClient
from vllm_lite.config import VllmConfig

__all__ = [
    "DEFAULT_ENGINE_SILENCE_TIMEOUT_S",
    "DEFAULT_HANDSHAKE_TIMEOUT_S",
    "DEFAULT_STARTUP_TIMEOUT_S",
    "ENGINE_CORE_MODULE",
    "AsyncMPClient",
    "AsyncOnlyClient",
    "EngineCoreClient",
    "InprocClient",
    "MPClientBase",
    "PrivateCore",
    "SyncMPClient",
    "make_client",
    "set_frontend_thread_policy",
    "spawn_private_core",
]


def make_client(
    vllm_config: VllmConfig,
    multiprocess: bool,
    asyncio_mode: bool,
    **kwargs: Any,
) -> EngineCoreClient:
    """The client for a use: in-process, or a private core with a sync or asyncio frontend."""
    if asyncio_mode and not multiprocess:
        raise ValueError("asyncio_mode=True requires multiprocess=True (the in-process client is synchronous).")
    if asyncio_mode:
        return AsyncMPClient(vllm_config, **kwargs)
    if multiprocess:
        return SyncMPClient(vllm_config, **kwargs)
    return InprocClient(vllm_config, **kwargs)
