"""KV memory lent to expert weights under dynamic precision (kvcache/kv_cache.py::LendableKVCache): the
chunk arithmetic on CPU; on CUDA, that unmapped chunks really go back to the device, come back zeroed,
and that the blocks below the tail keep their contents."""
from __future__ import annotations

import pytest
import torch

from pagedmoe.kvcache.kv_cache import blocks_per_chunk

MiB = 2**20


def test_chunks_fill_whole_granules_and_stay_few():
    # Mixtral: 16 tokens x 8 heads x 128 x bf16 = 32 KiB per block and tensor: 64 blocks fill 2 MiB
    assert blocks_per_chunk(100, 32 * 1024, 2 * MiB) == 64
    assert blocks_per_chunk(64 * 64, 32 * 1024, 2 * MiB) == 64
    assert blocks_per_chunk(64 * 64 + 1, 32 * 1024, 2 * MiB) == 128            # at most 64 chunks a tensor
    n = blocks_per_chunk(30_000, 32 * 1024, 2 * MiB)
    assert n % 64 == 0 and -(-30_000 // n) <= 64
    # a slice that does not divide the granule: the least common multiple
    per = blocks_per_chunk(10, 24 * 1024, 2 * MiB)
    assert (per * 24 * 1024) % (2 * MiB) == 0 and per == 256


@pytest.mark.gpu
def test_lendable_kv_cache_gives_memory_back_and_maps_it_again_zeroed():
    from pagedmoe import cuda_vmm as vmm
    from pagedmoe.kvcache.kv_cache import LendableKVCache

    dev = torch.device("cuda")
    if not vmm.available(dev):
        pytest.skip("no CUDA VMM (cuda-python)")
    n = 10_000
    kv = LendableKVCache(2, n, 16, 8, 128, torch.bfloat16, dev)
    (k0, v0), (k1, v1) = kv.caches
    assert k0.shape == (n, 16, 8, 128) and kv.blocks_per_chunk % 64 == 0 and kv.lent_bytes == 0
    for i, t in enumerate((k0, v0, k1, v1)):
        t.fill_(i + 1)
    torch.cuda.synchronize()
    free0, _ = torch.cuda.mem_get_info()
    top = 5_000
    assert kv.set_top(top) == top
    kept = -(-top // kv.blocks_per_chunk)                 # chunks holding a block below the tail stay mapped
    assert kv.mapped == kept and kv.lent_bytes > 0
    free1, _ = torch.cuda.mem_get_info()
    assert abs((free1 - free0) - kv.lent_bytes) <= 2 * MiB * 4          # the driver has the bytes back
    # torch can allocate what was lent, and the blocks below the tail are intact
    borrowed = torch.empty(kv.lent_bytes, dtype=torch.uint8, device=dev)
    borrowed.fill_(7)
    assert all(bool((t[:top] == i + 1).all()) for i, t in enumerate((k0, v0, k1, v1)))
    del borrowed                                          # freed into torch's cache
    assert kv.set_top(n) == n and kv.lent_bytes == 0
    torch.cuda.synchronize()
    free2, _ = torch.cuda.mem_get_info()
    assert abs(free2 - free0) <= 8 * MiB                  # torch's cache went back first: no growth
    boundary = kept * kv.blocks_per_chunk
    assert all(bool((t[boundary:] == 0).all()) and bool((t[:top] == i + 1).all())
               for i, t in enumerate((k0, v0, k1, v1)))
    kv.close()


@pytest.mark.gpu
def test_dynamic_engine_lends_kv_memory_physically(tmp_path):
    """Dynamic precision on CUDA: the KV tensors are lendable, the physical bytes given back cover what the
    experts hold above the floor to within one chunk per tensor, and scoring still matches resident."""
    from tiny_models import make_tiny_checkpoint

    from pagedmoe import LLM
    from pagedmoe import cuda_vmm as vmm

    if not vmm.available(torch.device("cuda")):
        pytest.skip("no CUDA VMM (cuda-python)")
    # wide experts (1.5 MiB each in bf16) next to 8 KiB KV blocks: the surplus spans whole chunks
    make_tiny_checkpoint("mixtral", tmp_path, seed=3, num_hidden_layers=4, dtype=torch.bfloat16,
                         intermediate_size=4096)
    flags = dict(device="cuda", dtype="bfloat16", enforce_eager=True, max_model_len=256, max_num_seqs=16,
                 max_num_batched_tokens=256)
    ids = list(range(3, 90))
    ref = LLM(str(tmp_path), expert_placement="resident", **flags).engine.score(ids)
    e = LLM(str(tmp_path), expert_precision="dynamic", num_kv_blocks=20_000, **flags).engine
    kv, mgr = e.runner.kv_backing, e.precision
    assert kv is not None and e.kv.backing is kv and set(mgr.assignment.values()) == {"bf16"}
    lent = mgr.withheld * mgr.block_bytes
    assert kv.lent_bytes > 0 and kv.lent_bytes <= lent < kv.lent_bytes + kv.chunk_bytes[0] * len(kv._ranges)
    assert torch.equal(e.score(ids), ref)
    mgr.demote_to(mgr.floor_bytes)                        # everything to the floor: every lent block back
    assert mgr.withheld == 0 and kv.lent_bytes == 0 and e.kv.pool.top == e.kv.num_blocks
    assert not torch.equal(e.score(ids), ref)             # int4 experts, read through KV that mapped again
