import pytest

from pagedmoe.kvcache.block_pool import BlockPool, KVCacheManager


def test_allocate_and_free_roundtrip():
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert len(set(a)) == 3 and pool.num_free_blocks == 1
    assert not pool.can_allocate(2)
    with pytest.raises(MemoryError):
        pool.allocate(2)
    pool.free(a)
    assert pool.num_free_blocks == 4 and pool.usage() == 0.0


def test_double_free_is_an_error():
    pool = BlockPool(2)
    b = pool.allocate(1)
    pool.free(b)
    with pytest.raises(RuntimeError, match="double free"):
        pool.free(b)


def test_manager_grows_tables_by_blocks():
    kv = KVCacheManager(num_blocks=5, block_size=4)
    assert kv.allocate("a", 1)
    assert len(kv.block_table("a")) == 1
    assert kv.allocate("a", 4)       # still one block
    assert len(kv.block_table("a")) == 1
    assert kv.allocate("a", 5)       # second block
    assert len(kv.block_table("a")) == 2
    t = kv.block_table("a")
    assert kv.slot("a", 5) == t[1] * 4 + 1


def test_manager_refuses_without_partial_allocation():
    kv = KVCacheManager(num_blocks=3, block_size=2)
    assert kv.allocate("a", 4)
    free_before = kv.num_free_blocks
    assert not kv.allocate("b", 4)   # needs 2, 1 free
    assert kv.num_free_blocks == free_before and kv.block_table("b") == []
    kv.free("a")
    assert kv.num_free_blocks == 3
    kv.free("a")  # freeing an unknown request is a no-op
    assert kv.num_free_blocks == 3


def test_distinct_requests_never_share_blocks():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    for i in range(4):
        assert kv.allocate(str(i), 13)
    tables = [set(kv.block_table(str(i))) for i in range(4)]
    assert all(len(t) == 4 for t in tables)
    assert len(set().union(*tables)) == 16


def test_lowest_free_block_first():
    pool = BlockPool(6)
    assert pool.allocate(3) == [0, 1, 2]
    pool.free([1])
    assert pool.allocate(2) == [1, 3]


def test_withholding_takes_the_free_tail_and_release_gives_back_its_lowest_blocks():
    pool = BlockPool(8)
    pool.withhold(3)                                  # blocks 5, 6, 7
    assert pool.top == 5 and pool.num_free_blocks == 5 and pool.num_withheld_blocks == 3
    assert pool.allocate(5) == [0, 1, 2, 3, 4]        # never a withheld block
    assert not pool.can_allocate(1) and not pool.can_withhold(1)   # block 4 is in use
    with pytest.raises(MemoryError, match="not all free"):
        pool.withhold(1)
    pool.free([4])
    assert pool.can_withhold(1) and not pool.can_withhold(2)       # 3 is still in use
    pool.release(2)                                   # 5 and 6 come back, 7 stays lent
    assert pool.top == 7 and pool.num_free_blocks == 3
    assert pool.allocate(3) == [4, 5, 6]
    with pytest.raises(ValueError):
        pool.release(2)


def test_withhold_release_cycles_keep_the_free_heap_bounded():
    pool = BlockPool(32)
    held = pool.allocate(4)
    for _ in range(100):
        pool.withhold(20)
        pool.release(20)
    assert len(pool._heap) <= 32
    pool.free(held)
    assert sorted(pool.allocate(32)) == list(range(32))


class FakeBacking:
    """Stands in for LendableKVCache: memory in chunks of 4 blocks; `room` chunks can be mapped again."""

    def __init__(self, num_blocks, room=10**9):
        self.mapped, self.room, self.calls = -(-num_blocks // 4), room, []

    def set_top(self, top):
        self.calls.append(top)
        want = -(-top // 4)
        while self.mapped < want and self.room > 0:
            self.mapped, self.room = self.mapped + 1, self.room - 1
        self.mapped = min(self.mapped, want)
        return min(top, self.mapped * 4)


def test_manager_lends_the_tail_through_its_backing_and_releases_what_maps_again():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    kv.backing = FakeBacking(16, room=1)
    kv.withhold(10)                                   # blocks 6..15: chunks 2 and 3 unmapped
    assert kv.backing.mapped == 2 and kv.backing.calls == [6]
    # blocks 6 and 7 share chunk 1 with free blocks, so it stayed mapped; room for chunk 2 only
    assert kv.release(9) == 6 and kv.pool.top == 12 and kv.num_free_blocks == 12
    kv.backing.room = 5
    assert kv.release(3) == 3 and kv.pool.top == 15   # chunk 3 maps; block 15 stays withheld
    assert kv.backing.mapped == 4
