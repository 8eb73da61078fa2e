"""Scheduler budgets, chunked prefill, preemption and FCFS order, on fake requests (no model)."""
import random

from pagedmoe.engine.request import Request, RequestStatus
from pagedmoe.engine.scheduler import Scheduler
from pagedmoe.kvcache.block_pool import KVCacheManager
from pagedmoe.sampling_params import SamplingParams


def _req(rid, n_prompt, max_tokens=4):
    return Request(rid, list(range(1, n_prompt + 1)), SamplingParams(max_tokens=max_tokens),
                   max_tokens=max_tokens)


def _run_step(sched):
    """Schedule, pretend to execute, append a token for every request that samples; finish at max_tokens."""
    out = sched.schedule()
    sched.update(out.scheduled)
    for s in out.scheduled:
        if s.samples:
            s.request.output_token_ids.append(7)
            if len(s.request.output_token_ids) >= s.request.max_tokens:
                sched.finish_request(s.request, RequestStatus.FINISHED_LENGTH)
    return out


def test_token_budget_and_chunked_prefill():
    sched = Scheduler(KVCacheManager(100, 4), max_num_seqs=8, max_num_batched_tokens=10)
    a, b = _req("a", 25), _req("b", 3)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 10)]
    assert not out.scheduled[0].samples
    sched.update(out.scheduled)
    out = sched.schedule()
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 10)]
    sched.update(out.scheduled)
    out = sched.schedule()  # a's last 5 prompt tokens, then b's prompt fills the rest of the budget
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 5), ("b", 3)]
    assert all(s.samples for s in out.scheduled)
    assert out.num_batched_tokens <= 10


def test_max_num_seqs():
    sched = Scheduler(KVCacheManager(100, 4), max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(5):
        sched.add_request(_req(str(i), 3))
    out = sched.schedule()
    assert len(out.scheduled) == 2 and sched.num_waiting == 3


def test_fcfs_order_of_admission():
    sched = Scheduler(KVCacheManager(100, 4), max_num_seqs=1, max_num_batched_tokens=100)
    reqs = [_req(str(i), 2, max_tokens=1) for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    order = []
    while sched.has_unfinished():
        out = _run_step(sched)
        order.extend(s.request.request_id for s in out.scheduled)
    assert order == ["0", "1", "2", "3"]


def test_preemption_frees_latest_arrival_and_recomputes():
    # 4 blocks of 4 tokens. Two requests of 8 prompt tokens take 2 blocks each; the first decode token
    # of each needs a third block -> the later request is preempted, its blocks freed.
    kv = KVCacheManager(4, 4)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=100)
    a, b = _req("a", 8, max_tokens=3), _req("b", 8, max_tokens=3)
    sched.add_request(a)
    sched.add_request(b)
    _run_step(sched)                          # both prefills (8 + 8 tokens, 4 blocks)
    assert kv.num_free_blocks == 0
    out = _run_step(sched)                    # a needs block 3: b is preempted
    assert out.preempted_ids == ["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert sched.waiting[0] is b
    while sched.has_unfinished():
        _run_step(sched)
    assert a.is_finished and b.is_finished
    assert len(b.output_token_ids) == 3 and b.num_preemptions >= 1
    assert kv.num_free_blocks == 4


def test_random_workload_invariants():
    """Random arrivals and lengths: budgets hold every step, every request finishes, no block leaks."""
    rng = random.Random(0)
    kv = KVCacheManager(24, 4)
    sched = Scheduler(kv, max_num_seqs=6, max_num_batched_tokens=16)
    reqs = []
    for step in range(400):
        if step < 60 and rng.random() < 0.5:
            r = _req(f"r{step}", rng.randint(1, 40), max_tokens=rng.randint(1, 12))
            reqs.append(r)
            sched.add_request(r)
        out = _run_step(sched)
        assert out.num_batched_tokens <= 16
        assert len(sched.running) <= 6
        assert kv.num_free_blocks >= 0
        ids = [s.request.request_id for s in out.scheduled]
        assert len(ids) == len(set(ids))
        if not sched.has_unfinished() and step >= 60:
            break
    assert all(r.is_finished for r in reqs)
    assert all(len(r.output_token_ids) == r.max_tokens for r in reqs)
    assert kv.num_free_blocks == kv.num_blocks


# -- swap space (kvcache/swap.py) -------------------------------------------------------------------


def _two_prompts_over_four_blocks(swap_blocks):
    """As test_preemption_frees_latest_arrival_and_recomputes, with a swap space of `swap_blocks` host blocks:
    after both prefills (4 blocks of 4, all used) `a`'s first decode needs a block and `b` is preempted."""
    from pagedmoe.kvcache.swap import SwapSpace

    kv = KVCacheManager(4, 4)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=100, swap=SwapSpace(swap_blocks))
    a, b = _req("a", 8, max_tokens=3), _req("b", 8, max_tokens=3)
    sched.add_request(a)
    sched.add_request(b)
    _run_step(sched)
    b_blocks = list(kv.block_table("b"))
    out = _run_step(sched)
    assert out.preempted_ids == ["b"]
    return kv, sched, a, b, b_blocks, out


def test_swapped_preemption_keeps_computed_tokens_and_copies_back():
    kv, sched, a, b, b_blocks, out = _two_prompts_over_four_blocks(8)
    swap = sched.swap
    assert out.swap_out == [(b_blocks, 0)]    # b's 8 computed tokens go to host blocks 0-1
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 8 and swap.holds("b")
    assert sched.num_swapped_total == 1 and sched.num_preemptions_total == 1
    swapped_in = None
    while sched.has_unfinished():
        out = _run_step(sched)
        if out.swap_in:
            swapped_in = out
    # b came back into fresh blocks from host block 0, decoding its next token (no prompt recompute)
    (start, blocks), = swapped_in.swap_in
    assert start == 0 and len(blocks) == 2
    s_b = next(s for s in swapped_in.scheduled if s.request is b)
    assert s_b.num_computed_tokens == 8 and s_b.num_new_tokens == 1
    assert a.is_finished and b.is_finished and len(b.output_token_ids) == 3
    assert kv.num_free_blocks == 4 and swap.num_used_blocks == 0


def test_swap_space_full_falls_back_to_recompute():
    _, sched, _, b, _, out = _two_prompts_over_four_blocks(1)   # b needs 2 host blocks
    assert out.swap_out == [] and sched.num_swapped_total == 0
    assert b.num_computed_tokens == 0 and not sched.swap.holds("b")


def test_finished_while_swapped_releases_the_host_blocks():
    _, sched, _, b, _, _ = _two_prompts_over_four_blocks(8)
    assert sched.swap.holds("b")
    sched.finish_request(b, RequestStatus.FINISHED_ABORTED)
    assert not sched.swap.holds("b") and sched.swap.num_used_blocks == 0 and b not in sched.waiting


def test_swap_in_takes_its_cached_prefix_from_the_cache():
    """With prefix caching a swapped request's blocks still cached (here the prompt prefix it shares with `a`) are
    reused at swap-in; only the rest comes back from the host."""
    from pagedmoe.kvcache.swap import SwapSpace

    prefix = list(range(1, 9))                                   # two full blocks of 4
    kv = KVCacheManager(5, 4, enable_prefix_caching=True)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=100, swap=SwapSpace(8))
    a = Request("a", prefix + [100], SamplingParams(max_tokens=12), max_tokens=12)
    b = Request("b", prefix + [200], SamplingParams(max_tokens=6), max_tokens=6)
    sched.add_request(a)
    sched.add_request(b)
    outs = [_run_step(sched) for _ in range(40) if sched.has_unfinished()]
    (swapped_out,) = [o for o in outs if o.swap_out]
    (blocks, start), = swapped_out.swap_out
    assert swapped_out.preempted_ids == ["b"] and len(blocks) == 3 and start == 0
    (back,) = [o for o in outs if o.swap_in]
    (s_b,) = [s for s in back.scheduled if s.request is b]
    assert s_b.num_computed_tokens == 12
    (host_start, dev_blocks), = back.swap_in
    assert host_start == 2 and len(dev_blocks) == 1            # blocks 0-1 of b came from the cache
    assert a.is_finished and b.is_finished and len(b.output_token_ids) == 6
    assert kv.num_free_blocks == kv.num_blocks and sched.swap.num_used_blocks == 0


