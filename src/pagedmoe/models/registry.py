"""Architecture name (config.json `architectures[0]`) -> the family's spec builder."""
from __future__ import annotations

from typing import Callable

from pagedmoe.models import deepseek, glm4_moe, mixtral, olmoe, qwen2_moe, qwen3_moe

MODEL_REGISTRY: dict[str, Callable] = {
    "MixtralForCausalLM": mixtral.build_spec,
    "Qwen2MoeForCausalLM": qwen2_moe.build_spec,
    "Qwen3MoeForCausalLM": qwen3_moe.build_spec,
    "OlmoeForCausalLM": olmoe.build_spec,
    "Glm4MoeForCausalLM": glm4_moe.build_spec,
    "DeepseekV2ForCausalLM": deepseek.build_spec_v2,
    "DeepseekV3ForCausalLM": deepseek.build_spec_v3,
}


def supported_architectures() -> list[str]:
    return sorted(MODEL_REGISTRY)


def spec_builder(hf_config) -> Callable:
    archs = list(getattr(hf_config, "architectures", None) or [])
    for arch in archs:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    raise ValueError(f"unsupported model architecture {archs or '(none in config.json)'}; "
                     f"supported: {', '.join(supported_architectures())}")


def rank_arch(hf_config):
    """(ModelDims, ArchSpec) of this process's rank: the whole model on one process, its share under
    --tensor-parallel-size (parallel/sharding.py). The engine builds, plans and sizes with these."""
    from pagedmoe.parallel.sharding import shard_arch
    from pagedmoe.parallel.state import get_state

    state = get_state()
    dims, spec = spec_builder(hf_config)(hf_config)
    return shard_arch(dims, spec, state.world_size, state.expert_parallel)
