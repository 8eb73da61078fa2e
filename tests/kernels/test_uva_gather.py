"""Fetch path (b) of routed fetching: the device-side miss plan and the row gather (kernels/uva_gather.py),
against the torch reference; on CPU the Triton interpreter runs the kernel, on the GPU (@pytest.mark.gpu) it
reads mapped pinned host memory inside a CUDA graph."""
import os

import torch

if not torch.cuda.is_available():
    # Must precede the kernels' import: triton.jit picks the interpreter at decoration time.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

triton = pytest.importorskip("triton")

from pagedmoe.kernels.uva_gather import gather_rows, gather_rows_ref, plan_misses  # noqa: E402

CAN_RUN = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def test_plan_misses_pages_only_the_routed_misses():
    slot_map = torch.tensor([-1, 4, -1, -1, 7, -1])
    topk_ids = torch.tensor([[2, 1], [5, 2], [1, 4]])
    fetch_dst, layer_slots = plan_misses(topk_ids, slot_map, miss_base=10)
    assert fetch_dst.tolist() == [-1, -1, 10, -1, -1, 11]         # experts 2 and 5 missed, in id order
    assert layer_slots.tolist() == [-1, 4, 10, -1, 7, 11]
    # every routed id maps to a page
    assert (layer_slots[topk_ids] >= 0).all()


def _check(device, src):
    gen = torch.Generator().manual_seed(0)
    E, S, stride = src.shape[0], 12, src.shape[1]
    slot_map = torch.full((E,), -1, dtype=torch.int64)
    slot_map[[0, 3]] = torch.tensor([1, 2])
    topk = torch.randint(0, E, (5, 2), generator=gen).to(device)
    fetch_dst, layer_slots = plan_misses(topk, slot_map.to(device), miss_base=4)
    poison = torch.full((S, stride), float("nan"), dtype=src.dtype, device=device)
    got, ref = poison.clone(), poison.clone()
    gather_rows(src, got, fetch_dst, block=64)
    gather_rows_ref(src, ref, fetch_dst)
    assert torch.equal(got.nan_to_num(-7.0), ref.nan_to_num(-7.0))
    for e in topk.reshape(-1).tolist():
        if slot_map[e] < 0:
            assert torch.equal(got[layer_slots[e]].cpu(), src[e].cpu())


@pytest.mark.skipif(not CAN_RUN or torch.cuda.is_available(), reason="the interpreter run (CPU)")
def test_gather_rows_matches_reference_on_the_interpreter():
    from triton_interp import fix_interpreter_index

    fix_interpreter_index()
    src = torch.randn(8, 200, dtype=torch.float32)   # 200: a partial last block of 64
    _check("cpu", src)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gather_rows_reads_mapped_host_memory_in_a_cuda_graph():
    from pagedmoe.experts.tiers.host import pinned_empty

    src = pinned_empty((16, 4096 + 100), torch.bfloat16)
    src.copy_(torch.randn(src.shape).to(torch.bfloat16))
    _check("cuda", src)
    # graph-capturable: plan + gather with no host sync
    slot_map = torch.full((16,), -1, dtype=torch.int64, device="cuda")
    topk = torch.zeros(4, 2, dtype=torch.int64, device="cuda")
    dst = torch.zeros(20, src.shape[1], dtype=src.dtype, device="cuda")
    gather_rows(src, dst, plan_misses(topk, slot_map, 0)[0])   # warm-up (compile)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fetch_dst, _ = plan_misses(topk, slot_map, 0)
        gather_rows(src, dst, fetch_dst)
    topk.copy_(torch.tensor([[3, 9], [9, 15], [3, 3], [15, 9]]))
    dst.zero_()
    g.replay()
    torch.cuda.synchronize()
    for rank, e in enumerate([3, 9, 15]):
        assert torch.equal(dst[rank].cpu(), src[e])


