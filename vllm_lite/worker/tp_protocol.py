"""What the multiprocess executor and its tensor-parallel workers say to each other.

One ZMQ ROUTER socket on the executor; each rank connects a DEALER whose
identity is `rank_identity(rank, nonce)`: unpredictable (the executor draws the nonce and
publishes the identities only in the rendezvous store), so nobody else can speak as a rank. A message is `[type byte, *msgpack frames]`
(vllm_lite.serialization: typed msgspec, tensors as raw frames, never pickle).
Rendezvous and configuration go through torch.distributed's TCPStore, which
the executor hosts at master_addr:master_port.
"""

from __future__ import annotations

import enum
import secrets

# TCPStore keys the executor sets before any rank starts.
STORE_CONFIG_KEY = "vllm_lite/config"  # encode_vllm_config bytes
STORE_ADDRESS_KEY = "vllm_lite/executor_address"  # the ROUTER's zmq address
STORE_IDENTITIES_KEY = "vllm_lite/rank_identities"  # comma-separated, rank order
# torch.distributed's own keys live under this prefix, away from ours.
STORE_PG_PREFIX = "vllm_lite/tp"


class ToWorker(enum.IntEnum):
    EXECUTE_MODEL = 1  # SchedulerOutput; rank 0 replies RESULT
    DETERMINE_NUM_BLOCKS = 2  # no payload; every rank replies RESULT (num_gpu, num_cpu)
    INITIALIZE_CACHE = 3  # (num_gpu, num_cpu); every rank replies RESULT None
    SHUTDOWN = 4  # no payload; ranks exit
    LORA = 5  # [method, args]: a LoRA worker call (add_lora, ...); every rank replies RESULT {"result"|"error": ...}


class FromWorker(enum.IntEnum):
    READY = 1  # the rank built its model and joined the group
    RESULT = 2  # the reply to the last request
    ERROR = 3  # utf-8 text; the rank is about to exit


def rank_identity(rank: int, nonce: str = "") -> bytes:
    """``rank{r}-{nonce}``: a fresh random nonce per engine when not given."""
    return f"rank{rank}-{nonce or secrets.token_hex(16)}".encode()


def encode_identities(identities: list[bytes]) -> bytes:
    return b",".join(identities)


def decode_identities(data: bytes) -> list[bytes]:
    return data.split(b",")


def type_frame(kind: enum.IntEnum) -> bytes:
    return bytes((int(kind),))
