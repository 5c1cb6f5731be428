"""The engine core in this process, no sockets: ``get_output()`` runs one step. For tests and debugging."""

from __future__ import annotations

from typing import Any

from vllm_lite.client.client_base import EngineCoreClient
from vllm_lite.config import VllmConfig
from vllm_lite.core.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason


class InprocClient(EngineCoreClient):
    """EngineCore in this process, behind the same interface as the process clients."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        self.engine_core = self._make_engine_core(vllm_config)
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
        self.engine_core.shutdown()
