"""Tensor-parallel / multi-node flags, shared by `serve`, `generate`, `chat` and `worker`."""

from __future__ import annotations

import argparse
from typing import Any


def add_parallel_args(parser: argparse.ArgumentParser, worker: bool = False) -> None:
    """--tensor-parallel-size, --nnodes, --node-rank, --master-addr, --master-port (vLLM/torchrun names)."""
    g = parser.add_argument_group("parallelism")
    g.add_argument(
        "--tensor-parallel-size", "-tp", type=int, default=None if worker else 1,
        help="Ranks the model is split over (one process each)"
        + (" (optional here: checked against the engine's)." if worker else "."),
    )
    g.add_argument("--nnodes", type=int, default=1, help="Machines the ranks are spread over (evenly).")
    g.add_argument(
        "--node-rank", type=int, default=1 if worker else 0,
        help="This machine's index: 0 runs the engine, 1..nnodes-1 run `vllm-lite worker`.",
    )
    g.add_argument("--master-addr", default="127.0.0.1", help="Node 0's address, reachable from every node.")
    g.add_argument(
        "--master-port", type=int, default=None if worker else 0,
        help="torch.distributed rendezvous (TCPStore) port on node 0" + ("." if worker else " (0: pick a free one; "
                                                                           "set it when --nnodes > 1)."),
    )


def parallel_kwargs_from(args: argparse.Namespace) -> dict[str, Any]:
    """EngineArgs keyword arguments for the parallel flags (validated by EngineArgs.create_engine_config)."""
    return {
        "tensor_parallel_size": args.tensor_parallel_size,
        "nnodes": args.nnodes,
        "node_rank": args.node_rank,
        "master_addr": args.master_addr,
        "master_port": args.master_port,
    }
