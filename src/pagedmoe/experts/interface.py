"""The expert interface: what a MoE layer sees of the expert subsystem.

Shapes: T tokens, A active experts per token, E experts, H hidden, I expert intermediate size.

The model is built with one experts object (experts/tiers/resident.py's ResidentExperts, or the pager,
experts/pager.py); per forward the model and its MoE layers call, in order:

    begin_forward(num_tokens)             the forward starts (the pager forks its side streams)
    before_layer(layer)                   decoder layer `layer` starts, before its attention (prefetch)
    weights(layer, topk_ids, counted) -> operand   after routing: what the expert GEMMs read
    done(layer)                           the GEMMs reading the operand are issued (buffers may be reused)

`topk_ids` [T, A] are the router's expert ids as a device tensor: never read on the host (no sync), so
the experts object can act on them (the activity table counts them, unless `counted`: the fused router
kernel added them to the table's row itself; a routing-aware pager can fetch what is routed). `layer` is the MoE layer index (the expert table's), not the decoder layer index.

An ExpertOperand is a tagged type; the MoE layer dispatches on `kind`:
- "dense":     w13 [E, 2I, H], w2 [E, H, I] tensors of the model dtype (grouped_mm / Triton / loop); or,
               with `slots` [E] (routed fetching), the expert cache's pool indexed through the slot map;
- "quantized": every expert of the layer quantized in id order (QuantizedTensors w13, w2:
               kernels/fused_moe.py::fused_moe_quantized, `--quantized-gemm direct`, static precision);
- "mixed":     one (w13, w2, slots) part per precision group (kernels/fused_moe.py::fused_moe_mixed,
               `--quantized-gemm direct` under dynamic precision).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional, Protocol, Sequence, Union

import torch

# Up to this many tokens the Triton kernels win on the H200 (Mixtral-8x7B decode step at batch 64:
# 31.7 ms vs 44.0 ms with grouped_mm); larger prefill chunks run faster through grouped_mm
# (18.0k vs 11.6k prefill tokens/s at 16k-token chunks). docs/benchmarks.md has the figures. The pager
# reads it too: under --quantized-gemm direct, larger forwards dequantise for grouped_mm.
# PAGEDMOE_TRITON_MAX_TOKENS moves the crossover for measurements (benchmarks/gpu_issue25.sh prefill-variants).
TRITON_MAX_TOKENS = int(os.environ.get("PAGEDMOE_TRITON_MAX_TOKENS", "512"))


@dataclass(frozen=True)
class DenseOperand:
    w13: torch.Tensor   # [E, 2I, H]
    w2: torch.Tensor    # [E, H, I]
    # --expert-fetch routed (experts/cache.py): w13/w2 are the expert cache's pool [S, ...] and `slots` [E] int32
    # maps an expert id to its page (the MoE layer maps its router ids through it); None: indexed by id
    slots: Optional[torch.Tensor] = None
    kind: str = "dense"


@dataclass(frozen=True)
class QuantizedOperand:
    w13: Any            # codecs/quant.QuantizedTensor, the E experts' [2I, H] stacked
    w2: Any             # codecs/quant.QuantizedTensor, the E experts' [H, I] stacked
    kind: str = "quantized"


@dataclass(frozen=True)
class MixedOperand:
    parts: Sequence[tuple]   # (w13, w2, slots [E] int32: index in the part, -1 elsewhere) per precision
    kind: str = "mixed"


ExpertOperand = Union[DenseOperand, QuantizedOperand, MixedOperand]


class ExpertsProvider(Protocol):
    """What the model is built with (experts/tiers/resident.py::ResidentExperts, experts/pager.py)."""

    store: Any   # the ExpertStore: the loader's sink for expert tensors, and the tiers' bytes

    def begin_forward(self, num_tokens: int) -> None: ...

    def before_layer(self, layer: int) -> None: ...

    def weights(self, layer: int, topk_ids: torch.Tensor, counted: bool = False) -> ExpertOperand: ...

    def done(self, layer: int) -> None: ...
