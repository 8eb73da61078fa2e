"""BlockTables (worker/block_tables.py) against padding the KV manager's lists afresh every step, over a
random scheduler workload with preemptions, finishes and rows reused."""
import random

import torch

from pagedmoe.engine.request import Request
from pagedmoe.engine.scheduler import Scheduler
from pagedmoe.kvcache.block_pool import KVCacheManager
from pagedmoe.sampling_params import SamplingParams
from pagedmoe.worker.block_tables import BlockTables


def _padded(tables, width):
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)


def test_gather_equals_fresh_padding_under_preemption():
    rng = random.Random(0)
    kv = KVCacheManager(num_blocks=40, block_size=4)
    sched = Scheduler(kv, max_num_seqs=6, max_num_batched_tokens=24)
    bt = BlockTables(max_blocks_per_seq=16, rows=2)  # grows and reclaims rows along the way
    next_id, preempted = 0, 0
    for _ in range(400):
        if rng.random() < 0.3:
            n = rng.randrange(1, 30)
            sched.add_request(Request(f"r{next_id}", [5] * n, SamplingParams(max_tokens=rng.randrange(1, 30)),
                                      max_tokens=64 - n))
            next_id += 1
        out = sched.schedule()
        preempted += len(out.preempted_ids)
        if out.is_empty:
            continue
        ids = [s.request.request_id for s in out.scheduled]
        tables = [kv.block_table(rid) for rid in ids]
        width = max(map(len, tables))
        assert torch.equal(bt.gather(ids, tables, width, kv.has), _padded(tables, width))
        sched.update(out.scheduled)
        for s in out.scheduled:
            r = s.request
            if r.num_computed_tokens >= r.num_tokens:  # sampled: one more token, maybe the last
                r.output_token_ids.append(7)
                if len(r.output_token_ids) >= r.params.max_tokens:
                    sched.finish_request(r, _finished())
    assert preempted > 0 and next_id > 50 and bt.table.shape[0] >= 6


def _finished():
    from pagedmoe.engine.request import RequestStatus

    return RequestStatus.FINISHED_LENGTH
