"""Private data parallelism: this frontend starts D engine cores of its own and routes over them.

`LLM(data_parallel_size=D)` / `LLMEngine.from_engine_args` / `AsyncLLM.from_engine_args`
come here with one VllmConfig per rank (`EngineArgs.create_dp_engine_configs`). Each rank is
an ordinary private core (`make_client(config, multiprocess=True)`); the cores start side by
side, and the same routing clients as for an attached data-parallel daemon
(`DPCoreClient` / `AsyncDPCoreClient`) spread requests over them.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

from vllm_lite.client.core_client import EngineCoreClient, make_client
from vllm_lite.client.dp_client import AsyncDPCoreClient, DPCoreClient
from vllm_lite.config import VllmConfig


def start_private_cores(
    configs: Sequence[VllmConfig], asyncio_mode: bool, **client_kwargs: Any
) -> list[EngineCoreClient]:
    """One private core per config, started concurrently; all or none (a failure stops the rest)."""
    with ThreadPoolExecutor(max_workers=len(configs), thread_name_prefix="dp-core-start") as pool:
        futures = [
            pool.submit(make_client, c, multiprocess=True, asyncio_mode=asyncio_mode, **client_kwargs) for c in configs
        ]
        errors, clients = [], []
        for f in futures:
            try:
                clients.append(f.result())
            except BaseException as e:  # noqa: BLE001 -- re-raised below once every start has ended
                errors.append(e)
    if errors:
        for c in clients:
            c.shutdown()
        raise errors[0]
    return clients


def make_private_dp_client(configs: Sequence[VllmConfig], asyncio_mode: bool, **client_kwargs: Any) -> EngineCoreClient:
    """A routing client over len(configs) private cores (a plain client when there is one).

    `client_kwargs` go to every per-core client (e.g. a start-up timeout).
    """
    if not configs:
        raise ValueError("data parallelism needs at least one engine config.")
    if len(configs) == 1:
        return make_client(configs[0], multiprocess=True, asyncio_mode=asyncio_mode, **client_kwargs)
    clients = start_private_cores(configs, asyncio_mode, **client_kwargs)
    try:
        if asyncio_mode:
            return AsyncDPCoreClient([], clients=clients)  # type: ignore[arg-type]
        return DPCoreClient([], clients=clients)  # type: ignore[arg-type]
    except BaseException:
        for c in clients:
            c.shutdown()
        raise
