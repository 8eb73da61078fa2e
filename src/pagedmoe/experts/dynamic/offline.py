"""Lossy expert forms written offline by `pagedmoe compress --precisions`, and read back by dynamic precision."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pagedmoe.codecs.quant import QuantizedTensor, dequantize, quantize

LOSSY_DIR = "expert-lossy"   # inside the model folder: the checkpoint loader reads top-level files only


def offline_forms_of_store(store, precisions, out, device) -> Path:
    """Quantise every expert row of `store` (its master rows) at each precision and write
    OUT/expert-lossy/<p>.safetensors ('<layer>.<expert>.<w13|w2>.<data|scales>') and quality.json
    (relative weight error per expert and precision: the compress-time quality cost)."""
    folder = Path(out) / LOSSY_DIR
    folder.mkdir(parents=True, exist_ok=True)
    L, E, H, I, n = store.table.num_layers, store.table.num_experts, store.hidden, store.inter, store.expert_numel
    rel: dict[tuple[int, int], dict[str, float]] = {}
    for p in precisions:
        tensors = {}
        for layer in range(L):
            for e in range(E):
                r = store.row(layer, e)[:n].to(device).float()
                w13, w2 = r[:2 * I * H].view(2 * I, H), r[2 * I * H:].view(H, I)
                q13, q2 = quantize(w13, p), quantize(w2, p)
                d = (dequantize(q13, torch.float32) - w13).pow(2).sum() + \
                    (dequantize(q2, torch.float32) - w2).pow(2).sum()
                rel.setdefault((layer, e), {})[p] = (d / r.pow(2).sum().clamp_min(1e-30)).sqrt().item()
                for tag, q in (("w13", q13), ("w2", q2)):
                    tensors[f"{layer}.{e}.{tag}.data"] = q.data.cpu().contiguous()
                    tensors[f"{layer}.{e}.{tag}.scales"] = q.scales.cpu().contiguous()
        save_file(tensors, str(folder / f"{p}.safetensors"),
                  metadata={"precision": p, "hidden": str(H), "inter": str(I), "layers": str(L), "experts": str(E)})
    (folder / "quality.json").write_text(json.dumps(
        {"precisions": list(precisions), "rel_error": [[l, e, v] for (l, e), v in sorted(rel.items())]}))
    return folder


class OfflineForms:
    """Reads the forms `offline_forms_of_store` wrote; DynamicExperts takes a form from here instead of
    quantising it (the same values: quantisation is deterministic)."""

    def __init__(self, folder, hidden: int, inter: int) -> None:
        self.hidden, self.inter = hidden, inter
        self.files = {}
        for p in ("fp8", "int8", "int4"):
            f = folder / f"{p}.safetensors"
            if f.is_file():
                h = safe_open(str(f), framework="pt", device="cpu")
                meta = h.metadata() or {}
                if (meta.get("hidden"), meta.get("inter")) != (str(hidden), str(inter)):
                    raise ValueError(f"{f}: lossy forms of experts H={meta.get('hidden')}, I={meta.get('inter')}; "
                                     f"this model has H={hidden}, I={inter}")
                self.files[p] = h
        q = folder / "quality.json"
        self.quality = json.loads(q.read_text()) if q.is_file() else None

    @classmethod
    def open(cls, model_folder, hidden: int, inter: int) -> Optional["OfflineForms"]:
        folder = Path(model_folder) / LOSSY_DIR
        return cls(folder, hidden, inter) if folder.is_dir() else None

    def rel_error(self) -> Optional[dict]:
        if self.quality is None:
            return None
        return {(int(l), int(e)): dict(v) for l, e, v in self.quality["rel_error"]}

    def get(self, layer: int, e: int, p: str) -> Optional[tuple[QuantizedTensor, QuantizedTensor]]:
        h = self.files.get(p)
        if h is None:
            return None
        out = []
        for tag, shape in (("w13", (2 * self.inter, self.hidden)), ("w2", (self.hidden, self.inter))):
            out.append(QuantizedTensor(p, shape, h.get_tensor(f"{layer}.{e}.{tag}.data"),
                                       h.get_tensor(f"{layer}.{e}.{tag}.scales")))
        return out[0], out[1]
