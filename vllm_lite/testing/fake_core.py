"""A fake engine core for transport tests: EngineCore's interface over a deterministic token rule.

Tests of sockets, clients and process handling use it instead of a model: ``FakeEngineCore``
(in-process), ``FakeEngineCoreProc`` (the real socket loop serving it), ``ThreadedCore`` (that
loop in a thread of the test process), ``RawFrontend`` (the wire protocol by hand), and
``FakeSyncMPClient`` / ``FakeAsyncMPClient`` / ``FakeInprocClient``: the real clients, whose
private core is the fake, started by the launcher as ``python -m vllm_lite.testing.fake_core_main``.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
import uuid
from typing import Any, Optional

import torch
import zmq

from vllm_lite.client.core_client import (
    DEFAULT_STARTUP_TIMEOUT_S,
    AsyncMPClient,
    InprocClient,
    PrivateCore,
    SyncMPClient,
    spawn_private_core,
)
from vllm_lite.config import CacheConfig, DeviceConfig, ModelConfig, ParallelConfig, SchedulerConfig, VllmConfig
from vllm_lite.core.engine_core_proc import CoreProcOptions, EngineCoreProc
from vllm_lite.core.messages import (
    PROTOCOL_VERSION,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreOutputType,
    EngineCoreRequest,
    EngineCoreRequestType,
    FinishReason,
    HandshakeReply,
    HelloRequest,
    SchedulerStats,
    UtilityRequest,
)
from vllm_lite.endpoints import CoreAddresses
from vllm_lite.sampling_params import SamplingParams
from vllm_lite.serialization import MsgpackDecoder, MsgpackEncoder
from vllm_lite.worker.step import LogprobsTensors

FAKE_CORE_MODULE = "vllm_lite.testing.fake_core_main"

VOCAB = 1000


def fake_token(prompt: list[int], n: int) -> int:
    """The n-th (0-based) token FakeEngineCore generates for a prompt."""
    return (sum(prompt) * 7 + 13 * n + prompt[-1]) % VOCAB


class FakeEngineCore:
    """EngineCore's interface with a deterministic token rule and block accounting."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        hf = vllm_config.model_config.hf_config
        if hf.get("fake_fail_startup"):
            raise FileNotFoundError(hf["fake_fail_startup"])
        self.block_size = vllm_config.cache_config.block_size
        self.num_blocks = 256
        self.free_blocks = self.num_blocks
        self.step_delay = float(hf.get("fake_step_delay", 0.0))
        self.max_num_seqs = vllm_config.scheduler_config.max_num_seqs
        self.model_facts = {
            "model": vllm_config.model_config.name,
            "max_model_len": vllm_config.model_config.max_model_len,
            "block_size": self.block_size,
            "num_gpu_blocks": self.num_blocks,
            "vocab_size": VOCAB,
        }
        self.reqs: dict[str, dict[str, Any]] = {}
        self.crash_next_step = False
        self.steps = 0

    def _blocks(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def add_request(self, request: EngineCoreRequest, tenant_salt: Optional[bytes] = None) -> None:
        if request.request_id in self.reqs:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if not request.prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        need = self._blocks(len(request.prompt_token_ids) + (request.sampling_params.max_tokens or 16))
        if need > self.free_blocks:
            raise ValueError(f"request needs {need} blocks, {self.free_blocks} free")
        self.free_blocks -= need
        self.reqs[request.request_id] = {"req": request, "out": [], "blocks": need}

    def abort_requests(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            st = self.reqs.pop(rid, None)
            if st is not None:
                self.free_blocks += st["blocks"]

    def has_unfinished_requests(self) -> bool:
        return bool(self.reqs)

    def step(self) -> dict[int, EngineCoreOutputs]:
        if self.crash_next_step:
            raise RuntimeError("injected fault in step")
        if self.step_delay:
            time.sleep(self.step_delay)
        self.steps += 1
        per_client: dict[int, list[EngineCoreOutput]] = {}
        for rid in list(self.reqs)[: self.max_num_seqs]:
            st = self.reqs[rid]
            req: EngineCoreRequest = st["req"]
            tok = fake_token(req.prompt_token_ids, len(st["out"]))
            st["out"].append(tok)
            out = EngineCoreOutput(rid, [tok])
            k = req.sampling_params.logprobs
            if k is not None:
                out.new_logprobs = LogprobsTensors(
                    torch.full((1, k + 1), tok, dtype=torch.int64),
                    torch.linspace(-1.0, -2.0, k + 1).reshape(1, k + 1),
                    torch.tensor([1]),
                )
            if len(st["out"]) >= (req.sampling_params.max_tokens or 16):
                out.finish_reason = FinishReason.LENGTH
                self.abort_requests([rid])
            per_client.setdefault(req.client_index, []).append(out)
        stats = SchedulerStats(
            num_running_reqs=len(self.reqs), num_free_blocks=self.free_blocks, step_counter=self.steps
        )
        return {c: EngineCoreOutputs(outputs=o, scheduler_stats=stats) for c, o in per_client.items()}

    def take_ready_outputs(self) -> list:
        """EngineCore's: outputs a drain left to send before a utility answer (none: no step is ever in flight)."""
        return []

    def call_utility(self, method: str, args: list) -> Any:
        if method == "ping":
            return "pong"
        if method == "get_num_free_blocks":
            return self.free_blocks
        if method == "echo":
            return list(args)
        if method == "crash_on_next_step":
            self.crash_next_step = True
            return True
        if method == "unencodable":
            return object()
        raise ValueError(f"unknown utility method {method!r}")

    def shutdown(self) -> None:
        self.reqs.clear()


def fake_config(**hf_extra: Any) -> VllmConfig:
    hf = {"architectures": ["FakeForCausalLM"], "vocab_size": VOCAB, **hf_extra}
    return VllmConfig(
        model_config=ModelConfig(
            model="fake-model",
            tokenizer="fake-model",
            dtype=torch.float32,
            max_model_len=256,
            hf_config=hf,
            architecture="FakeForCausalLM",
            vocab_size=VOCAB,
        ),
        cache_config=CacheConfig(block_size=16),
        scheduler_config=SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=64, max_model_len=256),
        parallel_config=ParallelConfig(),
        device_config=DeviceConfig(device=torch.device("cpu"), num_threads=1),
    )


class FakeEngineCoreProc(EngineCoreProc):
    """The real socket loop, serving a FakeEngineCore."""

    def _make_engine_core(self, vllm_config: VllmConfig) -> Any:
        return FakeEngineCore(vllm_config)


class FakeInprocClient(InprocClient):
    def _make_engine_core(self, vllm_config: VllmConfig) -> Any:
        return FakeEngineCore(vllm_config)


def spawn_fake_core(vllm_config: VllmConfig, startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S) -> PrivateCore:
    """A private fake core process, started as the real one is."""
    return spawn_private_core(vllm_config, startup_timeout_s, module=FAKE_CORE_MODULE)


class FakeSyncMPClient(SyncMPClient):
    """SyncMPClient whose private core process serves a FakeEngineCore."""

    def _spawn_core(self, vllm_config: VllmConfig, startup_timeout_s: float) -> PrivateCore:
        return spawn_fake_core(vllm_config, startup_timeout_s)


class FakeAsyncMPClient(AsyncMPClient):
    """AsyncMPClient whose private core process serves a FakeEngineCore."""

    def _spawn_core(self, vllm_config: VllmConfig, startup_timeout_s: float) -> PrivateCore:
        return spawn_fake_core(vllm_config, startup_timeout_s)


def make_addresses(tmpdir: str) -> CoreAddresses:
    return CoreAddresses(input=f"ipc://{tmpdir}/in.sock", output=f"ipc://{tmpdir}/out.sock")


def request(rid: str, prompt: list[int], max_tokens: int = 4, **sp: Any) -> EngineCoreRequest:
    return EngineCoreRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, **sp), None, time.time())


