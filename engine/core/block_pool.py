"""KV memory as a pool of fixed-size blocks: allocation, reference counts, block hashes and the prefix cache.
Torch-free bookkeeping; the tensors the block ids index live with the engine.

A block holds the K/V of ``block_size`` consecutive positions of one sequence. Each block is in exactly one
state: *free* (holds nothing), *in use* (referenced by one or more sequences' block tables), or *cached* (no
sequence references it, but it holds a full block of a prompt or answer that a newcomer may reuse). A full
block is known by a hash chained over its tokens and its parent block's hash, so equal hashes mean equal
prefixes. Cached blocks are evicted least recently used first, only when a block is needed and none is free.

A newcomer takes the longest run of cached blocks that holds a prefix of its tokens (``match``), and, where the
next cached block shares only its first tokens with it, that block to copy those from (``match_partial``): the
engine copies it into a block of its own before writing, so a block two sequences share is never written.
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
    _tokens_of: dict[int, tuple[bytes, tuple[int, ...]]] = field(default_factory=dict)  # parent hash, tokens
    _children: dict[bytes, set[int]] = field(default_factory=dict)  # hashed blocks by their parent's hash
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

    def commit(self, block: int, digest: bytes, parent: bytes = ROOT_HASH, tokens: Sequence[int] = ()) -> int:
        """Mark ``block`` (in use, now full) as holding the block whose hash is ``digest`` (its ``tokens`` after
        ``parent``), so that it may be reused. Returns the block that answers for ``digest``: ``block``, or one
        that already did (then ``block`` stays a private copy, and is freed, not cached, when released)."""
        if self._refs[block] < 1:
            raise ValueError(f"block {block} is not in use")
        existing = self._by_hash.get(digest)
        if existing is not None:
            return existing
        self._hash_of[block] = digest
        self._by_hash[digest] = block
        if tokens:
            self._tokens_of[block] = (parent, tuple(tokens))
            self._children.setdefault(parent, set()).add(block)
        return block

    # -- the prefix cache ------------------------------------------------------------------------------

    def match(self, tokens: Sequence[int], queried: int | None = None) -> list[int]:
        """The longest run of cached blocks that holds a prefix of ``tokens``, each referenced once more (the
        caller's block table starts with them). Counts the query (``queried`` tokens, default all of
        ``tokens``) and the hit."""
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
        self.queried_tokens += len(tokens) if queried is None else queried
        self.hit_tokens += len(found) * self.block_size
        return found

    def match_partial(self, parent: bytes, tokens: Sequence[int]) -> tuple[int, int] | None:
        """Of the cached blocks that follow ``parent``, the one whose tokens share the longest start with
        ``tokens`` (fewer than a block), referenced once more for the caller to copy from and then release, with
        the number of tokens shared; None when none shares any. The caller counts the hit if it takes it."""
        best: tuple[int, int] | None = None
        for block in self._children.get(parent, ()):
            shared = _shared_start(self._tokens_of[block][1], tokens)
            if shared and (best is None or shared > best[1]):
                best = (block, shared)
        if best is not None:
            block = best[0]
            if self._refs[block] == 0:
                del self._evictable[block]
            self._refs[block] += 1
        return best

    def refs(self, block: int) -> int:
        return self._refs[block]

    def hash_of(self, block: int) -> bytes | None:
        return self._hash_of.get(block)

    def _forget(self, block: int) -> None:
        digest = self._hash_of.pop(block)
        if self._by_hash.get(digest) == block:
            del self._by_hash[digest]
        known = self._tokens_of.pop(block, None)
        if known is not None:
            siblings = self._children[known[0]]
            siblings.discard(block)
            if not siblings:
                del self._children[known[0]]


def _shared_start(a: Sequence[int], b: Sequence[int]) -> int:
    """How many tokens ``a`` and ``b`` share from their start."""
    shared = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        shared += 1
    return shared
