"""KV memory as a pool of fixed-size blocks: allocation, reference counts, block hashes and the prefix cache.
Torch-free bookkeeping; the tensors the block ids index live with the engine.

A block holds the K/V of ``block_size`` consecutive positions of one sequence. Each block is in exactly one
state: *free* (holds nothing), *in use* (referenced by one or more sequences' block tables), or *cached* (no
sequence references it, but it holds a full block of a prompt or answer that a newcomer may reuse). A full
block is known by a hash chained over its tokens and its parent block's hash, so equal hashes mean equal
prefixes. Cached blocks are evicted least recently used first, only when a block is needed and none is free.

This is the first part of block-based KV memory (issue #15); the engine does not use it yet.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

#: The hash of the (absent) parent of a sequence's first block.
ROOT_HASH = b""


class NoFreeBlocks(RuntimeError):
    """Every block is in use: the caller must wait, or preempt a sequence."""


def block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The identity of a full block: its tokens after everything its parent's hash stands for. The same in every
    process (not Python's salted ``hash``), so replicas can route by it."""
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(b"".join(token.to_bytes(4, "little") for token in tokens))
    return digest.digest()


def prefix_hashes(tokens: Sequence[int], block_size: int) -> list[bytes]:
    """The chained hashes of every full block of ``tokens``."""
    hashes, parent = [], ROOT_HASH
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = block_hash(parent, tokens[start : start + block_size])
        hashes.append(parent)
    return hashes


@dataclass(slots=True)
class BlockPool:
    num_blocks: int
    block_size: int
    _free: list[int] = field(default_factory=list)
    _refs: list[int] = field(default_factory=list)
    _hash_of: dict[int, bytes] = field(default_factory=dict)  # full blocks that carry their hash
    _by_hash: dict[bytes, int] = field(default_factory=dict)  # the block that answers for each hash
    _evictable: OrderedDict[int, None] = field(default_factory=OrderedDict)  # cached, least recent first
    #: Prefix-cache accounting, in tokens (as vLLM's prefix_cache_queries / prefix_cache_hits).
    queried_tokens: int = 0
    hit_tokens: int = 0

    def __post_init__(self) -> None:
        if self.num_blocks < 1 or self.block_size < 1:
            raise ValueError("a pool needs at least one block of at least one position")
        self._free = list(range(self.num_blocks - 1, -1, -1))  # pop() hands out block 0 first
        self._refs = [0] * self.num_blocks

    # -- counts -----------------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._evictable)

    @property
    def num_in_use(self) -> int:
        return self.num_blocks - self.num_free - self.num_cached

    @property
    def num_available(self) -> int:
        """Blocks an allocation may take: free ones, and cached ones it would evict."""
        return self.num_free + self.num_cached

    # -- allocation ------------------------------------------------------------------------------------

    def allocate(self) -> int:
        """A block for new K/V, referenced once. Takes a free block, else evicts the least recently used cached
        one (its hash is forgotten); raises NoFreeBlocks when every block is in use."""
        if self._free:
            block = self._free.pop()
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            self._forget(block)
        else:
            raise NoFreeBlocks(f"all {self.num_blocks} KV blocks are in use")
        self._refs[block] = 1
        return block

    def release(self, blocks: Sequence[int]) -> None:
        """A sequence lets go of ``blocks`` (its block table, in order). A block nobody references any more stays
        cached if it carries a hash, else it is free. Released last-to-first so that, of one sequence, the blocks
        furthest from its start are evicted first."""
        for block in reversed(blocks):
            if self._refs[block] < 1:
                raise ValueError(f"block {block} is not in use")
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._hash_of:
                    self._evictable[block] = None
                else:
                    self._free.append(block)

    def commit(self, block: int, digest: bytes) -> int:
        """Mark ``block`` (in use, now full) as holding the block whose hash is ``digest``, so that it may be
        reused. Returns the block that answers for ``digest``: ``block``, or one that already did (then
        ``block`` stays a private copy, and is freed, not cached, when released)."""
        if self._refs[block] < 1:
            raise ValueError(f"block {block} is not in use")
        existing = self._by_hash.get(digest)
        if existing is not None:
            return existing
        self._hash_of[block] = digest
        self._by_hash[digest] = block
        return block

    # -- the prefix cache ------------------------------------------------------------------------------

    def match(self, tokens: Sequence[int]) -> list[int]:
        """The longest run of cached blocks that holds a prefix of ``tokens``, each referenced once more (the
        caller's block table starts with them). Counts the query and the hit."""
        hashes = prefix_hashes(tokens, self.block_size)
        found: list[int] = []
        for digest in hashes:
            block = self._by_hash.get(digest)
            if block is None:
                break
            found.append(block)
        for block in found:
            if self._refs[block] == 0:
                del self._evictable[block]
            self._refs[block] += 1
        self.queried_tokens += len(tokens)
        self.hit_tokens += len(found) * self.block_size
        return found

    def refs(self, block: int) -> int:
        return self._refs[block]

    def hash_of(self, block: int) -> bytes | None:
        return self._hash_of.get(block)

    def _forget(self, block: int) -> None:
        digest = self._hash_of.pop(block)
        if self._by_hash.get(digest) == block:
            del self._by_hash[digest]
