"""How routed fetching (experts/routed.py) fills one cache page with one expert, from wherever its master copy
lives: only the routed misses move or decode, never a whole layer ("compressed tiers decode only what is
routed", issue 21).

- host tier, raw rows: the expert's row is copied from pinned host memory into its page;
- host tier, compressed (`--host-compression lossless`): every expert is its own group (HostTier with
  `group_experts=1`), so a miss copies only its compressed arrays into a device staging slot and the lossless
  decoder writes the bf16 weights into the page;
- compressed GPU tier (`--num-compressed-experts`): the expert's part of its layer's CompressedTensor is decoded
  into the page (no PCIe bytes at all).

Each fill runs on the current stream (on CUDA: the compute stream for on-demand misses, the copy stream for
prefetches); the copy into a staging slot and the decode reading it follow each other on that stream.
# NOTE: staging slot k % HOST_STAGING_SLOTS of the k-th host expert of the model is reused by any later fill
# on either stream; the pager orders the two streams' fills (prefetch_done / the fork event), so two fills
# never use a slot at once.
The decode gives the bits the encoder was given, so a page holds exactly what resident placement holds.
"""
from __future__ import annotations

from pagedmoe.experts.table import COMPRESSED, HOST

# the arrays of a CompressedTensor the decoder reads (the part word offsets stay on the host side)
_DECODED_ARRAYS = ("stream", "block_bit_offsets", "lane_bits", "raw")


class RoutedFill:
    def __init__(self, store) -> None:
        self.store = store
        self.n = store.expert_numel
        self.raw_bytes = store.expert_numel * store.dtype.itemsize    # bf16 (or the model dtype) bytes of one expert
        # a compressed host tier: expert id -> (its group's host CompressedTensor, its staging view)
        self._host_ct: list[dict] = [{} for _ in range(store.table.num_layers)]
        for layer in range(store.table.num_layers):
            groups = store.host_groups[layer] or []
            for (e0, k), ct, view in zip(groups, store.host_compressed[layer] or [], store.host_staging[layer] or []):
                if k != 1:
                    raise ValueError("routed fetching reads a compressed host tier one expert per group")
                self._host_ct[layer][e0] = (ct, view)

    def source(self, layer: int, expert: int) -> str:
        """'host' (raw rows), 'host-compressed' or 'compressed' (the GPU tier)."""
        tier = self.store.table.lookup(layer, expert).tier
        if tier == COMPRESSED:
            return "compressed"
        if tier != HOST:
            raise ValueError(f"routed fetching reads the host and compressed tiers, not {tier}")
        return "host-compressed" if expert in self._host_ct[layer] else "host"

    def moved_bytes(self, layer: int, expert: int) -> int:
        """Host -> device bytes of one fill."""
        src = self.source(layer, expert)
        if src == "host":
            return self.raw_bytes
        if src == "compressed":
            return 0
        ct, _ = self._host_ct[layer][expert]
        return sum(getattr(ct, name).numel() * getattr(ct, name).element_size() for name in _DECODED_ARRAYS)

    def decoded_bytes(self, layer: int, expert: int) -> int:
        return 0 if self.source(layer, expert) == "host" else self.raw_bytes

    def fill(self, layer: int, expert: int, page, non_blocking: bool) -> None:
        """Write the expert's weights into `page` ([stride], a row of the cache's pool)."""
        store, entry = self.store, self.store.table.lookup(layer, expert)
        src = self.source(layer, expert)
        if src == "host":
            page[:self.n].copy_(store.host[layer][entry.slot][:self.n], non_blocking=non_blocking)
            return
        from pagedmoe.kernels.lossless_decode import decode_runs  # triton: an optional package

        if src == "compressed":
            decode_runs(self._compressed(layer), [(entry.slot, entry.slot + 1, page[:self.n])])
            return
        ct, view = self._host_ct[layer][expert]
        for name in _DECODED_ARRAYS:
            getattr(view, name).copy_(getattr(ct, name), non_blocking=non_blocking)
        decode_runs(view, [(0, 1, page[:self.n])])

    def _compressed(self, layer: int):
        ct = self.store.compressed[layer]
        if ct is None:
            raise RuntimeError(f"MoE layer {layer}'s compressed experts are not encoded yet (ExpertStore.finalize)")
        return ct
