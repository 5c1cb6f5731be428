"""The engine core in this process, no sockets: ``get_output()`` runs one step. For tests and debugging."""

from __future__ import annotations

import weakref
from typing import Any, Optional

from vllm_lite.client.client_base import EngineCoreClient
from vllm_lite.config import VllmConfig
from vllm_lite.core.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason
from vllm_lite.held_setting import HeldSetting


def _get_threads() -> int:
    import torch

    return torch.get_num_threads()


def _set_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)


# This process's torch threads as in-process engines given num_threads hold them (the caller's count comes back
# when the last of them is shut down or collected).
_torch_threads: HeldSetting[int] = HeldSetting(_get_threads, _set_threads)


def hold_num_threads(owner: object, vllm_config: VllmConfig) -> Optional[weakref.finalize]:
    """An in-process engine computes on this process's torch threads: an explicit DeviceConfig.num_threads sets
    them, as the engine core's own process does for itself (set_core_thread_policy), from before the model loads
    until the release (returned; None: no count given, the process's own is left alone) runs at shutdown or when
    ``owner`` is collected."""
    n = vllm_config.device_config.num_threads
    if n is None:
        return None
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"num_threads must be a positive integer, got {n!r}.")
    return _torch_threads.hold(owner, n)


class InprocClient(EngineCoreClient):
    """EngineCore in this process, behind the same interface as the process clients. Every in-process engine
    (``LLM(multiprocess=False)``, ``LLMEngine(..., multiprocess_mode=False)``) runs through here, so here is
    where it takes the process's torch threads (hold_num_threads)."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        self._threads_release = hold_num_threads(self, vllm_config)
        try:
            self.engine_core = self._make_engine_core(vllm_config)
        except BaseException:
            self._release_threads()
            raise
        self.model_facts = dict(self.engine_core.model_facts)
        self.client_index = 0
        self._errors: list[EngineCoreOutput] = []

    def _make_engine_core(self, vllm_config: VllmConfig) -> Any:
        """The engine to drive (a subclass may drive another with EngineCore's interface)."""
        from vllm_lite.core.engine_core import EngineCore

        return EngineCore(vllm_config)

    def add_request(self, request: EngineCoreRequest) -> None:
        request.client_index = self.client_index
        try:
            self.engine_core.add_request(request)
        except (ValueError, TypeError) as e:
            # Same contract as the process client: a bad request fails alone, as an output.
            message = f"{type(e).__name__}: {e}"
            self._errors.append(
                EngineCoreOutput(request.request_id, [], finish_reason=FinishReason.ERROR, error=message)
            )

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.engine_core.abort_requests(list(request_ids))

    def get_output(self) -> EngineCoreOutputs:
        step = self.engine_core.step() if self.engine_core.has_unfinished_requests() else {}
        outs = step.get(self.client_index) or EngineCoreOutputs()
        if self._errors:
            outs.outputs = self._errors + list(outs.outputs)
            self._errors = []
        return outs

    def call_utility(self, method: str, *args: Any) -> Any:
        return self.engine_core.call_utility(method, list(args))

    def shutdown(self) -> None:
        try:
            self.engine_core.shutdown()
        finally:
            self._release_threads()

    def _release_threads(self) -> None:
        if self._threads_release is not None:  # a finalizer: releases once, however often shutdown is called
            self._threads_release()
