"""The tensor-parallel rendezvous admits no one without the token: the TCPStore listens on loopback
only, other nodes reach it through a gate that demands proof of the engine's auth token, and ranks'
ZMQ identities are unpredictable. No model, no ranks: sockets and a TCPStore only, fast."""

from __future__ import annotations

import datetime
import socket
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from vllm_lite.config import ParallelConfig
from vllm_lite.worker import tp_protocol as P
from vllm_lite.worker.multiproc_executor import MultiprocExecutor
from vllm_lite.worker.rendezvous_gate import NONCE_LEN, RendezvousGate, RendezvousTunnel

TOKEN = "rendezvous-test-token"


@pytest.fixture
def gated_store() -> Iterator[tuple[dist.TCPStore, RendezvousGate]]:
    """Node 0's arrangement: a store on loopback and a gate in front of it."""
    store_sock = socket.create_server(("127.0.0.1", 0))
    store = dist.TCPStore(
        "127.0.0.1",
        store_sock.getsockname()[1],
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=10),
        master_listen_fd=store_sock.fileno(),
    )
    store.set(P.STORE_CONFIG_KEY, b"the engine's config")
    gate = RendezvousGate(socket.create_server(("127.0.0.1", 0)), store.port, TOKEN)
    yield store, gate
    gate.close()
    del store
    store_sock.close()


def test_a_node_with_the_token_reads_the_store_through_its_tunnel(gated_store):
    _, gate = gated_store
    tunnel = RendezvousTunnel("127.0.0.1", gate.port, TOKEN, connect_timeout_s=10)
    try:
        client = dist.TCPStore("127.0.0.1", tunnel.port, is_master=False, timeout=datetime.timedelta(seconds=10))
        assert client.get(P.STORE_CONFIG_KEY) == b"the engine's config"
    finally:
        tunnel.close()


def test_a_wrong_token_is_refused_with_a_clear_error(gated_store):
    _, gate = gated_store
    tunnel = RendezvousTunnel("127.0.0.1", gate.port, "not-the-token", connect_timeout_s=10)
    try:
        with pytest.raises(PermissionError, match="wrong auth token"):
            tunnel.open_upstream()
    finally:
        tunnel.close()


def test_a_peer_that_skips_the_handshake_never_reaches_the_store(gated_store):
    _, gate = gated_store
    with socket.create_connection(("127.0.0.1", gate.port), timeout=10) as raw:
        assert len(raw.recv(NONCE_LEN)) == NONCE_LEN  # the challenge
        raw.sendall(b"\x00" * 64)  # bytes of a TCPStore request instead of a proof
        raw.settimeout(10)
        try:
            answer = raw.recv(1)
        except ConnectionResetError:  # closed with our extra bytes unread
            answer = b""
        assert answer == b""  # hung up: nothing was relayed


def test_a_worker_node_without_a_token_is_refused_before_connecting():
    with pytest.raises(ValueError, match="needs the engine's auth token"):
        RendezvousTunnel("127.0.0.1", 1, None, connect_timeout_s=1)


def test_the_store_of_a_single_node_engine_listens_on_loopback_only():
    pc = ParallelConfig(tensor_parallel_size=2, master_addr="0.0.0.0")
    listener = MultiprocExecutor._rendezvous_listener(pc)
    try:
        assert listener.getsockname()[0] == "127.0.0.1"
    finally:
        listener.close()


def test_rank_identities_are_unpredictable():
    ids = [P.rank_identity(0) for _ in range(3)]
    assert len(set(ids)) == 3 and all(i.startswith(b"rank0-") and len(i) > 20 for i in ids)
    assert P.decode_identities(P.encode_identities(ids)) == ids
