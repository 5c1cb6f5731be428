"""AsyncLLM's state and accessors have vLLM's shapes: awaited getters, is_running/errored/dead_error/check_health."""

from __future__ import annotations

import asyncio

import pytest

from vllm_lite.client.async_llm import AsyncLLM
from vllm_lite.client.exceptions import EngineDeadError
from vllm_lite.config import ModelConfig, VllmConfig
from vllm_lite.engine_args import EngineArgs


def test_accessors_are_awaited_and_state_follows_shutdown(tiny_checkpoint):
    async def main() -> None:
        llm = AsyncLLM.from_engine_args(
            EngineArgs(
                model=tiny_checkpoint,
                dtype="float32",
                max_model_len=128,
                device="cpu",
                kv_cache_memory_bytes=4 << 20,
                num_threads=1,
            )
        )
        try:
            tok = await llm.get_tokenizer()
            assert tok is llm.tokenizer and tok.encode("hi")
            mc = await llm.get_model_config()
            assert isinstance(mc, ModelConfig) and mc.max_model_len == 128
            assert isinstance(await llm.get_vllm_config(), VllmConfig)
            assert llm.is_running and not llm.errored and not llm.is_stopped
            await llm.check_health()
        finally:
            llm.shutdown()
        assert not llm.is_running and llm.errored and llm.is_stopped
        assert isinstance(llm.dead_error, EngineDeadError)
        with pytest.raises(EngineDeadError):
            await llm.check_health()

    asyncio.run(main())
