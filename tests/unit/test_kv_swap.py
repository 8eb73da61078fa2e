"""The swap space's host block runs and its copies to and from the KV cache tensors (kvcache/swap.py)."""
import pytest
import torch

from pagedmoe.kvcache.swap import GiB, HostKVSwap, SwapSpace, auto_swap_blocks


def test_runs_first_fit_and_coalesce():
    s = SwapSpace(10)
    assert s.reserve("a", 4) == 0 and s.reserve("b", 3) == 4 and s.reserve("c", 3) == 7
    assert s.reserve("d", 1) is None and s.usage() == 1.0
    s.release("b")
    assert s.reserve("d", 4) is None          # 3 free blocks in one run
    s.release("a")                            # [0, 7) free again, in one run
    assert s.reserve("d", 7) == 0 and s.num_swapped == 2
    s.release("c")
    s.release("d")
    s.release("nobody")                       # nothing held: no change
    assert s.num_used_blocks == 0 and s._free == [(0, 10)]
    s.reserve("e", 1)
    with pytest.raises(RuntimeError, match="already swapped"):
        s.reserve("e", 1)
    with pytest.raises(ValueError):
        SwapSpace(0)


def _caches(device, num_blocks=12, layers=3):
    g = torch.Generator().manual_seed(0)
    shape = (num_blocks, 4, 2, 8)
    return [(torch.randn(shape, generator=g).to(device), torch.randn(shape, generator=g).to(device))
            for _ in range(layers)]


def _round_trip(device):
    caches = _caches(device)
    before = [(k.clone(), v.clone()) for k, v in caches]
    swap = HostKVSwap(caches, 6)
    assert swap.nbytes == 6 * HostKVSwap.block_bytes(caches)
    swap.run([([5, 2, 9], 1)], [])            # out to host blocks 1..3
    for k, v in caches:                       # the blocks are reused by other requests
        for t in (k, v):
            t[[5, 2, 9]] = 0
    swap.run([], [(1, [0, 7, 11])])           # back into other device blocks
    for (k, v), (k0, v0) in zip(caches, before):
        assert torch.equal(k[[0, 7, 11]], k0[[5, 2, 9]]) and torch.equal(v[[0, 7, 11]], v0[[5, 2, 9]])
        assert torch.equal(k[[1, 3, 4]], k0[[1, 3, 4]])     # nothing else written


def test_host_copies_round_trip_cpu():
    _round_trip(torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_host_copies_round_trip_cuda():
    _round_trip(torch.device("cuda"))
    swap = HostKVSwap(_caches(torch.device("cuda")), 2)
    assert swap.host.is_pinned()


def test_auto_size():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    bb = 2 << 20  # 2 MiB a block
    # 256 sequences of 3072 tokens = 49152 blocks of 16 against 23763 in the cache: 25389 short, capped at 16 GiB
    assert auto_swap_blocks(cuda, 23763, 16, 256, 3072, bb, None) == 16 * GiB // bb
    assert auto_swap_blocks(cuda, 23763, 16, 256, 3072, bb, 8 * GiB) == 4 * GiB // bb   # half the host's
    assert auto_swap_blocks(cuda, 49152, 16, 256, 3072, bb, None) == 0    # everything fits: no preemption
    assert auto_swap_blocks(cuda, 49000, 16, 256, 3072, bb, None) == 152
    assert auto_swap_blocks(cpu, 10, 16, 256, 3072, bb, None) == 0
