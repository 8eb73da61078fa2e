"""Dynamic precision's runtime (`--expert-precision dynamic`): each expert of a layer at its own rung.

A LayerVersion holds the exact rows, the lossless experts (exponent-Huffman CompressedTensors, one per run
of consecutive ids, decoded into their buffer rows) and one QuantizedLayer per lossy precision;
DynamicExperts builds new versions from the host master and publishes them atomically.

Shapes: E experts of a layer, H hidden, I intermediate (experts/layout.py).
"""
from __future__ import annotations

import contextlib
from typing import Optional, Sequence

import torch

from pagedmoe.codecs.lossless import LosslessLayout, encode
from pagedmoe.codecs.quant import LOSSY_PRECISIONS, QuantizedTensor, dequantize, expert_bytes, quantize
from pagedmoe.experts.dynamic.offline import OfflineForms
from pagedmoe.experts.layout import consecutive_runs, expert_views
from pagedmoe.experts.table import COMPRESSED, QUANTIZED, RESIDENT
from pagedmoe.experts.tiers.quantized import QuantizedLayer, stack_quantized


class LayerVersion:
    """One published state of a MoE layer under --expert-precision dynamic: its exact experts' rows
    (`exact_rows` [n, 3*I*H], model dtype, on the device), its lossless experts (`lossless`: (first expert
    id, CompressedTensor of k consecutive experts, one part each)) and one QuantizedLayer per lossy
    precision. Immutable once published: a change builds a new LayerVersion and swaps the reference."""

    def __init__(self, exact_ids: Sequence[int], exact_rows: Optional[torch.Tensor],
                 groups: dict[str, QuantizedLayer], hidden: int, inter: int, num_experts: int,
                 lossless: Sequence[tuple[int, object]] = ()) -> None:
        self.exact_ids, self.exact_rows, self.groups = list(exact_ids), exact_rows, groups
        self.lossless = list(lossless)
        self.precision = {e: "bf16" for e in self.exact_ids}
        for e0, ct in self.lossless:
            self.precision.update({e: "lossless" for e in range(e0, e0 + ct.num_parts)})
        for p, g in groups.items():
            self.precision.update({e: p for e in g.expert_ids})
        self._index = None
        if self.exact_ids:
            self._index = torch.tensor(self.exact_ids, dtype=torch.long, device=exact_rows.device)

        def slots(ids, device):
            s = torch.full((num_experts,), -1, dtype=torch.int32)
            s[list(ids)] = torch.arange(len(ids), dtype=torch.int32)
            return s.to(device)

        # (w13, w2, slots) per precision group, as kernels/fused_moe.py::fused_moe_mixed reads the layer under
        # --quantized-gemm direct: the exact rows' views and each lossy stack, with each expert's index in its
        # group (-1 elsewhere). NOTE: built here, with the version (on the builder's side stream), not inside
        # a forward: the slot maps' host->device copies would stall a layer. Lossless experts have no part
        # (they are decoded by fill()): DynamicExperts offers that rung only when fill() runs every forward.
        self.parts = []
        if self.exact_ids:
            self.parts.append((*expert_views(exact_rows, hidden, inter), slots(self.exact_ids, exact_rows.device)))
        for g in groups.values():
            self.parts.append((g.w13, g.w2, slots(g.expert_ids, g.device)))

    @property
    def nbytes(self) -> int:
        rows = self.exact_rows.numel() * self.exact_rows.element_size() if self.exact_ids else 0
        return rows + sum(g.nbytes for g in self.groups.values()) + sum(ct.nbytes for _, ct in self.lossless)

    def fill(self, packed: torch.Tensor) -> None:
        """Write every expert of the layer into the compute buffer packed [E, stride]. Sync-free."""
        if self.exact_ids:
            n = self.exact_rows.shape[1]
            packed[:, :n].index_copy_(0, self._index, self.exact_rows)
        if self.lossless:  # one launch per run, each part into its row (rows may be longer than a part)
            from pagedmoe.kernels.lossless_decode import decode_runs  # triton: an optional package

            for e0, ct in self.lossless:
                decode_runs(ct, [(0, ct.num_parts, packed[e0:e0 + ct.num_parts, :ct.part_size])])
        for g in self.groups.values():
            g.dequantize_into(packed)


