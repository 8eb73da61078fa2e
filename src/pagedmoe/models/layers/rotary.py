"""Rotary position embedding ("default" rope type), cos/sin precomputed per position in float32.

Layout: half-split (rotate_half, as in transformers' Llama/Qwen/GLM-4.5), not interleaved pairs. With a
partial rotary (GLM-4.5: partial_rotary_factor 0.5) only the first `rotary_dim` dims of each head rotate,
half-split within them; the rest pass through unchanged.
"""
from __future__ import annotations

import torch
from torch import nn


def rope_theta_of(hf_config) -> float:
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise NotImplementedError(f"rope_type {rope_type!r} is not supported yet (only 'default')")
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        raise ValueError("config has no rope_theta")
    return float(theta)


def partial_rotary_factor_of(hf_config) -> float:
    """transformers v5 keeps it in rope_parameters; older configs had it at the top level."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None))
    return 1.0 if factor is None else float(factor)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float, rotary_dim: int = 0) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim or head_dim  # 0: the whole head rotates
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= head_dim:
            raise ValueError(f"rotary_dim {self.rotary_dim} must be even and in (0, head_dim={head_dim}]")
        self.max_position = max_position
        self.theta = theta
        self.register_buffer("cos_sin", torch.empty(0), persistent=False)
        # Every layer of one forward rotates at the same positions: gather cos/sin once per forward.
        self._cached: tuple = (None, None, None, None)

    def build(self, device: torch.device) -> None:
        dim = self.rotary_dim
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device)
                                         .float() / dim))
        pos = torch.arange(self.max_position, device=device, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos_sin = torch.stack((emb.cos(), emb.sin()))  # [2, P, rotary_dim]

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q [T, Hq, D], k [T, Hkv, D] -> rotated copies (same dtypes)."""
        cos, sin = self._cos_sin(positions, q.dtype)
        if self.rotary_dim == self.head_dim:
            return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        r = self.rotary_dim
        q_rot, k_rot = q[..., :r], k[..., :r]
        q = torch.cat((q_rot * cos + _rotate_half(q_rot) * sin, q[..., r:]), dim=-1)
        k = torch.cat((k_rot * cos + _rotate_half(k_rot) * sin, k[..., r:]), dim=-1)
        return q, k


    def _cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        cached_positions, cached_dtype, cos, sin = self._cached
        # NOTE: keyed on the positions tensor object, which the model passes unchanged to every
        # layer; holding it keeps its id from being reused by a later step's tensor.
        if cached_positions is not positions or cached_dtype != dtype:
            cos = self.cos_sin[0, positions].unsqueeze(1).to(dtype)
            sin = self.cos_sin[1, positions].unsqueeze(1).to(dtype)
            self._cached = (positions, dtype, cos, sin)
        return cos, sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
