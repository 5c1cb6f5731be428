"""A real engine core over the tiny Llama at addresses the test chooses, so that after it is killed a second one
can take its place and frontends attached by address see it come back."""

from __future__ import annotations

from typing import Any, Optional

from vllm_lite import launcher
from vllm_lite.config import encode_vllm_config
from vllm_lite.core.messages import EngineCoreArgs, EngineCoreReady
from vllm_lite.endpoints import CoreAddresses
from vllm_lite.engine_args import EngineArgs
from vllm_lite.testing.checkpoints import get_checkpoint

ENGINE_CORE_MODULE = "vllm_lite.core.engine_core_main"


def start_core_at(
    addresses: CoreAddresses, auth_token: Optional[str] = None, heartbeat_timeout_s: float = 600.0, **engine_kw: Any
) -> launcher.ChildProcess:
    """Start the core (small KV cache, CPU) and wait until it is ready; the caller stops it.

    ``engine_kw``: EngineArgs fields over those defaults (e.g. the dtype a test's offline reference used)."""
    kw: dict[str, Any] = dict(
        model=get_checkpoint("llama"), device="cpu", max_model_len=1024, block_size=16, kv_cache_memory_bytes=16 << 20
    )
    cfg = EngineArgs(**{**kw, **engine_kw}).create_engine_config()
    args = EngineCoreArgs(
        vllm_config=encode_vllm_config(cfg),
        input_address=addresses.input,
        output_address=addresses.output,
        heartbeat_timeout_s=heartbeat_timeout_s,
        auth_token=auth_token,
    )
    proc = launcher.start_child(ENGINE_CORE_MODULE, args, EngineCoreReady, name="test-core")
    try:
        proc.wait_ready(120)
    except BaseException:
        proc.stop()
        raise
    return proc
