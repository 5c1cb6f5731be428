"""What a request's ``model`` can name: the base model's served names and the LoRA adapters (vLLM's
``OpenAIServingModels``), behind /v1/models, /v1/load_lora_adapter and /v1/unload_lora_adapter.

Adapter ids. Several frontends may share one engine core (``serve --api-server-count N``, and any
frontend that attaches to a running core), and the core knows an adapter by its ``lora_int_id`` alone
(device slot, host cache, prefix-cache hash). A per-frontend counter (vLLM's, from 1) would give two
frontends' different adapters the same id, and one would silently run the other's weights. So the id
is derived from the adapter's name and path (52 bits of a SHA-256, exact as a JSON number in any client):
every frontend computes the same id for the same adapter, so they share its slot and its cached prefixes,
and different adapters get different ids with no coordination (a chance collision, about n**2 / 2**53
for n adapters, is refused when both are in one frontend). Unloading in one frontend frees the core's copy; another frontend still
serving it has the core read it again from its path on its next request.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import logging
import os
from http import HTTPStatus
from typing import Any, Optional, Sequence

from vllm_lite.entrypoints.openai.errors import BadRequestError, ModelNotFoundError, OpenAIServingError
from vllm_lite.entrypoints.openai.lora_modules import LoRAModulePath
from vllm_lite.entrypoints.openai.protocol import (
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    UnloadLoRAAdapterRequest,
)
from vllm_lite.lora.request import LoRARequest

logger = logging.getLogger(__name__)

# lora_int_id range: 1..2**52: within the engine's int64 and exact as a JSON number (a double) in any client.
_ID_BITS = 52


class InvalidUserInputError(OpenAIServingError):
    """vLLM's error type for a malformed adapter request (400)."""

    status_code = HTTPStatus.BAD_REQUEST
    err_type = "InvalidUserInput"


def adapter_id(name: str, path: str) -> int:
    """The ``lora_int_id`` of adapter ``name`` at ``path``: the same in every frontend, without coordination."""
    digest = hashlib.sha256(f"{name}\0{path}".encode()).digest()
    return (int.from_bytes(digest[:8], "big") >> (64 - _ID_BITS)) + 1


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


