"""Resident placement's experts object: every expert in device memory, read in place (no copies).

The MoE layers call it through the expert interface (experts/interface.py); forwards and layers need no
preparation, so begin_forward / before_layer / done do nothing. The store (experts/store.py) holds each
layer's experts packed [E, stride] on the device.
"""
from __future__ import annotations

from typing import Optional

import torch

from pagedmoe.experts.interface import DenseOperand


class ResidentExperts:
    def __init__(self, store, activity=None) -> None:
        self.store = store
        self.activity = activity   # ActivityTable (optional): counts the router's ids, on the device

    def begin_forward(self, num_tokens: Optional[int] = None) -> None:
        pass

    def before_layer(self, layer: int) -> None:
        pass

    def weights(self, layer: int, topk_ids: Optional[torch.Tensor] = None, counted: bool = False) -> DenseOperand:
        if self.activity is not None and topk_ids is not None and not counted:
            self.activity.record(layer, topk_ids)
        return DenseOperand(*self.store.views(layer))

    def done(self, layer: int) -> None:
        pass