class RawFrontend:
    """A frontend speaking the wire protocol by hand."""

    def __init__(self, ctx: zmq.Context, addresses: CoreAddresses, identity: Optional[bytes] = None) -> None:
        self.identity = identity or uuid.uuid4().bytes
        self.inp = ctx.socket(zmq.DEALER)
        self.out = ctx.socket(zmq.DEALER)
        for s, a in ((self.out, addresses.output), (self.inp, addresses.input)):
            s.setsockopt(zmq.IDENTITY, self.identity)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(a)
        self.enc = MsgpackEncoder()
        self.outputs_dec = MsgpackDecoder(EngineCoreOutputs)
        self.reply_dec = MsgpackDecoder(HandshakeReply)

    def send(self, kind: EngineCoreRequestType, obj: Any) -> None:
        self.inp.send_multipart([kind.value, *self.enc.encode(obj)])

    def hello(self, token: Optional[str] = None, version: int = PROTOCOL_VERSION) -> HandshakeReply:
        self.send(EngineCoreRequestType.HELLO, HelloRequest(version, token, "raw"))
        kind, msg = self.recv()
        assert kind in (EngineCoreOutputType.READY, EngineCoreOutputType.REFUSED)
        return msg

    def recv(self, timeout_s: float = 5.0) -> tuple[EngineCoreOutputType, Any]:
        if not self.out.poll(int(timeout_s * 1000)):
            raise TimeoutError("no message from the core")
        frames = self.out.recv_multipart()
        kind = EngineCoreOutputType(frames[0])
        if kind is EngineCoreOutputType.OUTPUTS:
            return kind, self.outputs_dec.decode(frames[1:])
        if kind in (EngineCoreOutputType.READY, EngineCoreOutputType.REFUSED):
            return kind, self.reply_dec.decode(frames[1:])
        return kind, None

    def collect(self, until_finished: set[str], timeout_s: float = 10.0) -> dict[str, list[EngineCoreOutput]]:
        """Outputs per request id until every id in `until_finished` has finished."""
        got: dict[str, list[EngineCoreOutput]] = {}
        pending = set(until_finished)
        deadline = time.monotonic() + timeout_s
        while pending:
            kind, outs = self.recv(max(0.1, deadline - time.monotonic()))
            if kind is not EngineCoreOutputType.OUTPUTS:
                continue
            for o in outs.outputs:
                got.setdefault(o.request_id, []).append(o)
                if o.finished:
                    pending.discard(o.request_id)
        return got

    def utility(self, method: str, *args: Any, call_id: int = 1) -> Any:
        self.send(EngineCoreRequestType.UTILITY, UtilityRequest(0, call_id, method, list(args)))
        while True:
            kind, outs = self.recv()
            if kind is EngineCoreOutputType.OUTPUTS and outs.utility_output is not None:
                assert outs.utility_output.call_id == call_id
                return outs.utility_output


class ThreadedCore:
    """An EngineCoreProc whose busy loop runs in a thread of this process."""

    def __init__(self, **options: Any) -> None:
        self.tmpdir = tempfile.mkdtemp(prefix="vlt-test-")
        self.addresses = make_addresses(self.tmpdir)
        self.proc = FakeEngineCoreProc(fake_config(), self.addresses, CoreProcOptions(**options))
        self.exit_code: Optional[int] = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        self.ctx = zmq.Context()

    def _run(self) -> None:
        self.exit_code = self.proc.run_busy_loop()

    def frontend(self, hello: bool = True, **kw: Any) -> RawFrontend:
        fe = RawFrontend(self.ctx, self.addresses)
        if hello:
            reply = fe.hello(**kw)
            assert reply.accepted, reply.reason
        return fe

    def stop(self) -> None:
        self.proc.request_shutdown()
        self.thread.join(10)
        self.ctx.destroy(linger=0)
        shutil.rmtree(self.tmpdir, ignore_errors=True)
        assert not self.thread.is_alive()