@pytest.mark.skipif(not CAN_RUN, reason="needs a GPU or TRITON_INTERPRET=1")
def test_slot_map_kernel_over_the_cache_pool_equals_fused_moe_on_the_layer():
    """Routed fetching's Triton path (models/layers/moe.py): fused_moe_mixed over the expert cache's pool with
    the layer's slot map gives fused_moe's result on the layer's own experts, bit for bit."""
    from pagedmoe.experts.layout import expert_stride, expert_views
    from pagedmoe.kernels import fused_moe as fm

    if not torch.cuda.is_available():
        from triton_interp import fix_interpreter_index

        fix_interpreter_index()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator().manual_seed(1)
    T, A, E, H, I, S = 5, 2, 8, 32, 16, 13
    stride = expert_stride(H, I, torch.tensor([], dtype=dtype).element_size())
    layer = (torch.randn(E, stride, generator=g) * H ** -0.5).to(dtype).to(device)
    weights, ids = torch.topk(torch.softmax(torch.randn(T, E, generator=g), -1), A, dim=-1)
    weights, ids = weights.to(device), ids.to(device)
    slots = torch.full((E,), -1, dtype=torch.int32)
    pool = torch.full((S, stride), float("nan"), dtype=dtype)   # unrouted pages are never read
    for page, e in zip((11, 2, 7, 0, 5, 9, 3, 12), range(E)):
        slots[e] = page
        pool[page] = layer[e].cpu()
    pool, slots = pool.to(device), slots.to(device)
    x = torch.randn(T, H, generator=g).to(dtype).to(device)
    ref = fm.fused_moe(x, *expert_views(layer, H, I), weights, ids)
    got = fm.fused_moe_mixed(x, [(*expert_views(pool, H, I), slots)], E, weights, ids)
    assert torch.equal(got, ref)


@pytest.mark.skipif(not CAN_RUN or torch.cuda.is_available(), reason="the interpreter run (CPU)")
def test_sync_free_fetch_counts_on_the_device_and_names_the_experts_it_keeps_missing():
    """experts/routed_uva.py: a routed miss lands in the miss area (the pool's last pages) with its host row; hits
    and misses are counted on the device and read after the step; after REFRESH_STEPS steps the experts missed in
    two or more of them are named for the cache (the pager pages them in between steps)."""
    from pagedmoe.experts.cache import ExpertCache
    from pagedmoe.experts.routed_uva import REFRESH_STEPS, SyncFreeFetch
    from pagedmoe.experts.table import ExpertTable

    table = ExpertTable(2, 4)
    table.place([()] * 2)
    cache = ExpertCache(table, 7, 8, torch.float32, torch.device("cpu"), miss_rows=3)
    host = [torch.randn(4, 8), torch.randn(4, 8)]
    cache.lookup(0, [1])                          # expert 1 of layer 0 cached (path (a))
    cache.pool[cache.host_maps[0][1]] = host[0][1]
    cache.publish(0)
    sf = SyncFreeFetch(cache, host, max_tokens=2, expert_bytes=32)
    for step in range(REFRESH_STEPS):
        assert sf.refresh_candidates() == []
        slots = sf.layer_slots(0, torch.tensor([[1, 3], [3, 1]] if step % 2 else [[1, 0], [1, 1]]))
        for e in ((1, 3) if step % 2 else (1, 0)):
            assert torch.equal(cache.pool[slots[e]], host[0][e])
        assert slots[3 if step % 2 else 0] == cache.miss_base and slots[1] == cache.host_maps[0][1]
        sf.layer_slots(1, torch.tensor([[2, 2], [2, 2]]))
        # layer 0: one hit, one miss; layer 1: one miss; nothing decoded; two raw rows of 32 bytes moved
        assert sf.collect() == (2, 3, 0, 64)
    assert sf.num_steps == REFRESH_STEPS
    # layer 0 missed 0 and 3 in half the steps each (3 last: as often), layer 1 missed 2 in every step
    assert sf.refresh_candidates() == [[0, 3], [2]]
    assert sf.refresh_candidates() == [] and int(sf.miss_counts.sum()) == 0


