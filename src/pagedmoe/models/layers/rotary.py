"""Rotary position embedding, cos/sin precomputed per position in float32.

Layout: half-split (rotate_half, as in transformers' Llama/Qwen/GLM-4.5) by default. With a partial
rotary (GLM-4.5: partial_rotary_factor 0.5) only the first `rotary_dim` dims of each head rotate,
half-split within them; the rest pass through unchanged. `interleaved=True` is DeepSeek's layout:
pairs (x0, x1), (x2, x3), ... each rotate by one frequency, and the result is written half-split
(first the rotated evens, then the odds), as transformers' apply_rotary_pos_emb_interleave does;
DeepSeek-V2's complex-number form gives the same pairs interleaved, a permutation applied to q and k
alike, so q.k is unchanged.

Rope types: "default" and "yarn" (DeepSeek-V2/V3: interpolated inverse frequencies and an attention
factor that scales cos/sin; `yarn_inv_freq` follows transformers' _compute_yarn_parameters).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn


def rope_parameters_of(hf_config) -> dict:
    """The rope dict with rope_type and rope_theta filled in (transformers v5 or older configs)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        raise ValueError("config has no rope_theta")
    params["rope_theta"] = float(theta)
    if params["rope_type"] == "yarn":
        params.setdefault("original_max_position_embeddings", hf_config.max_position_embeddings)
        if params.get("factor") is None:  # transformers: the config's length over the original one
            params["factor"] = hf_config.max_position_embeddings / params["original_max_position_embeddings"]
    elif params["rope_type"] != "default":
        raise NotImplementedError(f"rope_type {params['rope_type']!r} is not supported (only 'default', 'yarn')")
    return params


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(dim: int, params: dict, max_position: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [dim / 2] float32, attention factor) of YaRN, as transformers computes them."""
    base = params["rope_theta"]
    factor = params.get("factor")
    orig = params["original_max_position_embeddings"]
    if factor is None:
        factor = max_position / orig
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_get_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(orig / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singularity
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


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
    def __init__(self, head_dim: int, max_position: int, theta: float, rotary_dim: int = 0,
                 rope_parameters: Optional[dict] = None, interleaved: bool = False) -> None:
        super().__init__()
        self.rope_parameters = dict(rope_parameters or {"rope_type": "default", "rope_theta": theta})
        self.interleaved = interleaved
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim or head_dim  # 0: the whole head rotates
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= head_dim:
            raise ValueError(f"rotary_dim {self.rotary_dim} must be even and in (0, head_dim={head_dim}]")
        if interleaved and self.rotary_dim != head_dim:
            raise ValueError("interleaved rope rotates the whole head (no partial rotary)")
        self.max_position = max_position
        self.theta = theta
        self.register_buffer("cos_sin", torch.empty(0), persistent=False)
        # Every layer of one forward rotates at the same positions: gather cos/sin once per forward.
        self._cached: tuple = (None, None, None, None)

    def build(self, device: torch.device) -> None:
        dim = self.rotary_dim
        scaling = 1.0
        if self.rope_parameters["rope_type"] == "yarn":
            inv_freq, scaling = yarn_inv_freq(dim, self.rope_parameters, self.max_position)
            inv_freq = inv_freq.to(device)
        else:
            inv_freq = 1.0 / (self.theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device)
                                             .float() / dim))
        pos = torch.arange(self.max_position, device=device, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos_sin = torch.stack((emb.cos() * scaling, emb.sin() * scaling))  # [2, P, rotary_dim]

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q [T, Hq, D], k [T, Hkv, D] -> rotated copies (same dtypes)."""
        cos, sin = self._cos_sin(positions, q.dtype)
        if self.interleaved:
            return _rotate_pairs(q, cos, sin), _rotate_pairs(k, cos, sin)
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


def _rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved pairs rotated, written half-split (transformers' apply_rotary_pos_emb_interleave)."""
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
