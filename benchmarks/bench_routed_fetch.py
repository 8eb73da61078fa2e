"""Fetch paths of routed fetching on the GPU (issue 21): what one MoE layer's fetch costs at Qwen3-30B-A3B's
expert size (9 MiB bf16), for 1 / 8 / 32 missed experts:
  (a) the host sync of the routed ids (torch.unique + .tolist(), experts/routed.py) + copy-engine copies from
      pinned memory (planning/fetch_cost.py::ROUTED_LAYER_SYNC_S models the sync and launches);
  (b) the UVA gather kernel (kernels/uva_gather.py) reading mapped pinned memory, no sync; and path (b)'s decode
      of the compressed GPU tier's misses (kernels/lossless_decode.py::lossless_decode_indexed over 56 compressed
      experts, the planner's C at 24 GiB: the fixed grid's cost with no miss, then 1 / 8 / 32 decoded); and path
      (b) over a compressed host tier: the same decode reading 72 host experts' compressed arrays from mapped
      pinned memory (experts/tiers/host.py::mapped_layer), compressed GB/s against the gather's (its ratio is
      planning/fetch_cost.py::UVA_DECODE_PCIE_SHARE), each decoded page checked against its expert's bits.
    python benchmarks/bench_routed_fetch.py
"""
from __future__ import annotations

import time

import torch


def _ms(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3


def main() -> None:
    from pagedmoe.experts.tiers.host import pinned_empty
    from pagedmoe.kernels.uva_gather import gather_rows, plan_misses

    E, stride = 128, 3 * 768 * 2048
    src = pinned_empty((E, stride), torch.bfloat16, mapped=True)   # as the routed host tier with path (b)
    pool = torch.empty(64, stride, dtype=torch.bfloat16, device="cuda")
    topk = torch.randint(0, E, (1, 8), device="cuda")
    sync = _ms(lambda: torch.unique(topk).tolist(), reps=200)
    print(f"host sync of the routed ids: {sync * 1e3:.1f} us per layer (fetch_cost.ROUTED_LAYER_SYNC_S: 60 us "
          "with the launches)")
    slot_map0 = torch.full((E,), -1, dtype=torch.int32, device="cuda")
    plan = _ms(lambda: plan_misses(topk, slot_map0, 0, with_routed=True), reps=200)
    print(f"path (b)'s device plan of the misses: {plan * 1e3:.1f} us per layer, eager (fetch_cost."
          "ROUTED_UVA_LAYER_S: 15 us with the gather launch, in a graph)")
    gather_gbs = {}
    for n in (1, 8, 32):
        ids = list(range(n))

        def copy_engine():
            torch.unique(topk).tolist()
            for i, e in enumerate(ids):
                pool[i].copy_(src[e], non_blocking=True)

        slot_map = torch.full((E,), -1, dtype=torch.int64, device="cuda")
        t = torch.arange(n, device="cuda").reshape(1, n)
        uva = (lambda: gather_rows(src, pool, plan_misses(t, slot_map, 0)[0]))
        nbytes = n * stride * 2
        a, b = _ms(copy_engine), _ms(uva)
        gather_gbs[n] = nbytes / b / 1e6
        print(f"{n:>3} experts ({nbytes / 1e9:.3f} GB): copy engine + sync {a:.2f} ms ({nbytes / a / 1e6:.1f} GB/s), "
              f"UVA gather {b:.2f} ms ({nbytes / b / 1e6:.1f} GB/s)")
    del src
    decode_indexed(pool, stride)
    decode_mapped(pool, stride, gather_gbs)


def decode_indexed(pool: torch.Tensor, stride: int, num_compressed: int = 56) -> None:
    """Path (b)'s indexed decode: n of the layer's compressed experts into pages, the other parts' programs exit."""
    from pagedmoe.codecs.lossless import encode
    from pagedmoe.kernels.lossless_decode import lossless_decode_indexed, prepare_launch

    rows = (torch.randn(num_compressed, stride, device="cuda") * 0.02).bfloat16()
    ct = encode(rows, num_parts=num_compressed, checksum=False)
    prepare_launch(ct)
    del rows
    parts = torch.arange(num_compressed, device="cuda")
    for n in (0, 1, 8, 32):
        dst = torch.full((num_compressed,), -1, dtype=torch.int64, device="cuda")
        dst[:n] = torch.arange(n, device="cuda")
        t = _ms(lambda: lossless_decode_indexed(ct, pool, parts, dst), reps=50)
        nbytes = n * stride * 2
        rate = f" ({nbytes / t / 1e9:.2f} TB/s of bf16; fetch_cost: lossless_decode_bytes_per_s 1.5 TB/s)" if n else \
            " (the fixed grid with every program exiting: the floor per layer)"
        print(f"{n:>3} of {num_compressed} compressed experts decoded by path (b): {t * 1e3:.1f} us{rate}")


def decode_mapped(pool: torch.Tensor, stride: int, gather_gbs: dict, num_host: int = 72) -> None:
    """Path (b) over a compressed host tier: n of the layer's host experts decoded from mapped pinned memory."""
    from pagedmoe.codecs.lossless_groups import encode_groups
    from pagedmoe.experts.tiers.host import mapped_layer, pinned_empty
    from pagedmoe.kernels.lossless_decode import lossless_decode_indexed

    rows = (torch.randn(num_host, stride, device="cuda") * 0.02).bfloat16()
    # as the host tier holds it with path (b): one expert per group, the arrays in mapped pinned memory
    groups = encode_groups(lambda p, a, b: rows[p, a:b], num_host, stride, [(i, 1) for i in range(num_host)],
                           device=torch.device("cuda"), alloc=lambda shape, dtype: pinned_empty(shape, dtype, True))
    mapped = mapped_layer(groups, torch.device("cuda"))
    parts = torch.arange(num_host, dtype=torch.int32, device="cuda")
    for n in (1, 8, 32):
        dst = torch.full((num_host,), -1, dtype=torch.int64, device="cuda")
        dst[:n] = torch.arange(n, device="cuda")
        if n == 32:   # the decoder's knobs over PCIe (any value decodes the same bits)
            for warps in (1, 2, 4, 8, 16):
                for unroll in (1, 2, 4):
                    t = _ms(lambda: lossless_decode_indexed(mapped.ct, pool, parts, dst, num_warps=warps,
                                                            unroll=unroll), reps=10)
                    print(f"    num_warps {warps:>2} unroll {unroll}: {int(mapped.part_bytes[:n].sum()) / t / 1e6:.1f} "
                          "GB/s compressed")
        t = _ms(lambda: lossless_decode_indexed(mapped.ct, pool, parts, dst), reps=20)
        exact = all(torch.equal(pool[i, :stride], rows[i]) for i in range(n))
        comp = int(mapped.part_bytes[:n].sum())
        gbs = comp / t / 1e6
        print(f"{n:>3} compressed host experts decoded from mapped memory: {t:.2f} ms, {comp / 1e9:.3f} GB read "
              f"({comp / (n * stride * 2):.3f} of bf16) at {gbs:.1f} GB/s = {gbs / gather_gbs[n]:.2f} of the gather's "
              f"{gather_gbs[n]:.1f} GB/s ({n * stride * 2 / t / 1e6:.1f} GB/s of bf16); bit-exact: {exact}")


if __name__ == "__main__":
    main()
