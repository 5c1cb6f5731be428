"""One tensor-parallel rank in its own process: join the group, build this rank's shard, serve steps.

Started by the launcher (``python -m vllm_lite.worker.tp_worker_proc``, arguments ``RankSpec``)
from MultiprocExecutor for the ranks on its node, or from `vllm-lite worker` on other
nodes. Everything else a rank needs (the engine config, the executor's address) comes
from the TCPStore at master_addr:master_port, so a remote node needs only those two plus
its node rank. It answers ``RankReady`` once its shard is built, or its start-up error.

A rank exits when told to, when its parent process (the launcher's watch) or the
TCPStore host (any rank) is gone, or on any error -- after reporting the
error to the executor, which then fails the engine loudly.
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import traceback
from typing import Any, Optional

import msgspec
import torch

from vllm_lite.launcher_child import ChildChannel, run_child

logger = logging.getLogger("vllm_lite.tp_worker")

# How often an idle rank checks that its parent / the store host is still there.
_LIVENESS_INTERVAL_S = 1.0


TP_RANK_MODULE = "vllm_lite.worker.tp_worker_proc"


class RankSpec(msgspec.Struct, kw_only=True):
    """What a rank process is started with (the launcher's typed arguments)."""

    rank: int
    local_rank: int
    world_size: int
    master_addr: str
    master_port: int
    num_threads: int
    model_override: Optional[str] = None  # this node's path to the same checkpoint, if it differs
    connect_timeout_s: float = 300.0


class RankReady(msgspec.Struct):
    """The rank joined the group and built its shard."""

    rank: int


def worker_threads(ranks_on_node: int) -> int:
    """An even share of this process's CPUs per rank on the node (1 each for TP=2 on 2 cores)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, cpus // max(1, ranks_on_node))


def run_rank(spec: RankSpec, channel: ChildChannel) -> int:
    """A rank process's life (``launcher_child.run_child`` exits with the code): 0 on shutdown, 1 on error."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine (or `vllm-lite worker`) decides when we stop
    torch.set_num_threads(spec.num_threads)
    rank = _RankProcess(spec)  # a failure here reaches the parent with its traceback
    channel.ready(RankReady(spec.rank))
    try:
        return rank.serve()
    except BaseException:  # noqa: BLE001 -- reported by _RankProcess where possible; log the rest
        logger.error("tensor-parallel rank %d failed:\n%s", spec.rank, traceback.format_exc())
        return 1


class _RankProcess:
    def __init__(self, spec: RankSpec) -> None:
        import torch.distributed as dist
        import zmq

        from vllm_lite.config import decode_vllm_config
        from vllm_lite.serialization import MsgpackDecoder, MsgpackEncoder
        from vllm_lite.worker import tp_protocol as P
        from vllm_lite.worker.step import SchedulerOutput

        self.spec = spec
        self.P = P
        self.store = dist.TCPStore(
            spec.master_addr,
            spec.master_port,
            is_master=False,
            timeout=datetime.timedelta(seconds=spec.connect_timeout_s),
        )
        self.store.wait([P.STORE_CONFIG_KEY, P.STORE_ADDRESS_KEY, P.STORE_IDENTITIES_KEY])
        config = decode_vllm_config(self.store.get(P.STORE_CONFIG_KEY))
        address = self.store.get(P.STORE_ADDRESS_KEY).decode()
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, P.decode_identities(self.store.get(P.STORE_IDENTITIES_KEY))[spec.rank])
        self.sock.setsockopt(zmq.LINGER, 2000)
        self.sock.connect(address)
        self.encoder = MsgpackEncoder()
        self.so_decoder = MsgpackDecoder(SchedulerOutput)
        self.any_decoder = MsgpackDecoder()
        try:
            self.worker = self._build_worker(config)
        except BaseException as e:
            self._report_error(e)
            raise
        self._send(P.FromWorker.READY, spec.rank)

    def _build_worker(self, config: Any) -> Any:
        from vllm_lite.device_layout import tp_rank_device
        from vllm_lite.platform import cuda_device_count
        from vllm_lite.worker.gpu_worker import GPUWorker
        from vllm_lite.worker.parallel_state import default_backend, init_distributed

        spec = self.spec
        if spec.model_override:
            config.model_config.model = spec.model_override
            config.model_config.tokenizer = spec.model_override
        device = config.device_config.device
        if device.type == "cuda":
            # This engine's devices start at its own index (data parallel: cuda:(r*tp)), not at 0.
            device = tp_rank_device(device, spec.local_rank, cuda_device_count())
            config.device_config.device = device
            torch.cuda.set_device(device)  # before NCCL creates its communicator on the current device
        import torch.distributed as dist

        pg_store = dist.PrefixStore(self.P.STORE_PG_PREFIX, self.store)
        init_distributed(spec.world_size, spec.rank, pg_store, default_backend(device))
        return GPUWorker(config)

    # ------------------------------------------------------------------ messaging
    def _send(self, kind: Any, obj: Any) -> None:
        self.sock.send_multipart([self.P.type_frame(kind), *self.encoder.encode(obj)], copy=False)

    def _report_error(self, e: BaseException) -> None:
        text = f"tensor-parallel rank {self.spec.rank}: {type(e).__name__}: {e}"
        try:
            self.sock.send_multipart([self.P.type_frame(self.P.FromWorker.ERROR), text.encode()])
        except Exception:  # noqa: BLE001 -- the executor may be gone already
            pass

    def _alive(self) -> bool:
        """False when the store host (the engine) is gone (our parent's death ends us through the launcher)."""
        try:
            self.store.check([self.P.STORE_CONFIG_KEY])
        except Exception:  # noqa: BLE001 -- any store failure means the engine side is gone
            return False
        return True

    # ------------------------------------------------------------------ loop
    def serve(self) -> int:
        P = self.P
        driver = self.spec.rank == 0
        while True:
            if not self.sock.poll(int(_LIVENESS_INTERVAL_S * 1000)):
                if not self._alive():
                    logger.info("rank %d: the engine is gone; exiting.", self.spec.rank)
                    return 0
                continue
            frames = self.sock.recv_multipart(copy=False)
            kind = frames[0].bytes[0] if len(frames[0].bytes) == 1 else -1
            try:
                if kind == P.ToWorker.EXECUTE_MODEL:
                    out = self.worker.execute_model(self.so_decoder.decode(frames[1:]))
                    if driver:
                        self._send(P.FromWorker.RESULT, out)
                elif kind == P.ToWorker.DETERMINE_NUM_BLOCKS:
                    self._send(P.FromWorker.RESULT, list(self.worker.determine_num_blocks()))
                elif kind == P.ToWorker.INITIALIZE_CACHE:
                    num_gpu, num_cpu = self.any_decoder.decode(frames[1:])
                    self.worker.initialize_cache(int(num_gpu), int(num_cpu))
                    self._send(P.FromWorker.RESULT, None)
                elif kind == P.ToWorker.LORA:
                    method, args = self.any_decoder.decode(frames[1:])
                    try:  # a bad adapter is the caller's error, not this rank's: it answers and serves on
                        result = self.worker.lora_call(method, *args)
                        reply = {"result": sorted(result) if isinstance(result, set) else result}
                    except (ValueError, TypeError) as e:
                        reply = {"error": f"{type(e).__name__}: {e}"}
                    self._send(P.FromWorker.RESULT, reply)
                elif kind == P.ToWorker.SHUTDOWN:
                    return 0
                else:
                    raise ValueError(f"unknown message type {kind} from the executor")
            except BaseException as e:  # noqa: BLE001 -- a rank that cannot go on says why, then exits
                logger.error("rank %d step failed:\n%s", self.spec.rank, traceback.format_exc())
                self._report_error(e)
                self.sock.close(linger=2000)
                return 1


if __name__ == "__main__":
    run_child(RankSpec, run_rank)
