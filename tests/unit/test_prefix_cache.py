"""Automatic prefix caching in the block pool and the scheduler, on fake requests (no model)."""
import random

import pytest

from pagedmoe.engine.request import Request, RequestStatus
from pagedmoe.engine.scheduler import Scheduler
from pagedmoe.kvcache.block_pool import BlockPool, KVCacheManager
from pagedmoe.kvcache.prefix_cache import hash_block
from pagedmoe.sampling_params import SamplingParams


def _req(rid, tokens, max_tokens=4):
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens), max_tokens=max_tokens)


def _step(sched, token=7):
    out = sched.schedule()
    sched.update(out.scheduled)
    for s in out.scheduled:
        if s.samples:
            s.request.output_token_ids.append(token)
            if len(s.request.output_token_ids) >= s.request.max_tokens:
                sched.finish_request(s.request, RequestStatus.FINISHED_LENGTH)
    sched.kv.pool.check_invariants()
    return out


def _drain(sched):
    while sched.has_unfinished():
        _step(sched)


def test_hash_chains_the_prefix():
    a = hash_block(b"", [1, 2, 3, 4])
    assert hash_block(b"", [1, 2, 3, 4]) == a and hash_block(b"", [1, 2, 3, 5]) != a
    assert hash_block(a, [5, 6]) != hash_block(hash_block(b"", [9, 9, 9, 9]), [5, 6])


def test_pool_refcounts_lru_and_eviction():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    assert pool.cache(a, b"A") and pool.cache(b, b"B")
    assert not pool.cache(b, b"A")          # another block already holds these tokens
    pool.touch(a)                           # a second request shares a
    pool.free([a, b])
    assert pool.num_free_blocks == 3 and pool.lookup(b"A") == a and pool.is_evictable(b)
    pool.free([a])
    assert pool.num_free_blocks == 4 and pool.num_cached_blocks == 2
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([a])
    # the two empty blocks go first, then the least recently freed cached block (b), then a
    got = pool.allocate(3)
    assert b in got and a not in got and pool.lookup(b"B") is None and pool.lookup(b"A") == a
    pool.check_invariants()
    assert pool.allocate(1) == [a] and pool.lookup(b"A") is None
    pool.check_invariants()


def test_reset_forgets_cached_blocks():
    kv = KVCacheManager(8, 4, enable_prefix_caching=True)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    sched.add_request(_req("a", range(1, 14), max_tokens=1))
    _drain(sched)
    assert kv.pool.num_cached_blocks == 3
    kv.reset_prefix_cache()
    kv.pool.check_invariants()
    sched.add_request(_req("b", range(1, 14), max_tokens=1))
    assert _step(sched).scheduled[0].num_computed_tokens == 0


def test_withholding_drops_cached_contents():
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    pool.cache(blocks[3], b"X")
    pool.free(blocks)
    assert pool.can_withhold(2)
    pool.withhold(2)
    assert pool.lookup(b"X") is None and pool.num_free_blocks == 2
    pool.check_invariants()


def test_shared_prompt_shares_blocks_and_skips_prefill():
    kv = KVCacheManager(64, 4, enable_prefix_caching=True)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64)
    prompt = list(range(1, 19))  # 18 tokens: 4 full blocks and 2 tokens
    a = _req("a", prompt, max_tokens=3)
    sched.add_request(a)
    _step(sched)
    b = _req("b", prompt + [50, 51], max_tokens=3)
    sched.add_request(b)
    out = _step(sched)
    sb = [s for s in out.scheduled if s.request is b][0]
    assert sb.num_computed_tokens == 16 and sb.num_new_tokens == 4   # 4 cached blocks skipped
    assert kv.block_table("b")[:4] == kv.block_table("a")[:4]
    assert kv.block_table("b")[4] != kv.block_table("a")[4]
    assert kv.prefix_cache_queries == 18 + 20 and kv.prefix_cache_hits == 16
    # a prompt of exactly 4 full blocks, all cached: the last one is computed again so the step samples
    c = _req("c", prompt[:16], max_tokens=2)
    sched.add_request(c)
    out = _step(sched)
    sc = [s for s in out.scheduled if s.request is c][0]
    assert (sc.num_computed_tokens, sc.num_new_tokens, len(c.output_token_ids)) == (12, 4, 1)  # it sampled
    _drain(sched)
    assert kv.num_free_blocks == 64 and not kv._pending


