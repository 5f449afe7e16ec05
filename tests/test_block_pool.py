"""The KV block pool's bookkeeping: every block in exactly one state whatever sequences come and go, prefixes
found again after their sequence left, least recently used cached blocks evicted first, and no block handed
out twice."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.core.block_pool import BlockPool, NoFreeBlocks, block_hash, prefix_hashes

SIZE = 4


def admit(pool: BlockPool, tokens: list[int]) -> list[int]:
    """What an engine will do for a newcomer: reuse the cached prefix, allocate the rest, commit full blocks."""
    table = pool.match(tokens)
    hashes = prefix_hashes(tokens, SIZE)
    try:
        for index in range(len(table), -(-len(tokens) // SIZE)):
            block = pool.allocate()
            table.append(block)
            if index < len(hashes):
                pool.commit(block, hashes[index])
    except NoFreeBlocks:
        pool.release(table)
        raise
    return table


def test_a_prefix_is_found_again_after_its_sequence_leaves() -> None:
    pool = BlockPool(num_blocks=8, block_size=SIZE)
    first = admit(pool, list(range(10)))  # two full blocks and a partial one
    pool.release(first)
    assert (pool.num_cached, pool.num_free) == (2, 6)  # the partial block holds nothing reusable
    second = admit(pool, [*range(8), 99, 98, 97, 96, 95])
    assert second[:2] == first[:2] and pool.hit_tokens == 8 and pool.queried_tokens == 23
    assert pool.refs(first[0]) == 1 and pool.num_cached == 0


def test_a_shared_prefix_is_referenced_by_every_holder_and_never_freed_under_one() -> None:
    pool = BlockPool(num_blocks=8, block_size=SIZE)
    a = admit(pool, list(range(8)))
    b = admit(pool, [*range(8), 1])
    assert b[:2] == a and pool.refs(a[0]) == 2
    pool.release(a)
    assert pool.refs(a[0]) == 1 and pool.num_cached == 0
    assert pool.allocate() not in b  # what b holds is not handed out


def test_eviction_takes_the_least_recently_used_cached_block_first() -> None:
    pool = BlockPool(num_blocks=3, block_size=SIZE)
    old, new = admit(pool, [1] * SIZE), admit(pool, [2] * SIZE)
    pool.release(old)
    pool.release(new)
    pool.allocate()  # the free block
    assert pool.allocate() == old[0]  # then the least recently released
    assert pool.match([2] * SIZE) == new and pool.match([1] * SIZE) == []  # old's hash is forgotten
    with pytest.raises(NoFreeBlocks):
        pool.allocate()


def test_a_block_shared_only_in_part_is_found_to_copy_from_and_forgotten_when_evicted() -> None:
    pool = BlockPool(num_blocks=3, block_size=SIZE)
    hashes = prefix_hashes([1, 2, 3, 4, 5, 6, 7, 8], SIZE)
    first, second = pool.allocate(), pool.allocate()
    pool.commit(first, hashes[0], tokens=[1, 2, 3, 4])
    pool.commit(second, hashes[1], hashes[0], [5, 6, 7, 8])
    pool.release([first, second])
    assert pool.match_partial(hashes[0], [5, 6, 9]) == (second, 2)  # shares 5, 6 with the cached block
    assert pool.refs(second) == 1 and pool.num_cached == 1  # held while it is copied
    assert pool.match_partial(hashes[0], [9]) is None and pool.match_partial(hashes[1], [5]) is None
    pool.release([second])
    for _ in range(3):
        pool.allocate()  # evicts both cached blocks
    assert pool.match_partial(hashes[0], [5, 6]) is None and pool.match_partial(b"", [1]) is None


def test_hashes_chain_over_the_whole_prefix() -> None:
    assert block_hash(b"", [1, 2]) == block_hash(b"", [1, 2]) != block_hash(b"", [2, 1])
    one, two = prefix_hashes([1, 2, 3, 4, 5], 2), prefix_hashes([9, 9, 3, 4], 2)
    assert len(one) == 2 and one[1] != two[1]  # the same second block after another first block


class PoolMachine(RuleBasedStateMachine):
    """Sequences of a small alphabet (so prefixes are shared and cached) come and go at random."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(num_blocks=12, block_size=SIZE)
        self.tables: list[list[int]] = []

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=18))
    def arrive(self, tokens: list[int]) -> None:
        before = (self.pool.num_free, self.pool.num_cached, self.pool.num_in_use)
        try:
            self.tables.append(admit(self.pool, tokens))
        except NoFreeBlocks:
            assert self.pool.num_in_use == before[2]  # a refused newcomer leaves nothing behind

    @precondition(lambda self: self.tables)
    @rule(which=st.integers(0, 100))
    def leave(self, which: int) -> None:
        self.pool.release(self.tables.pop(which % len(self.tables)))

    @invariant()
    def every_block_is_in_one_state(self) -> None:
        pool = self.pool
        held = [block for table in self.tables for block in table]
        for block in range(pool.num_blocks):
            assert pool.refs(block) == held.count(block)
        assert pool.num_in_use == len(set(held))
        assert pool.num_free + pool.num_cached + pool.num_in_use == pool.num_blocks

    @invariant()
    def a_private_block_is_in_one_table(self) -> None:
        for block in range(self.pool.num_blocks):
            if self.pool.hash_of(block) is None:
                assert self.pool.refs(block) <= 1


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