@pytest.mark.skipif(not CAN_RUN or torch.cuda.is_available(), reason="the interpreter run (CPU)")
def test_sync_free_fetch_decodes_the_compressed_tier_and_reads_host_rows_by_host_slot():
    """With the compressed GPU tier (the first C ids of a layer, experts/build.py) path (b) decodes that tier's routed
    misses into their miss pages (the indexed lossless decode) and gathers the others from the raw host rows, which
    hold only the host experts (row = host slot, not expert id); the decoded misses are counted apart (no PCIe)."""
    from triton_interp import fix_interpreter_index

    from pagedmoe.codecs.lossless import LosslessLayout, encode
    from pagedmoe.experts.cache import ExpertCache
    from pagedmoe.experts.routed_uva import REFRESH_STEPS, SyncFreeFetch
    from pagedmoe.experts.table import ExpertTable

    fix_interpreter_index()
    E, n, stride = 6, 90, 96
    table = ExpertTable(2, E)
    table.place([()] * 2, [range(3), [1, 4]])   # layer 0: 0-2 compressed (one range); layer 1: 1 and 4 (not)
    g = torch.Generator().manual_seed(2)
    weights = [(torch.randn(E, n, generator=g) * 0.02).bfloat16() for _ in range(2)]
    comp_ids = [[0, 1, 2], [1, 4]]
    host_ids = [[e for e in range(E) if e not in c] for c in comp_ids]
    compressed = [encode(w[c].contiguous(), num_parts=len(c), layout=LosslessLayout(16, 4, 12))
                  for w, c in zip(weights, comp_ids)]
    host = []
    for w, ids in zip(weights, host_ids):
        rows = torch.zeros(len(ids), stride, dtype=torch.bfloat16)
        rows[:, :n] = w[ids]
        host.append(rows)
    cache = ExpertCache(table, E + 4, stride, torch.bfloat16, torch.device("cpu"), miss_rows=4)
    cache.lookup(0, [3])                          # layer 0's expert 3 cached (path (a))
    cache.pool[cache.host_maps[0][3], :n] = weights[0][3]
    cache.publish(0)
    sf = SyncFreeFetch(cache, host, max_tokens=2, compressed=compressed, expert_bytes=2 * n)
    routed = {0: [[2, 3], [5, 0]], 1: [[4, 0], [1, 0]]}
    for layer, ids in routed.items():
        slots = sf.layer_slots(layer, torch.tensor(ids))
        for e in {e for row in ids for e in row}:
            assert torch.equal(cache.pool[slots[e], :n].view(torch.int16), weights[layer][e].view(torch.int16))
    assert slots[0] == cache.miss_base   # layer 1's misses 0, 1, 4 in id order: 0 first
    # layer 0: 3 hit, 0 and 2 decoded, 5 gathered; layer 1: 1 and 4 decoded, 0 gathered (two raw rows moved)
    assert sf.collect() == (6, 7, 4, 2 * 2 * n)
    # only host experts are named for the cache (a compressed miss is a decode, no PCIe): layer 1 missed 0 (host)
    # and 1, 4 (compressed) in every step
    for _ in range(REFRESH_STEPS - 1):
        sf.layer_slots(1, torch.tensor(routed[1]))
        sf.collect()
    assert sf.refresh_candidates() == [[], [0]]   # layer 0: 0 and 2 compressed, host 5 missed once
    with pytest.raises(ValueError, match="raw host row, mapped compressed host part or compressed GPU-tier part"):
        SyncFreeFetch(cache, [host[0], host[1][:2]], max_tokens=2, compressed=compressed)


def _host_layer(weights, ids, group_sizes, layout):
    """One layer's host experts `ids` as experts/tiers/host.py holds a compressed host tier: encoded with one codebook
    in groups of `group_sizes` parts (one part per host slot), each group's arrays views of one host tensor per kind
    (codecs/lossless_groups.py), and path (b)'s view of them all (mapped_layer)."""
    from pagedmoe.codecs.lossless_groups import encode_groups, rows_reader
    from pagedmoe.experts.tiers.host import mapped_layer

    cpu = torch.device("cpu")
    starts = [sum(group_sizes[:i]) for i in range(len(group_sizes))]
    groups = encode_groups(rows_reader(weights[ids].contiguous(), cpu), len(ids), weights.shape[1],
                           list(zip(starts, group_sizes)), device=cpu,
                           alloc=lambda shape, dtype: torch.empty(shape, dtype=dtype), layout=layout)
    return groups, mapped_layer(groups, cpu)