def _expert_slices(q: QuantizedLayer, pos: int) -> tuple[QuantizedTensor, QuantizedTensor]:
    """The `pos`-th expert of a stacked QuantizedLayer as (w13, w2) QuantizedTensors (views)."""
    out = []
    for qt, N in ((q.w13, 2 * q.inter), (q.w2, q.hidden)):
        sl = slice(pos * N, (pos + 1) * N)
        out.append(QuantizedTensor(qt.precision, (N, qt.shape[1]), qt.data[sl], qt.scales[sl]))
    return out[0], out[1]


class DynamicExperts:
    """Every expert of every MoE layer at its own precision, built from a master copy in host memory.

    `master[l]` [E, stride] is the store's host tier (pinned on CUDA): the checkpoint's values in the
    model dtype, from which exact rows are copied and lossy forms quantised. Each MoE layer has one
    published LayerVersion; the pager fills the layer's compute buffer from it.

    build(changes) makes new versions of the touched layers *off the forward path*: on CUDA on a side
    stream, ending with an event; on CPU synchronously, between steps. publish() (a step boundary, once
    ready()) swaps the layers' references and updates the ExpertTable.
    # NOTE: a forward reads `versions[l]` once per layer fill; versions are swapped only between steps
    # and only after their build event completed (observed on the host), so a forward never sees a
    # half-written expert and the old version is no longer read when it is dropped (the step's results
    # reached the host before the swap).
    """

    # Lossless forms are encoded in runs of consecutive experts of at most this many bf16 bytes (bounds the
    # encoder's temporaries; each run is one CompressedTensor and one decode launch).
    LOSSLESS_RUN_BYTES = 256 << 20

    def __init__(self, store, master: Sequence[torch.Tensor], min_precision: str = "int4",
                 lossless: bool = True) -> None:
        self.store, self.master = store, list(master)
        self.num_layers, self.num_experts = store.table.num_layers, store.table.num_experts
        self.hidden, self.inter, self.numel = store.hidden, store.inter, store.expert_numel
        self.device, self.dtype = store.device, store.dtype
        self.keys = [(l, e) for l in range(self.num_layers) for e in range(self.num_experts)]
        self.versions: list[Optional[LayerVersion]] = [None] * self.num_layers
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._event = None
        self._staged: dict[int, LayerVersion] = {}
        self._errors: list[tuple[tuple[int, int], str, torch.Tensor]] = []
        self.min_precision = min_precision
        self.offline: Optional[OfflineForms] = None   # forms written by `pagedmoe compress --precisions`
        self.offline_hits = 0
        # The lossless rung (exact, ~0.68 of bf16): bf16 weights only, and only when every forward fills the
        # compute buffer (not under --quantized-gemm direct, whose GEMMs read the version's parts).
        self.lossless = lossless and self.dtype == torch.bfloat16
        self._lossless_bytes: Optional[int] = None

    def bytes_per_rung(self) -> dict[str, int]:
        elem = self.dtype.itemsize
        out = {"bf16": self.numel * elem}   # "bf16": the exact rung, in the model dtype
        if self.lossless:
            out["lossless"] = self.lossless_rung_bytes()
        out.update({p: expert_bytes(p, self.hidden, self.inter) for p in LOSSY_PRECISIONS})
        return out

    def lossless_rung_bytes(self) -> int:
        """Bytes the controller counts for one lossless expert: the largest compressed size among a few
        experts encoded at start-up (first and last layer, first and last expert), plus 2%. Compressed
        sizes are data dependent; the experts of one model are drawn alike, so the largest of the sample
        with a margin bounds the rest (the runtime's own total, `device_bytes`, is exact)."""
        if self._lossless_bytes is None:
            L, E, n = self.num_layers, self.num_experts, self.numel
            sample = sorted({(0, 0), (0, E - 1), (L - 1, 0), (L - 1, E - 1)})
            rows = torch.stack([self.master[l][e, :n] for l, e in sample]).to(self.device)
            ct = encode(rows, num_parts=len(sample), checksum=False)
            self._lossless_bytes = int(max(ct.part(i).nbytes for i in range(ct.num_parts)) * 1.02)
            del rows, ct
            if self.cuda:  # the encoder's temporaries: not kept reserved before the KV cache is sized
                torch.cuda.empty_cache()
        return self._lossless_bytes

    def precision(self, layer: int, expert: int) -> str:
        return self.versions[layer].precision[expert]

    @property
    def device_bytes(self) -> int:
        return sum(v.nbytes for v in self.versions if v is not None)

    # -- build / publish --------------------------------------------------------------------------
    def build_all(self, assignment) -> None:
        """The first versions (at start-up): built and published at once."""
        self.build(dict(assignment), full=True)
        if self._event is not None:
            self._event.synchronize()
        self.publish()

    def build(self, changes, full: bool = False) -> None:
        """Start building new versions of the layers `changes` ({(layer, expert): precision}) touches."""
        if self._staged:
            raise RuntimeError("a build is still waiting to be published")
        layers = sorted({l for l, _ in changes})
        if self.cuda and not full:
            # a build allocates on its own stream, whose pool cannot reuse what the compute stream cached
            # (the last step's activations): hand that back first, or the build's bytes come on top of it
            torch.cuda.empty_cache()
        if self.cuda:
            # the side stream must not start before what the compute stream queued (e.g. the loader);
            # taken before entering the side stream's context, where it would be the side stream itself
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        ctx = torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext()
        with ctx, torch.inference_mode():
            for layer in layers:
                old = self.versions[layer]
                want = [old.precision[e] if old is not None and not full else None for e in range(self.num_experts)]
                for (l, e), p in changes.items():
                    if l == layer:
                        want[e] = p
                if None in want:
                    raise ValueError(f"layer {layer}: a first build needs every expert's precision")
                self._staged[layer] = self._build_layer(layer, old if not full else None, want)
            if self.cuda:
                self._event = torch.cuda.Event()
                self._event.record(self.stream)

    # DynamicPrecisionManager builds and publishes one layer at a time (bounded transient), waiting for each.
    layer_by_layer = True

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()

    def ready(self) -> bool:
        return self._event is None or self._event.query()

    def publish(self) -> dict[tuple[int, int], dict[str, float]]:
        """Swap the built layers in; returns the measured relative weight error of each new lossy form."""
        if not self.ready():
            raise RuntimeError("publish() before the build finished")
        for layer, version in self._staged.items():
            self.versions[layer] = version
            for e in range(self.num_experts):
                p = version.precision[e]
                if p == "lossless":  # the compressed tier: exact, so its precision stays bf16
                    self.store.table.set_entry(layer, e, COMPRESSED, e, "bf16")
                else:
                    self.store.table.set_entry(layer, e, RESIDENT if p == "bf16" else QUANTIZED, e, p)
        measured: dict[tuple[int, int], dict[str, float]] = {}
        for key, p, err in self._errors:
            measured.setdefault(key, {})[p] = float(err)
        self._staged, self._errors, self._event = {}, [], None
        return measured

    def _build_layer(self, layer: int, old: Optional[LayerVersion], want: list[str]) -> LayerVersion:
        E, H, I, n = self.num_experts, self.hidden, self.inter, self.numel
        exact_ids = [e for e in range(E) if want[e] == "bf16"]
        if old is not None and exact_ids == old.exact_ids:
            exact_rows = old.exact_rows
        elif exact_ids:
            pos = {e: i for i, e in enumerate(old.exact_ids)} if old is not None else {}
            exact_rows = torch.empty(len(exact_ids), n, dtype=self.dtype, device=self.device)
            for i, e in enumerate(exact_ids):
                src = old.exact_rows[pos[e]] if e in pos else self.master[layer][e, :n]
                exact_rows[i].copy_(src, non_blocking=True)
        else:
            exact_rows = None
        lossless = self._build_lossless(layer, old, [e for e in range(E) if want[e] == "lossless"])
        groups = {}
        for p in sorted({q for q in want if q not in ("bf16", "lossless")}):
            ids = [e for e in range(E) if want[e] == p]
            prev = old.groups.get(p) if old is not None else None
            if prev is not None and prev.expert_ids == ids:
                groups[p] = prev
                continue
            kept = {e: i for i, e in enumerate(prev.expert_ids)} if prev is not None else {}
            parts13, parts2 = [], []
            for e in ids:
                if e in kept:
                    w13, w2 = _expert_slices(prev, kept[e])
                else:
                    w13, w2 = self._quantize_expert(layer, e, p)
                parts13.append(w13)
                parts2.append(w2)
            groups[p] = QuantizedLayer(p, H, I, ids, stack_quantized(parts13), stack_quantized(parts2))
        return LayerVersion(exact_ids, exact_rows, groups, H, I, E, lossless)

    def _build_lossless(self, layer: int, old: Optional[LayerVersion], ids: list[int]) -> list[tuple[int, object]]:
        """The layer's lossless experts as runs of consecutive ids (each at most LOSSLESS_RUN_BYTES of bf16),
        one CompressedTensor per run, encoded on the device from the master rows; a run the old version
        already holds is kept. The encoder reads its histogram on the host: a sync of the build (between
        steps, not of a forward)."""
        if ids and not self.lossless:
            raise ValueError("the lossless rung needs bf16 weights and buffers filled every forward "
                             "(not --quantized-gemm direct)")
        n = self.numel
        kept = {(e0, ct.num_parts): ct for e0, ct in (old.lossless if old is not None else ())}
        out = []
        for _, e0, k in consecutive_runs(ids, max(1, self.LOSSLESS_RUN_BYTES // (2 * n))):
            ct = kept.get((e0, k))
            if ct is None:
                rows = self.master[layer][e0:e0 + k, :n].to(self.device, non_blocking=True)
                # packing in chunks of ~2M weights: ~160 MB of encoder temporaries beside the running forwards
                ct = encode(rows, num_parts=k, checksum=False,
                            chunk_blocks=max(1, (1 << 21) // LosslessLayout().block_elems))
                if self.cuda:  # the fill's launch touches no host state
                    from pagedmoe.kernels.lossless_decode import prepare_launch  # triton: optional

                    prepare_launch(ct)
            out.append((e0, ct))
        return out

    def _quantize_expert(self, layer: int, e: int, p: str) -> tuple[QuantizedTensor, QuantizedTensor]:
        H, I = self.hidden, self.inter
        r = self.master[layer][e, :self.numel].to(self.device, non_blocking=True).float()
        w13, w2 = r[:2 * I * H].view(2 * I, H), r[2 * I * H:].view(H, I)
        forms = self.offline.get(layer, e, p) if self.offline is not None else None
        if forms is not None:
            self.offline_hits += 1
            q13, q2 = (QuantizedTensor(q.precision, q.shape, q.data.to(self.device, non_blocking=True),
                                       q.scales.to(self.device, non_blocking=True)) for q in forms)
        else:
            q13, q2 = quantize(w13, p), quantize(w2, p)
        # relative weight error, kept on the device until publish (no sync on the side stream)
        d = (dequantize(q13, torch.float32) - w13).pow(2).sum() + (dequantize(q2, torch.float32) - w2).pow(2).sum()
        self._errors.append(((layer, e), p, (d / r.pow(2).sum().clamp_min(1e-30)).sqrt()))
        return q13, q2
