"""KV cache building blocks: the block object, its free list, and prefix-cache block hashing.

Block hashes are sha256 digests chained through the parent block's hash, so a
hit on block i implies the whole prefix up to block i matches. Python's
`hash()` is not used: it is salted per process and collides far too easily
for a cache shared by many requests and frontends.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Iterable, Optional, Sequence

import msgspec

if TYPE_CHECKING:
    from vllm_lite.core.request import Request

BlockHash = bytes

# Parent "hash" of a request's first block: a fixed seed, so equal prompts hash equally across processes.
ROOT_BLOCK_HASH: BlockHash = hashlib.sha256(b"vllm-lite prefix cache v1").digest()

_encoder = msgspec.msgpack.Encoder()


def hash_block_tokens(
    parent_hash: Optional[BlockHash], token_ids: Sequence[int], extra_keys: Optional[tuple] = None
) -> BlockHash:
    """sha256 over (parent hash, token ids, extra keys), msgpack-encoded so the encoding is unambiguous."""
    # msgpack writes a list and a tuple alike: no copies of a list or tuple (the same bytes, the same hash).
    if type(token_ids) is not list and type(token_ids) is not tuple:
        token_ids = list(token_ids)
    payload = _encoder.encode((parent_hash or ROOT_BLOCK_HASH, token_ids, extra_keys or ()))
    return hashlib.sha256(payload).digest()


def block_extra_keys(request: "Request", block_index: int) -> Optional[tuple]:
    """Keys besides tokens that make a block's KV unshareable: the salts, mixed into the first block only.

    The tenant salt (the core's, per frontend) and the request's own ``cache_salt`` sit in separate
    slots, so no choice of ``cache_salt`` reproduces another frontend's chain. The chain carries them
    to every later block, so two salts never share any block. A request past its model's rope switch
    point (Phi-3 LongRoPE's long factors) adds a regime key, so keys rotated with one set of factors are
    never reused by a request that needs the other. A request with a LoRA adapter adds its id (vLLM puts
    the lora id in every block's extra keys; the chain carries ours from the first), so adapters share no
    block with each other or with the base model.
    """
    if block_index != 0:
        return None
    keys: tuple = ()
    if request.tenant_salt is not None:
        keys += ("tenant", request.tenant_salt)
    if request.cache_salt is not None:
        keys += ("salt", request.cache_salt)
    if request.uses_long_rope:
        keys += ("rope", "long")
    if request.lora_request is not None:  # KV computed through an adapter is that adapter's alone
        keys += ("lora", request.lora_request.lora_int_id)
    return keys or None


def update_request_block_hashes(request: "Request", block_size: int) -> list[BlockHash]:
    """Extend `request.block_hashes` to cover every full block of its tokens; cheap when nothing is new."""
    hashes = request.block_hashes
    tokens = request.all_token_ids
    num_full = len(tokens) // block_size
    parent = hashes[-1] if hashes else None
    for i in range(len(hashes), num_full):
        parent = hash_block_tokens(parent, tokens[i * block_size : (i + 1) * block_size], block_extra_keys(request, i))
        hashes.append(parent)
    return hashes


class KVCacheBlock:
    """One KV cache block's bookkeeping; the data lives in the worker's cache tensors at `block_id`."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free_block", "next_free_block", "is_null")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # Set while the block is full and registered in the prefix cache.
        self.block_hash: Optional[BlockHash] = None
        # Links of the free list; both None while the block is not free.
        self.prev_free_block: Optional[KVCacheBlock] = None
        self.next_free_block: Optional[KVCacheBlock] = None
        self.is_null = False

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={h})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks in eviction order (head = evicted first).

    A cache hit on a free block must take it out of the middle of the list;
    the links make that O(1), which a deque cannot do.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        # Sentinels keep every real node's prev/next non-None, so no branch on the ends.
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free_block = self._tail
        self._tail.prev_free_block = self._head
        self.num_free_blocks = 0
        for b in blocks:
            self.append(b)

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> KVCacheBlock:
        first = self._head.next_free_block
        if first is self._tail or first is None:
            raise ValueError("no free blocks left to pop")
        self.remove(first)
        return first

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} free blocks, only {self.num_free_blocks} are free")
        if n == 1:  # a decode's new block
            return [self.popleft()]
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free list")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        if block.prev_free_block is not None or block.next_free_block is not None:
            raise ValueError(f"block {block.block_id} is already in the free list")
        last = self._tail.prev_free_block
        assert last is not None
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self._tail
        self._tail.prev_free_block = block
        self.num_free_blocks += 1

    def contains(self, block: KVCacheBlock) -> bool:
        return block.prev_free_block is not None

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Head to tail; for tests and debugging."""
        out = []
        node = self._head.next_free_block
        while node is not None and node is not self._tail:
            out.append(node)
            node = node.next_free_block
        return out


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
