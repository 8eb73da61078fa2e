"""The sizes the planner needs from a model, derived from its config alone (no weights, no torch.cuda).

Shapes: E experts per MoE layer, A (= top_k) active per token, H hidden, I expert intermediate size,
V vocabulary, D head dim. One expert is w13 [2I, H] + w2 [H, I] = 3*H*I weights, the unit of paging.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

# The family builders map a transformers config to (ModelDims, ArchSpec) without building modules; the
# shape reads their dims (torch is imported with them, torch.cuda never used).
from pagedmoe.models.hf_config import load_hf_config
from pagedmoe.models.registry import spec_builder
from pagedmoe.parallel.sharding import shard_arch


@dataclass(frozen=True)
class ModelShape:
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
    num_moe_layers: int
    shared_intermediate_size: int = 0
    shared_expert_gate: bool = False
    qkv_bias: bool = False
    qk_norm: Optional[str] = None   # None | "head" | "full", as in models/moe_decoder.ArchSpec
    tie_word_embeddings: bool = False
    dtype_bytes: int = 2            # weights and KV cache
    name: str = ""
    router_bias: bool = False       # e_score_correction_bias (GLM-4.5, DeepSeek-V3)
    # Multi-head latent attention (DeepSeek-V2/V3) when kv_lora_rank > 0; q_lora_rank 0: plain q_proj.
    # The cache then holds the latent, kv_lora_rank + qk_rope_head_dim values per token and layer.
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # The engine's parallel layout this shape is one rank of (parallel/sharding.py): tensor parallelism over
    # `tensor_parallel_size` ranks (the heads and intermediate sizes above are one rank's; every rank runs the
    # same tokens and all-reduces the attention and FFN outputs of every layer), and with expert parallelism
    # (`--enable-expert-parallel`) each MoE layer's E experts split evenly over `num_gpus` = that many ranks
    # (E / num_gpus each; num_experts stays the model's E, which the router picks from).
    num_gpus: int = 1
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.num_moe_layers <= self.num_layers:
            raise ValueError(f"num_moe_layers {self.num_moe_layers} not in [0, {self.num_layers}]")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k {self.top_k} not in [1, num_experts={self.num_experts}]")
        if not 1 <= self.num_gpus <= self.num_experts:
            raise ValueError(f"num_gpus {self.num_gpus} not in [1, num_experts={self.num_experts}]")
        if self.num_gpus > 1 and self.num_gpus != self.tensor_parallel_size:
            raise ValueError(f"experts split over {self.num_gpus} ranks need tensor_parallel_size {self.num_gpus} "
                             f"(the engine's expert parallelism runs within its tensor-parallel ranks)")

    # -- builders --------------------------------------------------------------------------------
    @classmethod
    def from_model_dims(cls, dims, spec, dtype_bytes: int = 2, name: str = "", tensor_parallel_size: int = 1,
                        expert_parallel: bool = False) -> "ModelShape":
        """From the engine's `ModelDims` and `ArchSpec` (models/moe_decoder.py): a rank's dims under
        `tensor_parallel_size` ranks (with `expert_parallel`, dims.num_experts is the rank's share)."""
        mla = {}
        if dims.mla is not None:
            m = dims.mla
            mla = dict(q_lora_rank=m.q_lora_rank or 0, kv_lora_rank=m.kv_lora_rank,
                       qk_nope_head_dim=m.qk_nope_head_dim, qk_rope_head_dim=m.qk_rope_head_dim,
                       v_head_dim=m.v_head_dim)
        return cls(
            vocab_size=dims.vocab_size, hidden_size=dims.hidden_size, num_layers=dims.num_layers,
            num_heads=dims.num_heads, num_kv_heads=dims.num_kv_heads, head_dim=dims.head_dim,
            num_experts=dims.num_experts * (tensor_parallel_size if expert_parallel else 1), top_k=dims.top_k, moe_intermediate_size=dims.moe_intermediate_size,
            dense_intermediate_size=dims.dense_intermediate_size,
            num_moe_layers=dims.num_layers - len(spec.dense_layers),
            shared_intermediate_size=spec.shared_intermediate_size,
            shared_expert_gate=bool(spec.shared_intermediate_size and spec.shared_expert_gate),
            qkv_bias=dims.mla.attention_bias if dims.mla is not None else spec.qkv_bias, qk_norm=spec.qk_norm,
            tie_word_embeddings=dims.tie_word_embeddings, dtype_bytes=dtype_bytes, name=name,
            router_bias=spec.router == "sigmoid_grouped", tensor_parallel_size=tensor_parallel_size,
            num_gpus=tensor_parallel_size if expert_parallel else 1, **mla,
        )

    @classmethod
    def from_hf_config(cls, path_or_config, dtype_bytes: int = 2, tensor_parallel_size: int = 1,
                       expert_parallel: bool = False) -> "ModelShape":
        """From a checkpoint folder's config.json (or a transformers config object), as
        `models/loader.py::build_model` reads it (the family's builder in models/registry.py); no weights are loaded.
        `tensor_parallel_size` > 1: one rank's share, split by the function the engine splits with
        (parallel/sharding.py::shard_arch; ValueError where the engine refuses the split)."""
        name = ""
        config = path_or_config
        if isinstance(path_or_config, (str, bytes)) or hasattr(path_or_config, "__fspath__"):
            name = str(path_or_config).rstrip("/").split("/")[-1]
            config = load_hf_config(str(path_or_config))
        dims, spec = shard_arch(*spec_builder(config)(config), tensor_parallel_size, expert_parallel)
        if tensor_parallel_size > 1:
            name = f"{name} (one rank of {tensor_parallel_size}{', expert parallel' if expert_parallel else ''})"
        return cls.from_model_dims(dims, spec, dtype_bytes, name, tensor_parallel_size, expert_parallel)

    def to_dict(self) -> dict:
        return asdict(self)

    # -- weights ---------------------------------------------------------------------------------
    @property
    def experts_per_gpu(self) -> int:
        """Experts of one MoE layer that one GPU holds (all E on one GPU; E / N under expert parallelism)."""
        return -(-self.num_experts // self.num_gpus)

    def routed_experts(self, num_tokens: float) -> float:
        """This GPU's experts one MoE layer runs for `num_tokens` tokens (each picks top_k of the model's E
        uniformly at random; under expert parallelism every rank sees the same tokens, its share of them)."""
        if num_tokens <= 0:
            return 0.0
        E = self.num_experts
        return self.experts_per_gpu * (1.0 - (1.0 - self.top_k / E) ** num_tokens)

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def expert_bytes(self) -> int:
        """One expert: w13 [2I, H] + w2 [H, I]."""
        return self.expert_params * self.dtype_bytes

    @property
    def num_expert_slots(self) -> int:
        """(layer, expert) pairs this GPU holds: the experts the placement distributes."""
        return self.num_moe_layers * self.experts_per_gpu

    @property
    def all_expert_bytes(self) -> int:
        return self.num_expert_slots * self.expert_bytes

    @property
    def num_dense_layers(self) -> int:
        return self.num_layers - self.num_moe_layers

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def latent_dim(self) -> int:
        """MLA: the values one token keeps per layer (compressed kv ++ shared roped key)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def _attention_matmul_params(self) -> int:
        H, D = self.hidden_size, self.head_dim
        if not self.is_mla:
            return H * D * (2 * self.num_heads + 2 * self.num_kv_heads)   # q, o + k, v
        Hq, qk = self.num_heads, self.qk_nope_head_dim + self.qk_rope_head_dim
        q = H * self.q_lora_rank + self.q_lora_rank * Hq * qk if self.q_lora_rank else H * Hq * qk
        kv = H * self.latent_dim + self.kv_lora_rank * Hq * (self.qk_nope_head_dim + self.v_head_dim)
        return q + kv + Hq * self.v_head_dim * H                                   # + o_proj

    def _moe_backbone_matmul_params(self) -> int:
        """Router, shared expert and its gate: read by every token of a MoE layer."""
        H = self.hidden_size
        gate = H if self.shared_expert_gate else 0
        return self.num_experts * H + 3 * H * self.shared_intermediate_size + gate

    def _backbone_matmul_params(self) -> int:
        """Every non-expert weight a step reads whole (the embedding table is only gathered)."""
        return (self.num_layers * self._attention_matmul_params()
                + self.num_moe_layers * self._moe_backbone_matmul_params()
                + self.num_dense_layers * 3 * self.hidden_size * self.dense_intermediate_size
                + self.vocab_size * self.hidden_size)                                    # lm_head

    @property
    def backbone_params(self) -> int:
        """Every parameter that is not a routed expert; equals the module tree's count (tested)."""
        H, D = self.hidden_size, self.head_dim
        per_layer = 2 * H                                                               # two norms
        if self.is_mla:
            per_layer += self.q_lora_rank + self.kv_lora_rank                           # low-rank norms
            if self.qkv_bias:  # q_a_proj, kv_a_proj_with_mqa, o_proj biases
                per_layer += self.q_lora_rank + self.latent_dim + H
        elif self.qkv_bias:
            per_layer += D * (self.num_heads + 2 * self.num_kv_heads)
        if self.qk_norm == "head":
            per_layer += 2 * D
        elif self.qk_norm == "full":
            per_layer += D * (self.num_heads + self.num_kv_heads)
        embed = 0 if self.tie_word_embeddings else self.vocab_size * H
        bias = self.num_moe_layers * self.num_experts if self.router_bias else 0
        return self._backbone_matmul_params() + self.num_layers * per_layer + H + embed + bias

    @property
    def backbone_bytes(self) -> int:
        return self.backbone_params * self.dtype_bytes

    @property
    def weight_bytes(self) -> int:
        return self.backbone_bytes + self.all_expert_bytes

    @property
    def backbone_read_bytes(self) -> int:
        """Backbone bytes one step reads from HBM (norms and gathered embedding rows are negligible)."""
        return self._backbone_matmul_params() * self.dtype_bytes

    # -- KV cache and FLOPs ----------------------------------------------------------------------
    @property
    def kv_bytes_per_token(self) -> int:
        """K and V, every layer (kvcache/kv_cache.py::kv_bytes_per_block / block_size). MLA: the latent,
        stored split over the layer's cache pair (ceil(L / 2) each, kernels/attention_ref.py)."""
        if self.is_mla:
            return 2 * self.num_layers * (-(-self.latent_dim // 2)) * self.dtype_bytes
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def active_params_per_token(self) -> float:
        """Weights one token multiplies on this GPU: the backbone matmuls plus top_k experts per MoE layer
        (under expert parallelism, top_k * (E / N) / E of them on average: the rank's share)."""
        experts = self.top_k * self.experts_per_gpu / self.num_experts
        return self._backbone_matmul_params() + self.num_moe_layers * experts * self.expert_params

    def flops_per_token(self, context_len: float) -> float:
        """2 FLOPs per active weight, plus attention over `context_len` cached tokens
        (QK^T and PV: 2 * 2 * heads * D per cached token, every layer). MLA is costed in its absorbed
        form (scores over the latent, R + Dr, and values in it, R, per head and cached token)."""
        if self.is_mla:
            per_head = 2 * (self.latent_dim + self.kv_lora_rank)
            return 2.0 * self.active_params_per_token + self.num_layers * self.num_heads * per_head * context_len
        attention = 4.0 * self.num_layers * self.num_heads * self.head_dim * context_len
        return 2.0 * self.active_params_per_token + attention

    def step_flops(self, tokens: int, context_len: float, sampled_rows: int) -> float:
        """FLOPs of a step of `tokens` tokens at mean context `context_len` of which only `sampled_rows` go through
        the lm_head (a prefill needs logits at each prompt's last token only; a decode step samples every row)."""
        lm_head = 2.0 * self.vocab_size * self.hidden_size
        return tokens * (self.flops_per_token(context_len) - lm_head) + sampled_rows * lm_head
