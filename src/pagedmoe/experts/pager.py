"""The pager: paged placement's experts object (the expert interface, experts/interface.py) and its
prefetch pipeline: layer l+1's experts are copied into its compute buffer while layer l computes. What
each layer's fill copies, decodes and dequantises is planned once (experts/fill_plan.py).

On CUDA the copies run on a dedicated copy stream and are ordered by events, with no host sync:

    compute stream:  [attn l] [wait loaded[l]] [MoE l] (record free[l % 2]) [attn l+1] ...
    copy stream:        (wait free[(l+1) % 2])  [copy layer l+1 rows] (record loaded[l+1])

# NOTE: buffer (l+1) % 2 was last read by layer l-1's MoE; the copy stream waits for the event
# recorded after that MoE before overwriting it. The first copy of a forward waits on a fork event
# recorded on the compute stream, so a CUDA-graph capture sees the copy stream join and leave it.

Compressed-tier experts (experts/store.py) are decoded into their buffer rows on a second side stream, the
decode stream, which waits for the same free event and records decoded[l] (the compute stream waits for
both): the SMs decode while the copy engine streams the host experts, instead of after them. Quantized
experts are dequantised there too. A compressed *host* tier's decodes stay on the copy stream, after the
copies they read; dynamic precision fills from device memory only and keeps the copy stream. The decode
stream joins a forward (waits on the fork) only when a layer first uses it: a stream that joined a
CUDA-graph capture must be joined back before the capture ends. The decoder is the Triton kernel
(kernels/lossless_decode.py): one launch per run of consecutive expert ids (a whole layer with the first-N
placement), each part into its buffer row, whatever the rows' padding (VMM rows are rounded up to 2 MiB:
Qwen3-30B-A3B's 9 MiB experts sit 10 MiB apart). The decoder reads only device memory and never syncs.

With ring buffers (`--expert-buffers vmm-ring`, experts/buffers.py) streamed rows rotate through one ring
of S rows instead of two per-layer slots: layer j's copy waits only for the layer that last used its ring
rows (free[m(j)], m(j) = the layer of row k - S for j's last row k) and is issued right after that
layer's MoE, so a layer with host experts late in the model starts copying many layers ahead; the layers
whose rows were not used earlier in the forward are issued at its start, after the fork.

On CPU the same calls copy (and decode, with the reference decoder) synchronously when the layer
asks for its weights.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

from typing import Optional

import torch

from pagedmoe.experts.interface import (TRITON_MAX_TOKENS, DenseOperand, ExpertOperand, MixedOperand,
                                       QuantizedOperand)
from pagedmoe.experts.fill_plan import FillPlan
from pagedmoe.experts.store import ExpertStore
from pagedmoe.experts.table import COMPRESSED
from pagedmoe.planning.cost_model import ring_wait_layers


@dataclass
class PagerStats:
    bytes_h2d: int = 0          # host -> device, paged experts
    bytes_d2d: int = 0          # resident rows copied into a shared buffer (plain double buffer only)
    bytes_decoded: int = 0      # bf16 bytes decoded from the compressed tier into the buffers
    bytes_dequantized: int = 0  # buffer-dtype bytes dequantised from the quantized tier into the buffers
    copy_s: float = 0.0         # time the copy stream spent copying (CUDA events)
    wait_s: float = 0.0         # time the compute stream waited for experts (CUDA events)
    layers_loaded: int = 0
    steps: int = 0
    timed_steps: int = 0        # steps whose copies copy_s / wait_s timed (eager; graph replays are not timed)
    timed_bytes_h2d: int = 0    # their host -> device bytes: the copy rate is timed_bytes_h2d / copy_s

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class ExpertPager:
    def __init__(self, store: ExpertStore, timing: bool = True, direct_quantized: bool = False,
                 activity=None) -> None:
        self.store = store
        self.activity = activity   # ActivityTable (optional): counts the router's ids, on the device
        # --quantized-gemm direct: forwards of few tokens leave the quantized experts as they are and the
        # MoE layer multiplies them directly (weights() hands it the quantized operand); set per forward.
        self.direct_quantized = direct_quantized
        self._direct_max_tokens = TRITON_MAX_TOKENS  # larger forwards dequantise for grouped_mm
        self._direct = False
        self.num_layers = store.table.num_layers
        self.cuda = store.device.type == "cuda"
        self.stats = PagerStats()
        self.timing = timing and self.cuda
        # NOTE: the fill plan holds views of the host rows; it is built on first use, after loading, so
        # a host tier compressed at ExpertStore.finalize can free its raw rows layer by layer.
        self._planned = False
        self.fill: Optional[FillPlan] = None
        self.ring = self.cuda and getattr(store.buffers, "ring", False)
        if self.ring:
            self._wait_layer = ring_wait_layers(store.buffers.streamed_rows, store.buffers.ring_size)
            self._issue_after = [[j for j, m in enumerate(self._wait_layer) if m == layer]
                                 for layer in range(self.num_layers)]
            self._issue_first = [j for j, m in enumerate(self._wait_layer) if m < 0]
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(store.device)
            # GPU-tier fills that need no host bytes (lossless decodes, dequantisation) run on their own
            # stream, beside the copy engine's H2D copies instead of after them.
            self.decode_stream = torch.cuda.Stream(store.device)
            ev = (lambda: torch.cuda.Event(enable_timing=self.timing))
            self.loaded = [ev() for _ in range(self.num_layers)]
            self.decoded = [ev() for _ in range(self.num_layers)]
            self.copy_start = [ev() for _ in range(self.num_layers)]
            self.want = [ev() for _ in range(self.num_layers)]
            self.free = [torch.cuda.Event() for _ in range(self.num_layers if self.ring else 2)]
            self.fork = torch.cuda.Event()
        self._issued: list[bool] = [False] * self.num_layers
        self._on_decode_stream: list[bool] = [False] * self.num_layers   # this forward, per layer
        self._pending_timing: list[tuple[int, bool]] = []
        self._timed_h2d = 0  # host -> device bytes of this step's timed copies (folded in by end_step)
        self._skip_host = False
        self._fused_slots: dict[int, tuple] = {}   # --compressed-gemm fused: per layer, the parts' slot maps

    def refresh(self) -> None:
        """Drop the fill plan: it is rebuilt from the store on next use (after ExpertStore.finalize, which
        may have compressed the host tier)."""
        self._planned = False
        self.fill = None

    def _plan(self) -> None:
        """Build the host-side plan of every layer's fill from the store (experts/fill_plan.py)."""
        if self._planned:
            return
        self._planned = True
        self.fill = FillPlan(self.store)
        if self.store.compressed_tier.fused:  # the slot maps on the device now: never inside a graph capture
            for layer in range(self.num_layers):
                if self.store.compressed[layer] is not None:
                    self._fused_parts(layer)

    # -- called by the model ----------------------------------------------------------------------
    def begin_forward(self, num_tokens: Optional[int] = None) -> None:
        """A forward of `num_tokens` tokens starts (None: unknown, so the experts are dequantised)."""
        self._direct = (self.direct_quantized and num_tokens is not None
                        and num_tokens <= self._direct_max_tokens)
        self._plan()
        self._issued = [False] * self.num_layers
        self._on_decode_stream = [False] * self.num_layers
        if self.ring:
            # NOTE: every copy of the forward follows the fork: the previous forward's reads are done.
            self.fork.record()
            self.copy_stream.wait_event(self.fork)
            for j in self._issue_first:
                self._issue(j)
            return
        if self.cuda:
            # Everything before this point on the compute stream (earlier MoE reads of both buffers
            # included) precedes these events, so both buffers count as free from here; recording
            # them here keeps every event a CUDA-graph capture waits on inside that capture.
            self.fork.record()
            self.free[0].record()
            self.free[1].record()
            self.copy_stream.wait_event(self.fork)
        self._issue(0)

    def before_layer(self, layer: int) -> None:
        """Start of MoE layer `layer`'s decoder layer (before its attention): prefetch the next one."""
        if not self.ring and layer + 1 < self.num_layers:
            self._issue(layer + 1)

    def weights(self, layer: int, topk_ids: Optional[torch.Tensor] = None, counted: bool = False) -> ExpertOperand:
        """The layer's expert operand, once its experts are in place (the compute stream waits). `topk_ids`
        [T, A] (the router's ids, a device tensor: never read on the host) go to the activity table (unless
        the router `counted` them there)."""
        if self.activity is not None and topk_ids is not None and not counted:
            self.activity.record(layer, topk_ids)
        if not self._issued[layer]:
            self._issue(layer)
        if self.cuda:
            if self.timing and not torch.cuda.is_current_stream_capturing():
                self.want[layer].record()
                self._pending_timing.append((layer, self._on_decode_stream[layer]))
            torch.cuda.current_stream().wait_event(self.loaded[layer])
            if self._on_decode_stream[layer]:
                torch.cuda.current_stream().wait_event(self.decoded[layer])
        if self._direct:
            dyn = self.store.dynamic
            if dyn is not None:  # NOTE: the published version; a publish happens only between steps
                return MixedOperand(dyn.versions[layer].parts)
            q = self.store.quantized[layer]   # every expert of the layer quantized, in id order
            return QuantizedOperand(q.w13, q.w2)
        if self.store.compressed_tier.fused and self.store.compressed[layer] is not None:
            return MixedOperand(self._fused_parts(layer))
        return DenseOperand(*self.store.views(layer))

    def _fused_parts(self, layer: int) -> list[tuple]:
        """--compressed-gemm fused*: the layer's buffer rows (resident and host experts; the compressed experts'
        rows are never written and their blocks skipped) and its compressed experts in format v2 (or hibyte, as
        launchers of the tier's kernel), each with its slot map [E] (fused_moe_mixed): one MoE call, no decode."""
        if layer not in self._fused_slots:
            table, E = self.store.table, self.store.table.num_experts
            comp = {e: table.lookup(layer, e).slot for e in table.ids(layer, COMPRESSED)}
            dense = torch.tensor([-1 if e in comp else e for e in range(E)], dtype=torch.int32)
            tiled = torch.tensor([comp.get(e, -1) for e in range(E)], dtype=torch.int32)
            self._fused_slots[layer] = (dense.to(self.store.device), tiled.to(self.store.device))
        dense, tiled = self._fused_slots[layer]
        w13, w2 = self.store.views(layer)
        t = self.store.compressed[layer]
        return [(w13, w2, dense), (*t.gemm_operands(), tiled)]

    def done(self, layer: int) -> None:
        """The layer's MoE GEMMs are issued: its buffer may be overwritten after they finish."""
        if self.ring:
            self.free[layer].record()
            for j in self._issue_after[layer]:  # the layers whose ring rows this one was the last to read
                self._issue(j)
        elif self.cuda:
            self.free[layer % 2].record()

    @contextlib.contextmanager
    def no_host_copies(self):
        """Forwards whose outputs are thrown away (CUDA-graph warm-ups) skip the host-tier copies: a fully
        paged Mixtral forward streams 84 GiB (1.6 s), and two warm-ups for each of 15 graph sizes would
        cost ~50 s. Everything else still runs (events, decodes, dequantisation: their kernels compile
        here, not inside a capture); nothing is counted in the stats."""
        self._skip_host = True
        try:
            yield
        finally:
            self._skip_host = False

    # -- copies -----------------------------------------------------------------------------------
    def _issue(self, layer: int) -> None:
        self._plan()
        self._issued[layer] = True
        h2d_before = self.stats.bytes_h2d
        if not (self._skip_host or (self.cuda and torch.cuda.is_current_stream_capturing())):
            self._account(layer)
        if not self.cuda:
            self._fill_copies(layer)
            if self._device_work(layer):
                self._fill_on_device(layer)
            return
        with torch.cuda.stream(self.copy_stream):
            self._wait_free(self.copy_stream, layer)
            if self.timing and not torch.cuda.is_current_stream_capturing():
                self.copy_start[layer].record()
                self._timed_h2d += self.stats.bytes_h2d - h2d_before  # the bytes these events time
            self._fill_copies(layer)
            self.loaded[layer].record()
        if self._device_work(layer):
            # NOTE: the decode stream joins the forward (waits on the fork) only when a layer first uses it:
            # a stream that joined a CUDA-graph capture must be joined back before the capture ends.
            if not any(self._on_decode_stream):
                self.decode_stream.wait_event(self.fork)
            with torch.cuda.stream(self.decode_stream):
                self._wait_free(self.decode_stream, layer)
                self._fill_on_device(layer)
                self.decoded[layer].record()
            self._on_decode_stream[layer] = True

    def _wait_free(self, stream, layer: int) -> None:
        """`stream` may write layer `layer`'s buffer rows once the MoE that last read them is done."""
        if not self.ring:
            stream.wait_event(self.free[layer % 2])
        elif self._wait_layer[layer] >= 0:
            stream.wait_event(self.free[self._wait_layer[layer]])

    def _device_work(self, layer: int) -> bool:
        return self.fill.device_work(layer, self._direct)

    def _fill_copies(self, layer: int) -> None:
        self.fill.fill_copies(layer, self._skip_host, self.cuda, self._direct)

    def _fill_on_device(self, layer: int) -> None:
        self.fill.fill_on_device(layer, self._direct)

    def reset_stats(self) -> None:
        self.stats = PagerStats()
        self._pending_timing.clear()
        self._timed_h2d = 0

    def _account(self, layer: int) -> None:
        dyn = self.store.dynamic
        if dyn is not None and self._direct:
            self.stats.layers_loaded += 1
            return
        if dyn is not None:
            v = dyn.versions[layer]
            elem = self.store.dtype.itemsize
            n_exact, n_lossless = len(v.exact_ids), sum(ct.num_parts for _, ct in v.lossless)
            one = self.store.expert_numel * elem
            self.stats.bytes_d2d += n_exact * one
            self.stats.bytes_decoded += n_lossless * one
            self.stats.bytes_dequantized += (self.store.table.num_experts - n_exact - n_lossless) * one
            self.stats.layers_loaded += 1
            return
        h2d, d2d = self.fill.bytes_per_layer[layer]
        self.stats.bytes_h2d += h2d
        self.stats.bytes_d2d += d2d
        self.stats.bytes_decoded += self.fill.decoded_per_layer[layer]
        if not self._direct:
            self.stats.bytes_dequantized += self.fill.dequantized_per_layer[layer]
        self.stats.layers_loaded += 1

    def account_replay(self) -> None:
        """A CUDA-graph replay moved every layer's experts without running this Python code."""
        self._direct = self.direct_quantized  # graphs hold decode steps, far below TRITON_MAX_TOKENS
        self._plan()
        for layer in range(self.num_layers):
            self._account(layer)

    @property
    def bytes_per_forward(self) -> int:
        self._plan()
        return sum(h for h, _ in self.fill.bytes_per_layer)

    @property
    def decoded_bytes_per_forward(self) -> int:
        self._plan()
        return sum(self.fill.decoded_per_layer)

    @property
    def dequantized_bytes_per_forward(self) -> int:
        self._plan()
        return sum(self.fill.dequantized_per_layer)

    def abort_step(self) -> None:
        """A step that failed part-way (out of memory): drop its timing events, some never recorded."""
        self._pending_timing.clear()
        self._timed_h2d = 0

    def end_step(self) -> None:
        """After the step's results reached the host (all events done): fold event timings into stats."""
        self.stats.steps += 1
        timed_h2d, self._timed_h2d = self._timed_h2d, 0
        if not self._pending_timing:
            return
        self.stats.timed_steps += 1
        self.stats.timed_bytes_h2d += timed_h2d
        for layer, decoded in self._pending_timing:
            self.stats.copy_s += self.copy_start[layer].elapsed_time(self.loaded[layer]) / 1e3
            waited = self.want[layer].elapsed_time(self.loaded[layer]) / 1e3
            if decoded:
                waited = max(waited, self.want[layer].elapsed_time(self.decoded[layer]) / 1e3)
            self.stats.wait_s += max(0.0, waited)
        self._pending_timing.clear()

