"""A real engine core (tiny Llama, real KV cache) served by `EngineCoreProc` in a thread of this process.

For tests about what frontends attached to one core can see of each other (prefix-cache isolation):
frontends are `RawFrontend`s speaking the wire protocol, so the test sees exactly what a
hostile frontend would. No process spawn, so it costs about one model load.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
from typing import Any, Optional

import torch
import zmq

from vllm_lite.core.engine_core_proc import CoreProcOptions, EngineCoreProc
from vllm_lite.core.messages import EngineCoreOutput, EngineCoreRequestType
from vllm_lite.engine_args import EngineArgs
from vllm_lite.sampling_params import SamplingParams
from vllm_lite.testing.checkpoints import get_checkpoint
from vllm_lite.testing.core_harness import make_request, unique_id
from vllm_lite.testing.fake_core import RawFrontend, make_addresses


class ServedCore:
    """`EngineCoreProc` over a real tiny EngineCore; its busy loop runs in a daemon thread."""

    def __init__(self, auth_token: Optional[str] = None, **engine_kwargs: Any) -> None:
        kwargs: dict[str, Any] = dict(
            model=get_checkpoint("llama"),
            device="cpu",
            max_model_len=128,
            block_size=8,
            kv_cache_memory_bytes=1 << 20,
            # The core sets torch's thread count for its process; ours is this test process, so keep it.
            num_threads=torch.get_num_threads(),
        )
        kwargs.update(engine_kwargs)
        self.tmpdir = tempfile.mkdtemp(prefix="vlt-served-")
        self.addresses = make_addresses(self.tmpdir)
        self.proc = EngineCoreProc(
            EngineArgs(**kwargs).create_engine_config(), self.addresses, CoreProcOptions(auth_token=auth_token)
        )
        self.exit_code: Optional[int] = None
        self.thread = threading.Thread(target=self._run, daemon=True, name="served-core")
        self.thread.start()
        self.ctx = zmq.Context()

    def _run(self) -> None:
        self.exit_code = self.proc.run_busy_loop()

    def frontend(self, token: Optional[str] = None) -> RawFrontend:
        """A new frontend (fresh random identity) that has completed HELLO."""
        fe = RawFrontend(self.ctx, self.addresses)
        reply = fe.hello(token)
        assert reply.accepted, reply.reason
        return fe

    def stop(self) -> None:
        self.proc.request_shutdown()
        self.thread.join(30)
        self.ctx.destroy(linger=0)
        shutil.rmtree(self.tmpdir, ignore_errors=True)
        assert not self.thread.is_alive(), "the served core did not stop"


def first_output(fe: RawFrontend, prompt: list[int], timeout_s: float = 60.0, **fields: Any) -> EngineCoreOutput:
    """Send one greedy 1-token request and return its first output (which carries num_cached_tokens)."""
    rid = unique_id("probe")
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    fe.send(EngineCoreRequestType.ADD, make_request(rid, prompt, params, **fields))
    outs = fe.collect({rid}, timeout_s=timeout_s)[rid]
    assert outs[-1].error is None, outs[-1].error
    return outs[0]
