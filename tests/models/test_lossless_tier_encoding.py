"""The lossless tiers are encoded a group of experts at a time (codecs/lossless_groups.py): the arrays are
those of the whole-layer encode, and loading holds no more than one group's worth on the device (the whole
layer at once put Mixtral-8x7B's start-up 8 GiB over --gpu-memory-gb 24)."""
from __future__ import annotations

import torch

from peak_memory import PeakMemory
from pagedmoe.codecs.lossless import ARRAYS, encode
from pagedmoe.experts.dummy import DummyExperts
from pagedmoe.experts.store import ExpertStore
from pagedmoe.experts.table import ExpertTable
from pagedmoe.experts.tiers.host import HostTier

H, I = 128, 256   # 98304 weights an expert: three full 30720-weight blocks and a short one


def _store(num_layers: int, num_experts: int, resident=(), group_experts: int = 1, align: int = 16) -> ExpertStore:
    table = ExpertTable(num_layers, num_experts)
    table.place([resident] * num_layers, [()] * num_layers)
    return ExpertStore(table, H, I, torch.bfloat16, torch.device("cpu"), True, stride_align_bytes=align,
                       host_compression="lossless", host_group_experts=group_experts)


def _assert_whole_layer_encoding(store: ExpertStore, layer: int, rows: torch.Tensor) -> None:
    """The layer's groups hold exactly the whole-layer encode's parts (today's arrays, pad words included)."""
    whole = encode(rows, num_parts=rows.shape[0], checksum=False)
    s0 = 0
    for ct, (_, k) in zip(store.host_compressed[layer], store.host_groups[layer]):
        want = whole.parts(s0, s0 + k)
        for name in ARRAYS:
            assert torch.equal(getattr(ct, name), getattr(want, name)), (layer, s0, name)
        assert torch.equal(ct.code_lengths, want.code_lengths) and ct.fill_exponent == want.fill_exponent
        assert ct.shape == want.shape and ct.num_parts == k
        s0 += k
    assert s0 == rows.shape[0]


def test_loaded_host_rows_encode_as_the_whole_layer():
    """Checkpoint loading: rows written through the loader's sink (into rows padded past the expert), each
    layer encoded once complete, in groups of 3, 3, 1 (experts 1-7; 0 resident)."""
    store = _store(2, 8, resident=(0,), group_experts=3, align=1 << 18)
    assert store.stride > store.expert_numel
    g = torch.Generator().manual_seed(5)
    n = H * I
    written = torch.empty(2, 8, store.expert_numel, dtype=torch.bfloat16)
    for layer in range(2):
        for e in range(8):
            w = (torch.randn(3 * n, generator=g) * (0.02 if e % 2 else 3.0)).to(torch.bfloat16)
            written[layer, e] = w
            for kind, part in (("gate", w[:n].view(I, H)), ("up", w[n:2 * n].view(I, H)),
                               ("down", w[2 * n:].view(H, I))):
                store.write(layer, e, kind, part)
        assert store.host[layer] is None   # encoded as soon as its last part was written
    store.finalize()
    for layer in range(2):
        assert store.host_groups[layer] == [(1, 3), (4, 3), (7, 1)]
        _assert_whole_layer_encoding(store, layer, written[layer, 1:])


def test_dummy_weights_encode_as_the_whole_layer():
    store = _store(2, 5, group_experts=2)
    store.init_random(seed=4)
    gen = DummyExperts(4 + 1, 0.02, torch.bfloat16, torch.device("cpu"))   # init_random's weights
    for layer in range(2):
        rows = torch.stack([gen.read(layer, e, 0, store.expert_numel, store.expert_numel) for e in range(5)])
        _assert_whole_layer_encoding(store, layer, rows)


def test_dummy_load_holds_one_experts_encoding_at_a_time(monkeypatch):
    """Tensors init_random allocates for a routed compressed host tier (one expert a group), the host arrays
    aside: at most what encoding one expert alone takes, plus a generated chunk and the per-expert histograms;
    the whole-layer encode of the same weights takes more (and so would generating the layer at once)."""
    E = 16
    store = _store(2, E)
    probe = PeakMemory()
    real = HostTier._host_array

    def host_array(self, shape, dtype):
        with probe.excluded():
            return real(self, shape, dtype)

    monkeypatch.setattr(HostTier, "_host_array", host_array)
    with probe:
        store.init_random(seed=2)
    gen = DummyExperts(2 + 1, 0.02, torch.bfloat16, torch.device("cpu"))
    rows = torch.stack([gen.read(0, e, 0, store.expert_numel, store.expert_numel) for e in range(E)])
    with PeakMemory() as one:
        encode(rows[:1].clone(), num_parts=1, checksum=False)
    with PeakMemory() as whole:
        encode(rows, num_parts=E, checksum=False)
    bound = one.peak + 2 * rows[0].nbytes + 2048 * E
    assert probe.peak <= bound, (probe.peak, bound)
    assert whole.peak > bound and probe.peak + 2 * rows.nbytes > bound
    assert all(h is None for h in store.host) and store.host_bytes < rows.nbytes * 2


def test_compressed_gpu_tier_encodes_as_the_whole_layer():
    """The compressed GPU tier (one tensor per layer, experts 1-4 of 6) is encoded as one group: from the
    loader's staged rows, and from the dummy generator, its arrays are those of encode(rows)."""
    table = ExpertTable(2, 6)
    table.place([(0,)] * 2, [range(1, 5)] * 2)
    loaded = ExpertStore(table, H, I, torch.bfloat16, torch.device("cpu"), True)
    g = torch.Generator().manual_seed(8)
    n = H * I
    written = (torch.randn(2, 6, 3 * n, generator=g) * 0.05).to(torch.bfloat16)
    for layer in range(2):
        for e in range(6):
            loaded.write(layer, e, "w13", written[layer, e, :2 * n].view(2 * I, H))
            loaded.write(layer, e, "w2", written[layer, e, 2 * n:].view(H, I))
    dummy = ExpertStore(table, H, I, torch.bfloat16, torch.device("cpu"), True)
    dummy.init_random(seed=6)
    gen = DummyExperts(6 + 1, 0.02, torch.bfloat16, torch.device("cpu"))
    for store, rows in ((loaded, written[:, 1:5]),
                        (dummy, torch.stack([torch.stack([gen.read(l, e, 0, 3 * n, 3 * n) for e in range(1, 5)])
                                             for l in range(2)]))):
        for layer in range(2):
            got, want = store.compressed[layer], encode(rows[layer].contiguous(), num_parts=4, checksum=False)
            for name in ARRAYS:
                assert torch.equal(getattr(got, name), getattr(want, name)), (layer, name)
            assert got.shape == want.shape == (4, 3 * n) and torch.equal(got.code_lengths, want.code_lengths)
            assert got.fill_exponent == want.fill_exponent and store.compressed_tier.staging[layer] is None
