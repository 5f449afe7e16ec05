"""Each sequence's blocks of the pool (``engine/core/block_pool.py``), as the planner grants them.

A sequence holds a row (its table's index) and the blocks that hold its positions, in order. Here: growing a
sequence's blocks (and failing to, when the pool is out of blocks), taking a cached prefix into a new sequence
(copying the one block it shares only in part), and hashing a sequence's blocks into the prefix cache as they
fill. ``engine/runtime/block_tables.py`` mirrors every grant into the tensor the attention kernels read.

Below the pool a ``LowerTier`` may keep full blocks where memory does not (``engine/runtime/kv_disk.py``: on disk,
across restarts): each block the prefix cache learns is offered to it, and a newcomer's prefix goes on from there
after the pool's own blocks end, each block read into a block of the pool.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from engine.core.block_pool import ROOT_HASH, BlockPool, NoFreeBlocks, block_hash, prefix_hashes


class LowerTier(Protocol):
    """Full blocks kept below the pool, by hash."""

    def pays(self) -> bool:
        """Whether reading a block from here is faster than prefilling it (else the pool's prefix is all)."""
        ...

    def has(self, digest: bytes) -> bool: ...

    def load(self, digest: bytes, block: int) -> bool:
        """Block ``digest``'s K/V into the pool's block ``block``; False if it is gone or unreadable."""
        ...

    def store(self, digest: bytes, block: int) -> None:
        """Keep a copy of the pool's block ``block``, full and hashed ``digest`` (off the caller's thread)."""
        ...

    def end_step(self) -> None:
        """The step's blocks are all offered (``store``): write them together."""
        ...


@dataclass(slots=True, eq=False)
class SeqBlocks:
    """One sequence's blocks: its row of the table tensor, its blocks in order, the hashes of its full ones."""

    row: int
    blocks: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)


