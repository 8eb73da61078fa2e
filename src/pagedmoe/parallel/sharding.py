"""One rank's share of the model: its ModelDims / ArchSpec, and the slice of a checkpoint tensor it holds.

Tensor parallelism over N ranks (Megatron's split, as vLLM does it):
- attention: q/k/v column-parallel (each rank its Hq/N query heads and their KV heads), o_proj row-parallel;
  with fewer KV heads than ranks each KV head is replicated on N/Hkv ranks (rank r holds head r*Hkv//N);
  multi-head latent attention (DeepSeek-V2/V3): the latent projection (kv_a_proj_with_mqa, q_a_proj and their
  norms) and so the latent KV cache replicated, the per-head q_b_proj / kv_b_proj rows column-parallel, o_proj
  row-parallel (each rank attends with its H/N heads over the whole latent, as vLLM splits MLA);
- dense MLPs and shared experts: gate/up column-parallel, down row-parallel;
- routed experts: each expert split along its intermediate dim (w13 rows, w2 columns), or with
  `--enable-expert-parallel` whole experts, E/N per rank (rank r owns experts [r*E/N, (r+1)*E/N));
- embedding, router, norms and LM head replicated: the LM head's logits are then whole on every rank
  with no gather (the vocabulary-parallel split saves V*H/N bytes a rank, 0.25 GiB for Mixtral at N=2, at
  the price of a gather per step).
A decoder layer all-reduces the attention output and the FFN output (routed + shared partial sums):
two all-reduces a layer. So that the engine and `pagedmoe plan` agree, both take a rank's dims here.
"""
from __future__ import annotations

import dataclasses

import torch


def shard_arch(dims, spec, world_size: int, expert_parallel: bool = False):
    """(dims, spec) of one rank of `world_size`. Raises ValueError for a split that cannot take effect."""
    if world_size == 1:
        if expert_parallel:
            raise ValueError("--enable-expert-parallel needs --tensor-parallel-size > 1 (experts are split over "
                             "the tensor-parallel ranks)")
        return dims, spec
    n = world_size
    if dims.mla is not None and dims.mla.attention_bias:
        raise ValueError("--tensor-parallel-size > 1 does not support multi-head latent attention with biases "
                         "yet (o_proj's bias would be added on every rank)")
    if dims.num_heads % n:
        raise ValueError(f"--tensor-parallel-size {n} does not divide the model's {dims.num_heads} attention heads")
    hkv = dims.num_kv_heads
    if (hkv >= n and hkv % n) or (hkv < n and n % hkv):
        raise ValueError(f"--tensor-parallel-size {n} and the model's {hkv} KV heads: one must divide the other")
    if spec.qk_norm == "full" and hkv < n:
        raise ValueError(f"--tensor-parallel-size {n} exceeds the {hkv} KV heads of a model normalising all "
                         f"keys together (OLMoE's qk norm)")
    _divides(n, spec.shared_intermediate_size, "shared-expert intermediate size")
    if spec.dense_layers:
        _divides(n, dims.dense_intermediate_size, "dense MLP intermediate size")
    if expert_parallel:
        if dims.num_experts < n or dims.num_experts % n:
            raise ValueError(f"--enable-expert-parallel over {n} ranks needs a multiple of {n} experts per layer; "
                             f"the model has {dims.num_experts}")
        experts, inter = dims.num_experts // n, dims.moe_intermediate_size
    else:
        _divides(n, dims.moe_intermediate_size, "expert intermediate size")
        experts, inter = dims.num_experts, dims.moe_intermediate_size // n
    dims = dataclasses.replace(dims, num_heads=dims.num_heads // n, num_kv_heads=max(1, hkv // n),
                               num_experts=experts, moe_intermediate_size=inter,
                               dense_intermediate_size=dims.dense_intermediate_size // n)
    spec = dataclasses.replace(spec, shared_intermediate_size=spec.shared_intermediate_size // n)
    return dims, spec


def _divides(n: int, size: int, what: str) -> None:
    if size % n:
        raise ValueError(f"--tensor-parallel-size {n} does not divide the model's {what} {size}")


def shard_tensor(tensor: torch.Tensor, shape, rank: int, world_size: int) -> torch.Tensor:
    """The part of a whole checkpoint tensor that a rank's parameter of `shape` holds. Along the one dim
    where they differ the tensor splits into S/s shards; rank r takes shard r*(S/s)//N (S/s = N: its own;
    fewer shards than ranks: replicated KV heads)."""
    shape = tuple(shape)
    if tuple(tensor.shape) == shape or world_size == 1 or tensor.dim() != len(shape):
        return tensor  # replicated, or a shape error the caller reports
    diff = [d for d in range(tensor.dim()) if tensor.shape[d] != shape[d]]
    if len(diff) != 1 or tensor.shape[diff[0]] % shape[diff[0]]:
        return tensor
    d = diff[0]
    shards = tensor.shape[d] // shape[d]
    if shards > world_size or world_size % shards:
        return tensor
    return tensor.narrow(d, (rank * shards // world_size) * shape[d], shape[d])
