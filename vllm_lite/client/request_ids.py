"""A private namespace for this frontend's request ids in a core that several frontends share.

The core keys requests by id across all attached frontends, so two frontends both sending
"req-0" would clash. An attached client prefixes every id it sends with a random tag of its
own and strips it from every output, so callers keep choosing ids freely.
"""

from __future__ import annotations

import uuid

import msgspec

from vllm_lite.core.messages import EngineCoreOutputs, EngineCoreRequest


class RequestIdNamespace:
    """Adds a random per-client prefix to outgoing ids and strips it from incoming outputs."""

    def __init__(self) -> None:
        self.prefix = f"{uuid.uuid4().hex[:12]}/"

    def request(self, request: EngineCoreRequest) -> EngineCoreRequest:
        """A copy of ``request`` under its namespaced id (the caller's struct is left alone)."""
        return msgspec.structs.replace(request, request_id=self.prefix + request.request_id)

    def ids(self, request_ids: list[str]) -> list[str]:
        return [self.prefix + rid for rid in request_ids]

    def strip(self, outs: EngineCoreOutputs) -> EngineCoreOutputs:
        """Back to the caller's ids, in place."""
        n, prefix = len(self.prefix), self.prefix
        for out in outs.outputs:
            if out.request_id.startswith(prefix):
                out.request_id = out.request_id[n:]
        return outs