@pytest.mark.skipif(not CAN_RUN or torch.cuda.is_available(), reason="the interpreter run (CPU)")
def test_mapped_compressed_host_layer_decodes_every_part_by_host_slot():
    """mapped_layer: the groups of a compressed host layer (each its own CompressedTensor, block offsets rebased to
    its own first word) seen as one tensor of all their parts, its block offsets absolute again, so the indexed
    decode reads any host slot's part (groups of 2, 1 and 3 parts here) and writes exactly its expert's bits; each
    part's stored bytes are what a path (a) fill of that expert copies (its group's arrays, one expert per group)."""
    from triton_interp import fix_interpreter_index

    from pagedmoe.codecs.lossless import LosslessLayout
    from pagedmoe.kernels.lossless_decode import lossless_decode_indexed

    fix_interpreter_index()
    g = torch.Generator().manual_seed(4)
    n, E = 150, 6
    weights = (torch.randn(E, n, generator=g) * 0.02).bfloat16()
    groups, mapped = _host_layer(weights, list(range(E)), [2, 1, 3], LosslessLayout(16, 4, 12))
    assert mapped.ct.num_parts == E and all(gr.raw.untyped_storage().data_ptr() == mapped.ct.raw.untyped_storage()
                                            .data_ptr() for gr in groups)   # the groups' own memory, not a copy
    out = torch.full((E + 2, n + 10), float("nan"), dtype=torch.bfloat16)
    dst = torch.tensor([3, -1, 0, 7, 1, 5])          # part i into row dst[i]; part 1 skipped
    lossless_decode_indexed(mapped.ct, out, torch.arange(E, dtype=torch.int32), dst)
    for part, row in enumerate(dst.tolist()):
        if row >= 0:
            assert torch.equal(out[row, :n].view(torch.int16), weights[part].view(torch.int16))
    assert out[2].isnan().all() and out[3, n:].isnan().all()   # untouched rows and row tails
    # one expert per group (as routed fetching builds it): part p's stored bytes = its group's decoded arrays
    groups1, mapped1 = _host_layer(weights, list(range(E)), [1] * E, LosslessLayout(16, 4, 12))
    arrays = ("stream", "block_bit_offsets", "lane_bits", "raw")
    assert mapped1.part_bytes.tolist() == [sum(getattr(gr, a).numel() * getattr(gr, a).element_size() for a in arrays)
                                           for gr in groups1]


@pytest.mark.skipif(not CAN_RUN or torch.cuda.is_available(), reason="the interpreter run (CPU)")
def test_sync_free_fetch_decodes_a_compressed_host_tier_from_host_memory():
    """With the host tier compressed (--host-compression lossless) path (b) decodes each host miss straight from the
    layer's mapped host arrays into its miss page (the indexed decode reads host memory: on the GPU over PCIe),
    beside the compressed GPU tier's decoded misses; every miss is decoded, and the bytes moved are the missed host
    parts' stored bytes, counted on the device."""
    from triton_interp import fix_interpreter_index

    from pagedmoe.codecs.lossless import LosslessLayout, encode
    from pagedmoe.experts.cache import ExpertCache
    from pagedmoe.experts.routed_uva import SyncFreeFetch
    from pagedmoe.experts.table import ExpertTable

    fix_interpreter_index()
    E, n, stride, lay = 6, 90, 96, LosslessLayout(16, 4, 12)
    table = ExpertTable(2, E)
    table.place([()] * 2, [range(2), []])   # layer 0: 0-1 in the compressed GPU tier; layer 1: all on the host
    g = torch.Generator().manual_seed(6)
    weights = [(torch.randn(E, n, generator=g) * 0.02).bfloat16() for _ in range(2)]
    host_ids = [[2, 3, 4, 5], list(range(E))]
    compressed = [encode(weights[0][:2].contiguous(), num_parts=2, layout=lay), None]
    mapped = [_host_layer(w, ids, [1] * len(ids), lay)[1] for w, ids in zip(weights, host_ids)]
    cache = ExpertCache(table, E + 4, stride, torch.bfloat16, torch.device("cpu"), miss_rows=4)
    cache.lookup(1, [5])                          # layer 1's expert 5 cached (path (a))
    cache.pool[cache.host_maps[1][5], :n] = weights[1][5]
    cache.publish(1)
    with pytest.raises(ValueError, match="mapped compressed host part"):   # raw rows expected without host_mapped
        SyncFreeFetch(cache, [None, None], max_tokens=2, compressed=compressed)
    sf = SyncFreeFetch(cache, [None, None], max_tokens=2, compressed=compressed, host_mapped=mapped)
    routed = {0: [[1, 4], [2, 4]], 1: [[5, 0], [3, 5]]}
    for layer, ids in routed.items():
        slots = sf.layer_slots(layer, torch.tensor(ids))
        for e in {e for row in ids for e in row}:
            assert torch.equal(cache.pool[slots[e], :n].view(torch.int16), weights[layer][e].view(torch.int16))
    part_bytes = [m.part_bytes.tolist() for m in mapped]
    # layer 0: 1 decoded (GPU tier), 2 and 4 decoded from the host (host slots 0 and 2); layer 1: 5 hit, 0 and 3
    moved = part_bytes[0][0] + part_bytes[0][2] + part_bytes[1][0] + part_bytes[1][3]
    assert sf.collect() == (5, 6, 5, moved) and moved > 0