def test_random_workload_with_swap_space():
    """As test_random_workload_invariants, with a swap space too small for every victim: some preemptions swap,
    some recompute; every request finishes with all its tokens, no block of either pool leaks, and a swapped
    request resumes exactly where it stopped."""
    from pagedmoe.kvcache.swap import SwapSpace

    rng = random.Random(1)
    kv = KVCacheManager(16, 4)
    swap = SwapSpace(4)
    sched = Scheduler(kv, max_num_seqs=6, max_num_batched_tokens=16, swap=swap)
    reqs, computed_at_preempt = [], {}
    for step in range(2000):
        if step < 60 and rng.random() < 0.5:
            r = _req(f"r{step}", rng.randint(1, 40), max_tokens=rng.randint(1, 12))
            reqs.append(r)
            sched.add_request(r)
        held = {r.request_id for r in reqs if swap.holds(r.request_id)}
        out = _run_step(sched)
        for rid in out.preempted_ids:
            r = next(x for x in reqs if x.request_id == rid)
            computed_at_preempt[rid] = r.num_computed_tokens
        back = [s for s in out.scheduled if s.request.request_id in held]
        assert len(back) == len(out.swap_in)
        for s, (_, blocks) in zip(back, out.swap_in):
            assert s.num_computed_tokens == computed_at_preempt[s.request.request_id] > 0
            assert len(blocks) == -(-s.num_computed_tokens // 4)
        assert out.num_batched_tokens <= 16 and len(sched.running) <= 6
        assert swap.num_used_blocks <= swap.num_blocks
        if not sched.has_unfinished() and step >= 60:
            break
    assert sched.num_swapped_total > 0 and sched.num_preemptions_total > sched.num_swapped_total
    assert all(r.is_finished and len(r.output_token_ids) == r.max_tokens for r in reqs)
    assert kv.num_free_blocks == kv.num_blocks and swap.num_used_blocks == 0 and swap.num_swapped == 0