class BlockLedger:
    """Which blocks each sequence holds; a subclass mirrors them where a kernel reads them (``_assign``)."""

    def __init__(
        self, pool: BlockPool, max_sequences: int, caching: bool = True, lower: LowerTier | None = None
    ) -> None:
        """``caching``: keep full blocks in the prefix cache after their sequence leaves, and reuse them;
        ``lower``: a tier below the pool that keeps them too (with ``caching`` only)."""
        self.pool = pool
        self.block_size = pool.block_size
        self.caching = caching
        self.lower = lower if caching else None
        self.max_sequences = max_sequences
        self._free_rows = list(range(max_sequences - 1, -1, -1))

    def _assign(self, row: int, index: int, block: int) -> None:
        """The ``index``-th block of the sequence in ``row`` is now ``block``."""

    def reset(self) -> None:
        """Forget every sequence and every cached block: a fresh pool of the same size, every row free."""
        self.pool = BlockPool(self.pool.num_blocks, self.block_size)
        self._free_rows = list(range(self.max_sequences - 1, -1, -1))

    def blocks_for(self, positions: int) -> int:
        return -(-positions // self.block_size)

    def open(self) -> SeqBlocks:
        return SeqBlocks(self._free_rows.pop())

    def close(self, seq: SeqBlocks) -> None:
        """The sequence leaves: its blocks go back to the pool (full ones stay cached) and its row is free."""
        self.clear(seq)
        self._free_rows.append(seq.row)

    def clear(self, seq: SeqBlocks) -> None:
        """Let go of the sequence's blocks but keep its row (it is preempted, and will fill it again)."""
        self.pool.release(seq.blocks)
        seq.blocks.clear()
        seq.hashes.clear()

    def grow(self, seq: SeqBlocks, positions: int) -> bool:
        """Add blocks until the sequence's hold ``positions`` positions. False when the pool ran out first (the
        blocks added so far are kept)."""
        while len(seq.blocks) * self.block_size < positions:
            try:
                block = self.pool.allocate()
            except NoFreeBlocks:
                return False
            self._assign(seq.row, len(seq.blocks), block)
            seq.blocks.append(block)
        return True

    def truncate(self, seq: SeqBlocks, positions: int) -> None:
        """Give back the blocks past the first ``positions`` positions (a rejected draft's; never hashed)."""
        keep = self.blocks_for(positions)
        if len(seq.blocks) > keep:
            assert len(seq.hashes) <= keep, "a hashed block is never past the computed positions"
            self.pool.release(seq.blocks[keep:])
            del seq.blocks[keep:]

    def take_prefix(
        self, seq: SeqBlocks, tokens: Sequence[int], limit: int, copy: Callable[[int, int], None],
        resume: Callable[[int, bytes], bool] | None = None,
    ) -> int:  # fmt: skip
        """Start the (empty) table with the longest cached prefix of ``tokens[:limit]``: whole cached blocks,
        then, where the next cached block shares only its first tokens, a copy of it (``copy(src, dst)``
        copies K/V between blocks). Returns the positions it holds. Counts ``len(tokens)`` tokens as queried.
        ``resume(row, hash)`` (a hybrid model's): puts the recurrent state at the end of the block of that hash into
        the sequence's row, if it was kept; the prefix then ends at the last block whose state was, whole blocks
        only."""
        assert not seq.blocks
        if not self.caching:
            return 0
        found = self.pool.match(tokens[:limit], queried=len(tokens))
        if self.lower is not None and self.lower.pays():
            found += self._from_lower(tokens[:limit], found)
        if resume is not None:  # (a hybrid's blocks read from disk: its states too, by ``resume``)
            found = self._resumable(seq.row, found, resume)
        for block in found:
            self._assign(seq.row, len(seq.blocks), block)
            seq.blocks.append(block)
        seq.hashes.extend(self.pool.hash_of(block) or b"" for block in found)
        held = len(found) * self.block_size
        if resume is not None:  # no state in the middle of a block
            return held
        partial = self.pool.match_partial(seq.hashes[-1] if seq.hashes else ROOT_HASH, tokens[held:limit])
        if partial is not None:
            source, shared = partial
            if self.grow(seq, held + 1):
                copy(source, seq.blocks[-1])
                held += shared
                self.pool.hit_tokens += shared
            self.pool.release([source])
        return held

    def _resumable(self, row: int, found: list[int], resume: Callable[[int, bytes], bool]) -> list[int]:
        """The longest start of ``found`` whose last block's state ``resume`` puts into ``row``; the rest let go."""
        keep = len(found)
        while keep and not resume(row, self.pool.hash_of(found[keep - 1]) or b""):
            keep -= 1
        self.pool.release(found[keep:])
        self.pool.hit_tokens -= (len(found) - keep) * self.block_size
        return found[:keep]

    def _from_lower(self, tokens: Sequence[int], found: list[int]) -> list[int]:
        """The blocks of ``tokens`` after the pool's ``found`` that the lower tier holds, one after another, each
        read into a block of the pool (hashed there, referenced once); as many as the pool has room for."""
        assert self.lower is not None
        size, loaded = self.block_size, []
        hashes = prefix_hashes(tokens, size)
        for index in range(len(found), len(hashes)):
            digest = hashes[index]
            if not self.lower.has(digest):
                break
            try:
                block = self.pool.allocate()
            except NoFreeBlocks:
                break
            if not self.lower.load(digest, block):
                self.pool.release([block])
                break
            parent = hashes[index - 1] if index else ROOT_HASH
            self.pool.commit(block, digest, parent, tokens[index * size : (index + 1) * size])
            loaded.append(block)
        self.pool.hit_tokens += len(loaded) * size
        return loaded

    def commit_full(self, seq: SeqBlocks, computed: int, token_at: Callable[[int], int]) -> None:
        """Hash the blocks that the first ``computed`` positions fill, into the prefix cache."""
        if not self.caching:
            return
        size = self.block_size
        while (len(seq.hashes) + 1) * size <= computed:
            index = len(seq.hashes)
            parent = seq.hashes[-1] if seq.hashes else ROOT_HASH
            tokens = [token_at(p) for p in range(index * size, (index + 1) * size)]
            digest = block_hash(parent, tokens)
            kept = self.pool.commit(seq.blocks[index], digest, parent, tokens) == seq.blocks[index]
            if kept and self.lower is not None:  # a block the pool did not know yet
                self.lower.store(digest, seq.blocks[index])
            seq.hashes.append(digest)

    def slot(self, seq: SeqBlocks, position: int) -> int:
        """The physical position of the sequence's position ``position``."""
        return seq.blocks[position // self.block_size] * self.block_size + position % self.block_size

    def slots(self, seq: SeqBlocks, start: int, end: int) -> list[int]:
        """The physical positions of the sequence's positions ``start..end-1``."""
        return [self.slot(seq, position) for position in range(start, end)]
