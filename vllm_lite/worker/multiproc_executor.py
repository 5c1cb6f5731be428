"""MultiprocExecutor: the engine core drives N tensor-parallel worker processes, one rank each.

Each step the executor sends the SchedulerOutput to every rank over one ZMQ
ROUTER socket (typed msgpack, no pickle); the ranks run the sharded model in
lockstep over torch.distributed and rank 0 sends back the ModelRunnerOutput.

Local ranks are started by ``vllm_lite.launcher`` (``python -m vllm_lite.worker.tp_worker_proc``);
a rank that fails to start reports its traceback, which ``WorkerDiedError`` carries.

Rendezvous: torch.distributed's TCPStore, hosted here, always listens on loopback (its server
has no authentication and would otherwise bind every interface). With several nodes, other
nodes reach it only through ``rendezvous_gate.RendezvousGate`` on master_addr:master_port,
which admits peers that prove the engine's auth token; ranks' ZMQ identities are random.

Failure handling: while waiting, the executor polls the socket together with
every local rank's launcher fd, so a rank that dies (or reports an
error) raises `WorkerDiedError` from execute_model within one poll -- the
engine core turns that into a dead-engine message for every frontend.
Ranks on other nodes are watched through rank 0: their death breaks the
collective rank 0 is in, and rank 0 reports the error. A step that produces
nothing for `step_timeout_s` raises too, so nothing ever hangs forever.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import shutil
import socket
import time
from typing import Any, Optional

import torch.distributed as dist
import zmq

from vllm_lite import envs, launcher, launcher_child
from vllm_lite.config import VllmConfig, encode_vllm_config
from vllm_lite.endpoints import ipc_address, private_ipc_dir
from vllm_lite.serialization import MsgpackDecoder, MsgpackEncoder
from vllm_lite.worker import tp_protocol as P
from vllm_lite.worker.rendezvous_gate import RendezvousGate
from vllm_lite.worker.step import ModelRunnerOutput, SchedulerOutput
from vllm_lite.worker.tp_worker_proc import TP_RANK_MODULE, RankReady, RankSpec, worker_threads

logger = logging.getLogger("vllm_lite.executor")

# After SHUTDOWN, how long ranks get to exit on their own before SIGTERM (and 1 s more before SIGKILL).
_SHUTDOWN_GRACE_S = 2.0


class WorkerDiedError(RuntimeError):
    """A tensor-parallel rank died or failed; the engine cannot continue."""


class MultiprocExecutor:
    """Tensor parallelism over worker processes; same interface as UniProcExecutor."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        pc = vllm_config.parallel_config
        if pc.node_rank != 0:
            raise ValueError(
                f"node_rank={pc.node_rank}: the engine runs on node 0; start other nodes with `vllm-lite worker`."
            )
        self.config = vllm_config
        self.world_size = pc.tensor_parallel_size
        self.step_timeout_s = envs.VLLM_LITE_TP_STEP_TIMEOUT_S
        self._procs: dict[int, launcher.ChildProcess] = {}
        self._gate: Optional[RendezvousGate] = None
        self._tmpdir: Optional[str] = None
        self._closed = False
        self._encoder = MsgpackEncoder()
        self._out_decoder = MsgpackDecoder(ModelRunnerOutput)
        self._any_decoder = MsgpackDecoder()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a rank that is not connected raises
        self._sock.setsockopt(zmq.LINGER, 0)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._identities = [P.rank_identity(r) for r in range(self.world_size)]
        try:
            self._start(vllm_config)
        except BaseException:
            self.shutdown()
            raise

    # ------------------------------------------------------------------ startup
    def _start(self, vllm_config: VllmConfig) -> None:
        pc = vllm_config.parallel_config
        host = pc.master_addr
        # The rendezvous store lives here: ranks find the config and our address in it, and
        # torch.distributed sets up the process group through it. It listens on loopback only.
        startup_timeout_s = envs.VLLM_LITE_TP_STARTUP_TIMEOUT_S
        listener = self._rendezvous_listener(pc)
        if pc.nnodes == 1:
            store_sock = listener  # all ranks are local: the store itself, on loopback
        else:
            token = pc.rendezvous_token or envs.VLLM_LITE_AUTH_TOKEN
            if not token:
                raise ValueError(
                    "multi-node tensor parallelism needs an auth token (--auth-token or VLLM_LITE_AUTH_TOKEN): "
                    "other nodes reach the rendezvous over the network, and it admits only peers that prove it."
                )
            store_sock = socket.create_server(("127.0.0.1", 0))
        self._store = dist.TCPStore(
            "127.0.0.1",
            store_sock.getsockname()[1],
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=startup_timeout_s),
            master_listen_fd=store_sock.fileno(),
        )
        store_sock.detach()  # the store owns (and closes) the fd now
        if pc.nnodes > 1:
            self._gate = RendezvousGate(listener, self._store.port, token)
        self.master_port = self._store.port if pc.nnodes == 1 else listener.getsockname()[1]
        if pc.nnodes == 1:
            self._tmpdir = private_ipc_dir("vllm-lite-tp-")
            launcher_child.remove_if_orphaned(self._tmpdir)  # a core whose parent died exits without shutdown()
            address = ipc_address(self._tmpdir, "executor.sock")
            self._sock.bind(address)
        else:
            ip = socket.gethostbyname(host)  # zmq binds to an interface address, not a host name
            port = self._sock.bind_to_random_port(f"tcp://{ip}")
            address = f"tcp://{ip}:{port}"
        public = dataclasses.replace(pc, rendezvous_token=None, master_listen_fd=None)
        self._store.set(
            P.STORE_CONFIG_KEY, encode_vllm_config(dataclasses.replace(vllm_config, parallel_config=public))
        )
        self._store.set(P.STORE_ADDRESS_KEY, address)
        self._store.set(P.STORE_IDENTITIES_KEY, P.encode_identities(self._identities))

        per_node = pc.ranks_per_node
        threads = vllm_config.device_config.num_threads or worker_threads(per_node)
        for local_rank in range(per_node):
            spec = RankSpec(
                rank=local_rank,
                local_rank=local_rank,
                world_size=self.world_size,
                master_addr="127.0.0.1",  # local ranks use the store directly
                master_port=self._store.port,
                num_threads=threads,
            )
            # Our socket dir goes with us: shutdown() removes it; if this process is killed, the ranks outliving it.
            self._procs[local_rank] = launcher.start_child(
                TP_RANK_MODULE,
                spec,
                RankReady,
                name=f"tp-rank-{local_rank}",
                cleanup_paths=[self._tmpdir] if self._tmpdir else (),
            )
        for proc in self._procs.values():
            self._poller.register(proc.fileno(), zmq.POLLIN)
        logger.info(
            "tensor parallel: %d ranks (%d on this node, %d node(s)); rendezvous %s:%d",
            self.world_size,
            per_node,
            pc.nnodes,
            host,
            self.master_port,
        )
        ready: set[int] = set()
        deadline = time.monotonic() + startup_timeout_s
        while len(ready) < self.world_size:
            rank, kind, payload = self._recv(deadline, "waiting for tensor-parallel ranks to start")
            if kind != P.FromWorker.READY:
                raise WorkerDiedError(f"rank {rank} sent message type {kind} before READY")
            ready.add(rank)
        try:  # local ranks said READY on the socket: their launcher answers are there too
            launcher.wait_ready(list(self._procs.values()), max(1.0, deadline - time.monotonic()))
        except launcher.ChildStartupError as e:
            raise WorkerDiedError(f"tensor-parallel rank failed to start: {e}\n{e.traceback}") from e

    @staticmethod
    def _rendezvous_listener(pc: Any) -> socket.socket:
        """The socket other ranks rendezvous on: the one a parent bound for us, else a new one
        (loopback when every rank is local; master_addr:master_port for other nodes)."""
        if pc.master_listen_fd is not None:
            return socket.socket(fileno=pc.master_listen_fd)
        host = "127.0.0.1" if pc.nnodes == 1 else pc.master_addr
        return socket.create_server((host, pc.master_port))

    # ------------------------------------------------------------------ messaging
    def _broadcast(self, kind: P.ToWorker, obj: Any = None) -> None:
        frames = [P.type_frame(kind)] + (self._encoder.encode(obj) if obj is not None else [])
        zframes = [zmq.Frame(f) for f in frames]  # built once, sent to every rank without copying again
        try:
            for ident in self._identities:
                self._sock.send_multipart([ident, *zframes], copy=False)
        except zmq.ZMQError as e:
            self._check_procs()
            raise WorkerDiedError(f"cannot reach a tensor-parallel rank: {e}") from e

    def _check_procs(self) -> None:
        for rank, proc in self._procs.items():
            if proc.exitcode is not None:
                err = proc.startup_error()
                why = f" before it was ready: {err.exc_type}: {err.message}\n{err.traceback}" if err else "."
                raise WorkerDiedError(
                    f"tensor-parallel worker rank {rank} (pid {proc.pid}) died with exit code {proc.exitcode}{why}"
                )

    def _recv(self, deadline: float, what: str) -> tuple[int, int, list[Any]]:
        """The next message from any rank: (rank, type, payload frames); raises if a rank dies or errs."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerDiedError(f"timed out {what} (no reply from rank 0 after the deadline).")
            events = dict(self._poller.poll(min(left, 1.0) * 1000))
            if self._sock in events:
                frames = self._sock.recv_multipart(copy=False)
                ident = frames[0].bytes
                if ident not in self._identities or len(frames) < 2 or len(frames[1].bytes) != 1:
                    logger.warning("dropped a malformed message on the tensor-parallel socket")
                    continue
                rank = self._identities.index(ident)
                kind = frames[1].bytes[0]
                if kind == P.FromWorker.ERROR:
                    text = frames[2].bytes.decode(errors="replace") if len(frames) > 2 else "unknown error"
                    raise WorkerDiedError(text)
                return rank, kind, frames[2:]
            if events:
                self._check_procs()

    def _collect(self, from_ranks: list[int], decoder: MsgpackDecoder, what: str) -> dict[int, Any]:
        deadline = time.monotonic() + self.step_timeout_s
        out: dict[int, Any] = {}
        while len(out) < len(from_ranks):
            rank, kind, payload = self._recv(deadline, what)
            if kind != P.FromWorker.RESULT or rank not in from_ranks:
                raise WorkerDiedError(f"unexpected message type {kind} from rank {rank} while {what}")
            out[rank] = decoder.decode(payload)
        return out

    # ------------------------------------------------------------------ executor interface
    def determine_num_blocks(self) -> tuple[int, int]:
        """Every rank sizes its own shard of the cache; the engine takes the smallest."""
        self._broadcast(P.ToWorker.DETERMINE_NUM_BLOCKS)
        replies = self._collect(list(range(self.world_size)), self._any_decoder, "sizing the KV cache")
        return min(int(r[0]) for r in replies.values()), min(int(r[1]) for r in replies.values())

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self._broadcast(P.ToWorker.INITIALIZE_CACHE, [num_gpu_blocks, num_cpu_blocks])
        self._collect(list(range(self.world_size)), self._any_decoder, "allocating the KV cache")

    def execute_model(self, scheduler_output: SchedulerOutput, non_block: bool = False) -> ModelRunnerOutput:
        if non_block:  # verify_async_scheduling keeps async scheduling off with tensor_parallel_size > 1
            raise NotImplementedError("async scheduling does not support tensor_parallel_size > 1 yet.")
        if self._closed:
            raise WorkerDiedError("the tensor-parallel executor is shut down.")
        self._broadcast(P.ToWorker.EXECUTE_MODEL, scheduler_output)
        return self._collect([0], self._out_decoder, "running a model step")[0]

    def lora_call(self, method: str, *args: Any) -> Any:
        """A LoRA worker call (add_lora, remove_lora, list_loras, pin_lora) on every rank; rank 0's answer."""
        self._broadcast(P.ToWorker.LORA, [method, list(args)])
        replies = self._collect(list(range(self.world_size)), self._any_decoder, f"running {method}")
        for rank in sorted(replies):
            if "error" in replies[rank]:
                raise ValueError(f"{method} on tensor-parallel rank {rank}: {replies[rank]['error']}")
        result = replies[0]["result"]
        return set(result) if method == "list_loras" else result

    def shutdown(self) -> None:
        """Tell ranks to exit, give them a moment, then terminate/kill the local ones. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            for ident in self._identities:
                try:
                    self._sock.send_multipart([ident, P.type_frame(P.ToWorker.SHUTDOWN)], flags=zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
        finally:
            procs = list(self._procs.values())
            launcher.wait_exited(procs, _SHUTDOWN_GRACE_S)
            launcher.stop_all(procs, grace_s=1.0)
            self._sock.close(linger=0)
            self._ctx.term()
            if self._tmpdir:
                shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._store = None  # stops the rendezvous server: ranks on other nodes notice and exit
            if self._gate is not None:
                self._gate.close()