class OpenAIServingModels:
    """The base model's names and the LoRA adapters this frontend serves, by name."""

    def __init__(
        self,
        engine: Any,
        served_model_names: Sequence[str],
        *,
        model_path: Optional[str] = None,
        max_model_len: Optional[int] = None,
        lora_modules: Optional[Sequence[LoRAModulePath]] = None,
    ) -> None:
        if not served_model_names:
            raise ValueError("served_model_names must name at least one model.")
        self.engine = engine
        self.served_model_names = list(served_model_names)
        self.model_path = model_path
        self.max_model_len = max_model_len
        self.static_lora_modules = list(lora_modules or [])
        self.lora_requests: dict[str, LoRARequest] = {}  # by lora_name, in load order
        # Requests of this frontend running per adapter id, and unloaded ids whose engine copy is freed once
        # their last running request ends (the core cannot run a request whose adapter it dropped).
        self._running: dict[int, int] = {}
        self._free_when_idle: set[int] = set()
        self._lock = asyncio.Lock()  # one load/unload at a time: check, engine call, record

    # ------------------------------------------------------------------ names
    def is_base_model(self, name: Optional[str]) -> bool:
        return name in self.served_model_names

    def lora_request(self, model: Optional[str]) -> Optional[LoRARequest]:
        """The adapter a request's ``model`` names (None: the base model); 404 as vLLM for anything else."""
        if model is None or self.is_base_model(model):
            return None
        found = self.lora_requests.get(model)
        if found is None:
            raise ModelNotFoundError(f"The model `{model}` does not exist.", param="model")
        return found

    def model_name(self, lora_request: Optional[LoRARequest] = None) -> str:
        """The ``model`` a response reports: the adapter's name, else the first served name (vLLM's rule)."""
        return lora_request.lora_name if lora_request is not None else self.served_model_names[0]

    def show_available_models(self) -> ModelList:
        """/v1/models: the base model's names, then every adapter with its base as ``parent``."""
        cards = [
            ModelCard(id=name, root=self.model_path, max_model_len=self.max_model_len)
            for name in self.served_model_names
        ]
        for lora in self.lora_requests.values():
            cards.append(
                ModelCard(
                    id=lora.lora_name, root=lora.lora_path, parent=lora.base_model_name or self.served_model_names[0]
                )
            )
        return ModelList(data=cards)

    # ------------------------------------------------------------------ adapters
    async def init_static_loras(self) -> None:
        """Load every ``--lora-modules`` adapter; ValueError with the reason if one fails (start-up stops)."""
        for module in self.static_lora_modules:
            try:
                await self.load_lora_adapter(
                    LoadLoRAAdapterRequest(lora_name=module.name, lora_path=module.path), module.base_model_name
                )
            except OpenAIServingError as e:
                raise ValueError(f"--lora-modules {module.name}={module.path}: {e.message}") from None

    async def load_lora_adapter(self, request: LoadLoRAAdapterRequest, base_model_name: Optional[str] = None) -> str:
        """Check, load into the engine (which validates the adapter and keeps it ready), then serve the name."""
        name, path = request.lora_name, request.lora_path
        if not name or not path:
            raise InvalidUserInputError("Both 'lora_name' and 'lora_path' must be provided.")
        if base_model_name is not None and not self.is_base_model(base_model_name):
            raise InvalidUserInputError(
                f"base_model_name {base_model_name!r} is not a served model name ({', '.join(self.served_model_names)})."
            )
        async with self._lock:
            if name in self.lora_requests:
                raise InvalidUserInputError(f"The lora adapter '{name}' has already been loaded.")
            if self.is_base_model(name):
                raise InvalidUserInputError(f"The lora adapter name '{name}' is the base model's name.")
            lora_id = adapter_id(name, path)
            clash = next((r for r in self.lora_requests.values() if r.lora_int_id == lora_id), None)
            if clash is not None:  # a hash collision: refuse rather than share weights
                raise InvalidUserInputError(
                    f"The lora adapter '{name}' would share its id with '{clash.lora_name}': choose another name."
                )
            if not os.path.isdir(path):
                raise ModelNotFoundError(
                    f"No adapter found for '{name}' at {path!r}: no such directory.", param="lora_path"
                )
            lora_request = LoRARequest(
                lora_name=name, lora_int_id=lora_id, lora_path=path, base_model_name=base_model_name
            )
            add_lora = getattr(self.engine, "add_lora", None)
            if add_lora is None:
                raise BadRequestError("This server's engine serves no LoRA adapters.", param="lora_path")
            try:
                await _maybe_await(add_lora(lora_request))
            except (ValueError, TypeError, OSError) as e:
                if "No adapter found" in str(e) or isinstance(e, FileNotFoundError):
                    raise ModelNotFoundError(str(e), param="lora_path") from e
                raise BadRequestError(str(e), param="lora_path") from e
            self.lora_requests[name] = lora_request
            self._free_when_idle.discard(lora_id)  # loaded again before its last request ended
        logger.info("Loaded new LoRA adapter: name '%s', path '%s', id %d", name, path, lora_id)
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload_lora_adapter(self, request: UnloadLoRAAdapterRequest) -> str:
        """Stop serving the name and free the engine's copy of the adapter."""
        if not request.lora_name and not request.lora_int_id:
            raise InvalidUserInputError("either 'lora_name' and 'lora_int_id' needs to be provided.")
        async with self._lock:
            found = self.lora_requests.get(request.lora_name) if request.lora_name else None
            if found is None and not request.lora_name:
                found = next((r for r in self.lora_requests.values() if r.lora_int_id == request.lora_int_id), None)
            if found is None or (request.lora_int_id and found.lora_int_id != request.lora_int_id):
                label = request.lora_name or request.lora_int_id
                raise ModelNotFoundError(f"The lora adapter '{label}' cannot be found.", param="lora_name")
            del self.lora_requests[found.lora_name]  # new requests get a 404 from here on
            if self._running.get(found.lora_int_id):
                self._free_when_idle.add(found.lora_int_id)  # its running requests finish with it first
            else:
                await self._free(found.lora_int_id)
        logger.info("Removed LoRA adapter: name '%s'", found.lora_name)
        return f"Success: LoRA adapter '{found.lora_name}' removed successfully."

    def request_started(self, lora_request: LoRARequest) -> None:
        """A request of this frontend runs with the adapter (pair with `request_ended`)."""
        self._running[lora_request.lora_int_id] = self._running.get(lora_request.lora_int_id, 0) + 1

    async def request_ended(self, lora_request: LoRARequest) -> None:
        """The request is over: an adapter unloaded meanwhile is freed in the engine with its last request."""
        lora_id = lora_request.lora_int_id
        left = self._running.get(lora_id, 0) - 1
        if left > 0:
            self._running[lora_id] = left
            return
        self._running.pop(lora_id, None)
        if lora_id in self._free_when_idle:
            self._free_when_idle.discard(lora_id)
            await self._free(lora_id)

    async def _free(self, lora_id: int) -> None:
        """remove_lora in the engine (AsyncLLM's; it forgets the id in this frontend's processor too)."""
        remove_lora = getattr(self.engine, "remove_lora", None)
        if remove_lora is None:
            return
        try:
            await _maybe_await(remove_lora(lora_id))
        except (ValueError, TypeError) as e:  # LoRA off or already gone from the engine: nothing left to free
            logger.info("remove_lora(%d): %s", lora_id, e)
