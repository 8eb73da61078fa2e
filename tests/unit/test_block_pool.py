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