def test_parallel_samples_wait_for_the_shared_prompt():
    kv = KVCacheManager(64, 4, enable_prefix_caching=True)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=8)
    prompt = list(range(1, 23))  # 22 tokens
    reqs = [_req(f"s{i}", prompt, max_tokens=2) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    computed = 0
    while sched.has_unfinished():
        out = _step(sched)
        computed += out.num_batched_tokens
    # one prompt computed in full, the two siblings only their last partial block (2 tokens) each; plus
    # one decode token each (max_tokens=2)
    assert computed == 22 + 2 * 2 + 3
    assert kv.prefix_cache_hits == 2 * 20


def test_cache_off_is_unchanged():
    kv = KVCacheManager(64, 4)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64)
    for rid in "ab":
        sched.add_request(_req(rid, range(1, 19)))
        out = _step(sched)
        assert out.scheduled[-1].num_computed_tokens == 0
    assert kv.pool.num_cached_blocks == 0 and kv.prefix_cache_hits == 0


def test_eviction_under_pressure_keeps_the_pool_usable():
    kv = KVCacheManager(8, 4, enable_prefix_caching=True)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    sched.add_request(_req("a", range(1, 25), max_tokens=1))  # 6 blocks, all cached after it finishes
    _drain(sched)
    assert kv.pool.num_cached_blocks == 6 and kv.num_free_blocks == 8
    sched.add_request(_req("b", range(100, 125), max_tokens=2))  # 7 blocks: evicts 5 of a's
    _drain(sched)
    assert kv.pool.num_cached_blocks <= 8 and kv.num_free_blocks == 8
    sched.add_request(_req("c", range(1, 25), max_tokens=1))
    out = _step(sched)
    assert out.scheduled[0].num_computed_tokens < 20   # a's blocks are (mostly) gone
    _drain(sched)


def test_preemption_with_shared_blocks():
    kv = KVCacheManager(8, 4, enable_prefix_caching=True)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    prompt = list(range(1, 13))  # 3 blocks
    a = _req("a", prompt, max_tokens=12)
    sched.add_request(a)
    _step(sched)
    b = _req("b", prompt + [40], max_tokens=12)
    sched.add_request(b)
    _step(sched)
    shared = kv.block_table("a")[:3]
    assert kv.block_table("b")[:3] == shared
    preempted = False
    while sched.has_unfinished():
        out = _step(sched)
        preempted |= bool(out.preempted_ids)
        if out.preempted_ids:  # b was preempted: a still holds the shared blocks, nothing was freed twice
            assert "b" in out.preempted_ids and kv.block_table("a")[:3] == shared
    assert preempted and b.num_preemptions >= 1
    assert len(a.output_token_ids) == 12 and len(b.output_token_ids) == 12
    assert kv.num_free_blocks == 8


def test_random_requests_keep_the_pool_consistent():
    """500 requests with shared prefixes, random lengths, aborts and a small pool (preemptions and
    evictions): after every step the pool's invariants hold, every reference count equals the number of
    tables holding the block, and at the end every block is free."""
    rng = random.Random(0)
    kv = KVCacheManager(16, 4, enable_prefix_caching=True)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=24)
    prefixes = [[rng.randrange(1, 50) for _ in range(rng.randrange(1, 30))] for _ in range(6)]
    live, added = [], 0
    while added < 500 or sched.has_unfinished():
        while added < 500 and rng.random() < 0.6:
            tokens = rng.choice(prefixes) + [rng.randrange(1, 50) for _ in range(rng.randrange(0, 12))]
            r = _req(f"r{added}", tokens or [1], max_tokens=rng.randrange(1, 10))
            sched.add_request(r)
            live.append(r)
            added += 1
        if live and rng.random() < 0.05:
            victim = live.pop(rng.randrange(len(live)))
            if not victim.is_finished:
                sched.finish_request(victim, RequestStatus.FINISHED_ABORTED)
        _step(sched, token=rng.randrange(1, 50))
        refs = {}
        for rid, table in kv._tables.items():
            for b in table:
                refs[b] = refs.get(b, 0) + 1
        assert all(kv.pool._ref[b] == n for b, n in refs.items())
        assert sum(kv.pool._ref) == sum(refs.values())
        assert all(len(set(t)) == len(t) for t in kv._tables.values())
    assert kv.num_free_blocks == 16 and not kv._tables and not kv._pending
    assert sched.num_preemptions_total > 0 and kv.prefix_cache_hits > 0
    kv.pool.check_invariants()


def test_flag_env_and_kwarg(monkeypatch):
    import argparse

    from pagedmoe.config import EngineConfig, add_engine_args, engine_config_from_kwargs

    def parse(argv):
        p = argparse.ArgumentParser()
        add_engine_args(p)
        return p.parse_args(argv).enable_prefix_caching

    assert parse([]) is True and EngineConfig().enable_prefix_caching is True
    assert parse(["--no-enable-prefix-caching"]) is False
    monkeypatch.setenv("PAGEDMOE_ENABLE_PREFIX_CACHING", "0")
    assert parse([]) is False and parse(["--enable-prefix-caching"]) is True
    assert engine_config_from_kwargs(None, enable_prefix_caching=False).enable_prefix_caching is False
