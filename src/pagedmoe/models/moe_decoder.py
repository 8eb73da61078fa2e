"""The decoder-only MoE transformer shared by the model families.

A family file (mixtral.py, qwen2_moe.py, ...) turns its HF config into an `ArchSpec` and names its
checkpoint tensors; everything else lives here. Module names follow the HF checkpoints
(`model.layers.{i}.self_attn.q_proj`, ...) so most tensors load by name.

Shapes: T tokens in the step, H hidden, V vocabulary.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from pagedmoe.experts.interface import ExpertsProvider
from pagedmoe.models.layers.attention import Attention, AttentionMetadata
from pagedmoe.models.layers.linear import Linear
from pagedmoe.models.layers.mla import MLADims, MLAttention
from pagedmoe.models.layers.mlp import GatedMLP
from pagedmoe.models.layers.moe import FusedMoE
from pagedmoe.models.layers.norm import RMSNorm
from pagedmoe.models.layers.rotary import RotaryEmbedding, rope_theta_of
from pagedmoe.parallel.sharding import shard_tensor
from pagedmoe.parallel.state import all_reduce, get_state


@dataclass(frozen=True)
class ArchSpec:
    """What differs between the supported families."""

    moe_prefix: str                 # "block_sparse_moe" (Mixtral) or "mlp"
    expert_names: tuple[str, str, str]  # checkpoint names of (gate, up, down) per expert
    renormalize: bool               # renormalise the top-k router weights
    qkv_bias: bool = False
    qk_norm: Optional[str] = None   # None | "head" (Qwen3) | "full" (OLMoE)
    clip_qkv: Optional[float] = None
    shared_intermediate_size: int = 0
    shared_expert_gate: bool = False
    shared_expert_name: str = "shared_expert"  # "shared_experts" (GLM-4.5, DeepSeek): no gate
    dense_layers: frozenset = field(default_factory=frozenset)  # layer indices with a dense MLP
    # Router: "softmax" (Mixtral, Qwen, OLMoE), "softmax_grouped" (DeepSeek-V2: float32 gate, softmax,
    # group-limited greedy top-k, routed scaling) or "sigmoid_grouped" (GLM-4.5, DeepSeek-V3: sigmoid
    # scores, e_score_correction_bias, group-limited top-k, routed scaling); layers/moe.py.
    router: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    # Trailing multi-token-prediction layers some checkpoints carry (model.layers.{num_layers + i}.*,
    # GLM-4.5 / DeepSeek-V3): not part of the decoder, skipped at load like transformers does.
    num_mtp_layers: int = 0


@dataclass(frozen=True)
class ModelDims:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    dense_intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position: int
    tie_word_embeddings: bool
    rotary_dim: int = 0  # dims of each head that rotate (partial rotary, GLM-4.5); 0: all head_dim
    # DeepSeek-V2/V3 (models/deepseek.py): multi-head latent attention. NOTE: then num_kv_heads = 1
    # and head_dim = mla.cache_head_dim describe the KV *cache* pair (the split latent), which is
    # all the engine, the model runner and kv_cache.py read them for.
    mla: Optional[MLADims] = None
    rope_parameters: Optional[dict] = None  # None: "default" rope at rope_theta
    rope_interleaved: bool = False

    @classmethod
    def from_hf(cls, c, num_experts: int, moe_intermediate_size: int) -> "ModelDims":
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return cls(
            vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_layers=c.num_hidden_layers,
            num_heads=c.num_attention_heads,
            num_kv_heads=getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
            head_dim=head_dim, num_experts=num_experts, top_k=c.num_experts_per_tok,
            moe_intermediate_size=moe_intermediate_size,
            dense_intermediate_size=getattr(c, "intermediate_size", moe_intermediate_size),
            rms_norm_eps=c.rms_norm_eps, rope_theta=rope_theta_of(c),
            max_position=c.max_position_embeddings,
            tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
        )


class DecoderLayer(nn.Module):
    def __init__(self, dims: ModelDims, spec: ArchSpec, layer_idx: int, rotary: RotaryEmbedding,
                 moe_idx: int, experts: Optional[ExpertsProvider] = None) -> None:
        super().__init__()
        if dims.mla is not None:
            self.self_attn = MLAttention(dims.hidden_size, dims.num_heads, dims.mla, rotary)
        else:
            self.self_attn = Attention(dims.hidden_size, dims.num_heads, dims.num_kv_heads, dims.head_dim,
                                       rotary, qkv_bias=spec.qkv_bias, qk_norm=spec.qk_norm,
                                       rms_norm_eps=dims.rms_norm_eps, clip_qkv=spec.clip_qkv)
        self.input_layernorm = RMSNorm(dims.hidden_size, dims.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(dims.hidden_size, dims.rms_norm_eps)
        self.is_moe = layer_idx not in spec.dense_layers
        if self.is_moe:
            moe = FusedMoE(dims.hidden_size, dims.moe_intermediate_size, dims.num_experts, dims.top_k,
                           spec.renormalize, moe_idx, spec.shared_intermediate_size,
                           spec.shared_expert_gate, router=spec.router, n_group=spec.n_group,
                           topk_group=spec.topk_group, routed_scaling_factor=spec.routed_scaling_factor,
                           shared_expert_name=spec.shared_expert_name, experts=experts,
                           ep_size=get_state().ep_size, ep_rank=get_state().ep_rank)
        else:
            moe = GatedMLP(dims.hidden_size, dims.dense_intermediate_size)
        # Registered under the family's checkpoint name so the tensors load by name.
        self.ffn_name = spec.moe_prefix
        self.add_module(spec.moe_prefix, moe)

    @property
    def ffn(self) -> nn.Module:
        return self._modules[self.ffn_name]

    def forward(self, h: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # NOTE: under tensor parallelism both outputs are each rank's partial sums (row-parallel o_proj and
        # down projections, this rank's experts): summed over the ranks here, the identity on one process
        h = h + all_reduce(self.self_attn(self.input_layernorm(h), positions, meta))
        return h + all_reduce(self.ffn(self.post_attention_layernorm(h)))

    def forward_fused(self, x: torch.Tensor, residual: Optional[torch.Tensor], positions: torch.Tensor,
                      meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """--fused-ops: (x, residual) -> (this layer's FFN output, the residual stream before it added).
        Each residual add runs fused with the RMSNorm after it (kernels/fused_norm.py), in place: x and
        residual are this step's own activations."""
        from pagedmoe.kernels.fused_norm import fused_add_rmsnorm

        ln1, ln2 = self.input_layernorm, self.post_attention_layernorm
        if residual is None:  # the first layer: the embedding is the residual stream
            residual = x
            x, _ = fused_add_rmsnorm(x, None, ln1.weight, ln1.eps)
        else:
            x, residual = fused_add_rmsnorm(x, residual, ln1.weight, ln1.eps, out=x, residual_out=residual)
        x = self.self_attn(x, positions, meta)
        x, residual = fused_add_rmsnorm(x, residual, ln2.weight, ln2.eps, out=x, residual_out=residual)
        return self.ffn(x), residual


class DecoderModel(nn.Module):
    def __init__(self, dims: ModelDims, spec: ArchSpec, max_position: int,
                 experts: Optional[ExpertsProvider] = None) -> None:
        super().__init__()
        rot_dim = dims.mla.qk_rope_head_dim if dims.mla is not None else dims.head_dim
        self.rotary = RotaryEmbedding(rot_dim, max_position, dims.rope_theta, dims.rotary_dim,
                                      dims.rope_parameters, dims.rope_interleaved)
        # the weight as given (_weight), not initialised: on the meta device nn.Embedding's normal_ init imports
        # torch._dynamo, ~2 s of every process start (the engine fills every weight: to_empty, then the checkpoint)
        self.embed_tokens = nn.Embedding(dims.vocab_size, dims.hidden_size,
                                         _weight=torch.empty(dims.vocab_size, dims.hidden_size))
        moe_layers = [i for i in range(dims.num_layers) if i not in spec.dense_layers]
        self.layers = nn.ModuleList(
            DecoderLayer(dims, spec, i, self.rotary, moe_layers.index(i) if i in moe_layers else -1, experts)
            for i in range(dims.num_layers))
        self.norm = RMSNorm(dims.hidden_size, dims.rms_norm_eps)


class MoEForCausalLM(nn.Module):
    """forward(input_ids [T], positions [T], meta, logits_indices [N]) -> logits [N, V] in float32.

    Built with one experts object (experts/interface.py; engine/startup.py makes it): the MoE layers
    call it for their weights, the forward tells it where each forward and MoE layer begins."""

    def __init__(self, hf_config, dims: ModelDims, spec: ArchSpec, max_position: int,
                 experts: Optional[ExpertsProvider] = None) -> None:
        super().__init__()
        self.hf_config, self.dims, self.spec = hf_config, dims, spec
        # this rank's place (parallel/): checkpoint tensors are sliced to its share as they load
        self.parallel = get_state()
        self.experts = experts
        self.model = DecoderModel(dims, spec, max_position, experts)
        self.lm_head = Linear(dims.hidden_size, dims.vocab_size, bias=False)  # --backbone-gemm (layers/linear.py)
        # --fused-ops (layers/fused_ops.py): residual adds fused with the RMSNorms after them
        self.fused_residual_norm = False

    @property
    def expert_store(self):
        """The store behind the experts object: the loader's sink for expert tensors."""
        return None if self.experts is None else self.experts.store

    @property
    def pager(self):
        """The experts object when it pages (it has side streams and traffic stats), else None."""
        return None if self.experts is None or not self.experts.store.paged else self.experts

    def tie_weights(self) -> None:
        if self.dims.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def moe_layers(self) -> list[FusedMoE]:
        return [layer.ffn for layer in self.model.layers if layer.is_moe]

    def attention_layers(self) -> list:  # Attention, or MLAttention (same cache binding)
        return [layer.self_attn for layer in self.model.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                logits_indices: Optional[torch.Tensor] = None, hidden_only: bool = False) -> torch.Tensor:
        """-> float32 logits [T (or len(logits_indices)), V]; with hidden_only the final-normed hidden states those
        logits come from (compute_logits): the CUDA graphs' output, worker/cuda_graph.py."""
        h = self.model.embed_tokens(input_ids)
        experts = self.experts
        if experts is not None:
            experts.begin_forward(input_ids.shape[0])
        fused = self.fused_residual_norm
        residual = None
        for layer in self.model.layers:
            if experts is not None and layer.is_moe:
                experts.before_layer(layer.ffn.moe_idx)
            if fused:
                h, residual = layer.forward_fused(h, residual, positions, meta)
            else:
                h = layer(h, positions, meta)
        if logits_indices is not None:
            h = h[logits_indices]
            residual = None if residual is None else residual[logits_indices]
        if fused:
            from pagedmoe.kernels.fused_norm import fused_add_rmsnorm

            h, _ = fused_add_rmsnorm(h, residual, self.model.norm.weight, self.model.norm.eps)
        else:
            h = self.model.norm(h)
        return h if hidden_only else self.compute_logits(h)

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden states [N, H] -> float32 logits [N, V]."""
        return self.lm_head(h).float()

    # -- weight loading ------------------------------------------------------------------------
    def expert_tensor_name(self, name: str) -> Optional[tuple[int, int, str]]:
        """Map a per-expert checkpoint tensor name to (decoder layer, expert, 'gate'|'up'|'down'), else None."""
        parts = name.split(".")
        # model.layers.{l}.{moe_prefix}.experts.{e}.{proj}.weight
        if len(parts) != 8 or parts[:2] != ["model", "layers"] or parts[4] != "experts" or parts[7] != "weight":
            return None
        if parts[3] != self.spec.moe_prefix or parts[6] not in self.spec.expert_names:
            return None
        kind = ("gate", "up", "down")[self.spec.expert_names.index(parts[6])]
        return int(parts[2]), int(parts[5]), kind

    def _moe_idx(self, layer: int, name: str) -> int:
        if not 0 <= layer < len(self.model.layers) or not self.model.layers[layer].is_moe:
            raise KeyError(name)
        return self.model.layers[layer].ffn.moe_idx

    def load_tensor(self, name: str, tensor: torch.Tensor, params: dict[str, torch.Tensor]) -> list[str]:
        """Copy one checkpoint tensor into place. Returns the names of the units (re)written."""
        if self.spec.num_mtp_layers and self._is_mtp_tensor(name):
            return []
        expert = self.expert_tensor_name(name)
        if expert is not None:
            layer, e, kind = expert
            if not 0 <= e < self.dims.num_experts * self.parallel.ep_size:
                raise KeyError(name)
            local = self._local_expert(e)
            if local is None:  # another rank's expert (--enable-expert-parallel)
                return []
            self.expert_store.write(self._moe_idx(layer, name), local, kind, self._expert_share(tensor, kind))
            return [f"experts.{layer}.{e}.{kind}"]
        # Fused HF v5 layout: experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I].
        for fused, kind in ((".experts.gate_up_proj", "w13"), (".experts.down_proj", "w2")):
            if name.endswith(fused):
                layer = int(name.split(".")[2])
                moe_idx = self._moe_idx(layer, name)
                total = self.dims.num_experts * self.parallel.ep_size
                if tensor.shape[0] != total:
                    raise ValueError(f"{tensor.shape[0]} experts, expected {total}")
                owned = [e for e in range(total) if self._local_expert(e) is not None]
                for e in owned:
                    if kind == "w13":  # gate rows then up rows: each split on its own
                        gate, up = tensor[e].chunk(2, dim=0)
                        for part, t in (("gate", gate), ("up", up)):
                            self.expert_store.write(moe_idx, self._local_expert(e), part,
                                                    self._expert_share(t, part))
                    else:
                        self.expert_store.write(moe_idx, self._local_expert(e), "down",
                                                self._expert_share(tensor[e], "down"))
                kinds = ("gate", "up") if kind == "w13" else ("down",)
                return [f"experts.{layer}.{e}.{k}" for e in owned for k in kinds]
        if name not in params:
            if name == "lm_head.weight" and self.dims.tie_word_embeddings:
                return []
            if name.endswith("rotary_emb.inv_freq"):
                return []
            raise KeyError(name)
        target = params[name]
        tensor = shard_tensor(tensor, target.shape, self.parallel.rank, self.parallel.world_size)
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(f"checkpoint shape {tuple(tensor.shape)} != model shape {tuple(target.shape)}")
        target.copy_(tensor)
        return [name]

    def _local_expert(self, e: int) -> Optional[int]:
        """This rank's index of global expert e, None when another rank owns it (expert parallel)."""
        n = self.dims.num_experts
        local = e - self.parallel.ep_rank * n
        return local if 0 <= local < n else None

    def _expert_share(self, tensor: torch.Tensor, kind: str) -> torch.Tensor:
        """This rank's slice of one expert tensor (tensor parallel: along the intermediate dim)."""
        H, I = self.dims.hidden_size, self.dims.moe_intermediate_size
        shape = (H, I) if kind == "down" else (I, H)
        return shard_tensor(tensor, shape, self.parallel.rank, self.parallel.world_size)

    def _is_mtp_tensor(self, name: str) -> bool:
        parts = name.split(".")
        if len(parts) < 3 or parts[:2] != ["model", "layers"] or not parts[2].isdigit():
            return False
        n = self.dims.num_layers
        return n <= int(parts[2]) < n + self.spec.num_mtp_layers

    def expected_tensor_names(self) -> set[str]:
        """Every unit load_tensor must write for a complete checkpoint."""
        names = {pname for pname, _ in self.named_parameters(remove_duplicate=True)}
        for i, layer in enumerate(self.model.layers):
            if layer.is_moe:
                first = self.parallel.ep_rank * self.dims.num_experts  # this rank's experts (global ids)
                names.update(f"experts.{i}.{e}.{k}" for e in range(first, first + self.dims.num_experts)
                              for k in ("gate", "up", "down"))
        return names
