"""`vllm-lite worker`: run this node's tensor-parallel ranks for an engine on node 0.

    node 0:  vllm-lite serve MODEL -tp 4 --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 \
               --auth-token T
    node 1:  vllm-lite worker --nnodes 2 --node-rank 1 --master-addr 10.0.0.1 --master-port 29500 --auth-token T

Both sides need the same token (or $VLLM_LITE_AUTH_TOKEN): node 0's rendezvous admits only
peers that prove it, and this node's ranks reach it through a loopback tunnel that does.

The worker needs no model flags: it reads the engine's configuration from the
rendezvous store on node 0 (the checkpoint must be at the same path on every
node, or pass --model with this node's path). It may start before or after
node 0; it exits when the engine goes away.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Optional

from vllm_lite import envs
from vllm_lite.entrypoints.cli.types import CLISubcommand

# The engine flags a worker node takes (the rest come from node 0's engine).
WORKER_ENGINE_FIELDS = ("tensor_parallel_size", "nnodes", "node_rank", "master_addr", "master_port")


class WorkerCommand(CLISubcommand):
    name = "worker"
    help = "Run this node's tensor-parallel ranks for a multi-node engine (started on node 0)."

    def add_parser(self, subparsers: "argparse._SubParsersAction") -> argparse.ArgumentParser:
        p = subparsers.add_parser(
            self.name,
            help=self.help,
            description=self.help,
            epilog="example: vllm-lite worker --nnodes 2 --node-rank 1 --master-addr 10.0.0.1 --master-port 29500",
        )
        from vllm_lite.engine_args import EngineArgs

        EngineArgs.add_cli_args(p, only=WORKER_ENGINE_FIELDS)
        # A worker node takes the engine's sizes from node 0: -tp is only checked, and node 0 is the engine's.
        p.set_defaults(tensor_parallel_size=None, node_rank=1, master_port=None)
        p.add_argument(
            "--model",
            "-m",
            default=None,
            help="This node's path to the engine's checkpoint (default: the engine's path).",
        )
        p.add_argument(
            "--auth-token",
            default=envs.VLLM_LITE_AUTH_TOKEN,
            help="The engine's auth token, proven to node 0's rendezvous (default: $VLLM_LITE_AUTH_TOKEN).",
        )
        p.add_argument(
            "--connect-timeout", type=float, default=300.0, help="Seconds to wait for node 0's rendezvous store."
        )
        return p

    def run(self, args: argparse.Namespace) -> int:
        return run_worker_node(args)


def run_worker_node(args: argparse.Namespace) -> int:
    """Start one process per local rank, wait for them; exit code 0 if all ended cleanly."""
    import datetime

    import torch.distributed as dist

    from vllm_lite.config import decode_vllm_config
    from vllm_lite.worker import tp_protocol as P
    from vllm_lite.worker.rendezvous_gate import RendezvousTunnel

    if args.master_port is None or not 0 < args.master_port < 65536:
        raise ValueError(f"--master-port must be node 0's rendezvous port (1..65535), got {args.master_port!r}.")
    if args.nnodes < 2:
        raise ValueError(f"--nnodes must be at least 2 for a worker node, got {args.nnodes}.")
    if not 0 < args.node_rank < args.nnodes:
        raise ValueError(
            f"--node-rank must be in [1, {args.nnodes}) for a worker node (0 runs the engine), got {args.node_rank}."
        )
    if args.connect_timeout <= 0:
        raise ValueError(f"--connect-timeout must be positive, got {args.connect_timeout}.")
    # This node's ranks (and this process) reach node 0's store through a token-proving tunnel.
    tunnel = RendezvousTunnel(args.master_addr, args.master_port, args.auth_token, args.connect_timeout)
    try:
        tunnel.open_upstream().close()  # fail fast and clearly on a wrong token
        store = dist.TCPStore(
            "127.0.0.1", tunnel.port, is_master=False, timeout=datetime.timedelta(seconds=args.connect_timeout)
        )
        store.wait([P.STORE_CONFIG_KEY])
        config = decode_vllm_config(store.get(P.STORE_CONFIG_KEY))
        del store
        return _run_ranks(args, config, tunnel.port)
    finally:
        tunnel.close()


def _run_ranks(args: argparse.Namespace, config: Any, store_port: int) -> int:
    """Start this node's ranks (their store: ``127.0.0.1:store_port``, the tunnel) and wait for them."""
    import signal

    from vllm_lite import launcher
    from vllm_lite.worker.tp_worker_proc import TP_RANK_MODULE, RankReady, RankSpec, worker_threads

    pc = config.parallel_config
    if pc.nnodes != args.nnodes:
        raise ValueError(f"--nnodes={args.nnodes} but the engine on node 0 was started with nnodes={pc.nnodes}.")
    if args.tensor_parallel_size is not None and args.tensor_parallel_size != pc.tensor_parallel_size:
        raise ValueError(
            f"--tensor-parallel-size={args.tensor_parallel_size} but the engine on node 0 uses "
            f"tensor_parallel_size={pc.tensor_parallel_size}."
        )
    per_node = pc.ranks_per_node
    first = args.node_rank * per_node
    print(
        f"vllm-lite worker: node {args.node_rank}/{pc.nnodes} runs ranks {first}..{first + per_node - 1} "
        f"of {pc.tensor_parallel_size}",
        file=sys.stderr,
        flush=True,
    )
    threads = config.device_config.num_threads or worker_threads(per_node)
    procs: list[launcher.ChildProcess] = []

    def stop(signum: int, frame: Optional[object]) -> None:
        for p in procs:
            p.terminate()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        for local in range(per_node):
            spec = RankSpec(
                rank=first + local,
                local_rank=local,
                world_size=pc.tensor_parallel_size,
                master_addr="127.0.0.1",
                master_port=store_port,
                num_threads=threads,
                model_override=args.model,
                connect_timeout_s=args.connect_timeout,
            )
            procs.append(launcher.start_child(TP_RANK_MODULE, spec, RankReady, name=f"tp-rank-{first + local}"))
        codes = [p.wait() for p in procs]
    finally:
        launcher.stop_all(procs)
    return 0 if all(c == 0 for c in codes) else 1
