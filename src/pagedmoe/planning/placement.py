"""Placement: how many experts of each MoE layer sit in each tier. Pure Python; sized and costed by
planning/planner.py, carried out by the expert table (which decides *which* experts: the first N today,
the most active ones once the activity table exists).

Tiers per MoE layer: resident bf16 on the GPU, lossless compressed on the GPU (issue 6; decoded into the
layer's buffer every step), pinned host memory (copied every step). Lower precisions (issue 7) would
add one count per precision the same way.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

PLACEMENTS = ("resident", "paged", "auto")
# Stored bytes / bf16 bytes the planner assumes for the lossless tier before any weight is seen: the
# default layout on N(0, 0.02) weights (docs/benchmarks.md, "Lossless codec"); trained weights are close.
LOSSLESS_PLANNING_RATIO = 0.683

# A compressed host tier (--host-compression lossless) moves and decodes a layer's host experts in groups of
# consecutive experts of at most this many bf16 bytes: one copy per array and one decode launch per group,
# into one of HOST_STAGING_SLOTS device staging slots of a group each (experts/store.py): the k-th group of
# the model is copied into slot k % 2 and decoded from it. Copies and decodes run in turn on the one copy
# stream; two slots keep a group's copy from depending on the decode just before it.
HOST_GROUP_BYTES = 64 << 20
HOST_STAGING_SLOTS = 2


def host_group_experts(expert_bytes: int) -> int:
    """Experts per group of a compressed host tier: at least one (Mixtral-8x7B's 336 MiB experts go alone;
    Qwen3-30B-A3B's 9 MiB ones by 7, ~18 launches per layer rather than 128)."""
    return max(1, HOST_GROUP_BYTES // max(1, expert_bytes))


@dataclass(frozen=True)
class Placement:
    """How many experts of each MoE layer sit in each tier (the expert table decides which ones).

    Per MoE layer (in order): `num_gpu_experts` resident bf16, `num_compressed_experts` lossless on the
    GPU (decoded into the buffer every step), and the rest in pinned host memory (copied every step).
    """

    num_experts: int
    num_gpu_experts: tuple[int, ...]
    num_compressed_experts: tuple[int, ...] = ()
    compression_ratio: float = 0.0      # compressed bytes / bf16 bytes, when the compressed tier is used

    def __post_init__(self) -> None:
        comp = self.num_compressed_experts or (0,) * len(self.num_gpu_experts)
        object.__setattr__(self, "num_compressed_experts", tuple(comp))
        object.__setattr__(self, "num_gpu_experts", tuple(self.num_gpu_experts))
        if len(comp) != len(self.num_gpu_experts):
            raise ValueError("num_compressed_experts needs one count per MoE layer")
        for n, c in zip(self.num_gpu_experts, comp):
            if n < 0 or c < 0 or n + c > self.num_experts:
                raise ValueError(f"a layer cannot hold {n} resident + {c} compressed of {self.num_experts} experts")
        if any(comp) and not 0 < self.compression_ratio <= 1:
            raise ValueError(f"compressed experts need a compression_ratio in (0, 1], got {self.compression_ratio}")

    @classmethod
    def uniform(cls, num_moe_layers: int, num_experts: int, num_gpu_experts: int,
                num_compressed_experts: int = 0, compression_ratio: float = 0.0) -> "Placement":
        return cls(num_experts, (num_gpu_experts,) * num_moe_layers,
                   (num_compressed_experts,) * num_moe_layers, compression_ratio)

    @classmethod
    def spread(cls, num_moe_layers: int, num_experts: int, total_gpu_experts: int,
               num_compressed_experts: int = 0, compression_ratio: float = 0.0,
               fewer: str = "last") -> "Placement":
        """`total_gpu_experts` resident experts spread evenly: every layer gets `base` or `base + 1`. The
        layers with one fewer (one more streamed expert) are the last ones (`fewer="last"`), or evenly
        spaced with the last at the last layer (`fewer="even"`: with ring buffers an early copy can then
        hide behind the layers before it)."""
        L = num_moe_layers
        base, extra = divmod(total_gpu_experts, L)
        if fewer == "last":
            short = set(range(extra, L))
        elif fewer == "even":
            k = L - extra
            short = {L - 1 - (i * L) // k for i in range(k)} if k else set()
        else:
            raise ValueError(f"fewer must be 'last' or 'even', got {fewer!r}")
        gpu = tuple(base + (i not in short) for i in range(L))
        return cls(num_experts, gpu, (num_compressed_experts,) * L, compression_ratio)

    @classmethod
    def resident(cls, num_moe_layers: int, num_experts: int) -> "Placement":
        return cls.uniform(num_moe_layers, num_experts, num_experts)

    def num_streamed(self, layer: int) -> int:
        """Experts of MoE layer `layer` that pass through the buffers each step."""
        return self.num_experts - self.num_gpu_experts[layer]

    @property
    def total_gpu(self) -> int:
        return sum(self.num_gpu_experts)

    @property
    def total_compressed(self) -> int:
        return sum(self.num_compressed_experts)

    @property
    def total_host(self) -> int:
        return len(self.num_gpu_experts) * self.num_experts - self.total_gpu - self.total_compressed

    @property
    def max_host(self) -> int:
        """The most host experts of any one layer."""
        comp = self.num_compressed_experts or (0,) * len(self.num_gpu_experts)
        return self.num_experts - min(map(operator.add, self.num_gpu_experts, comp)) if comp else 0

    @property
    def max_streamed(self) -> int:
        # the fewest resident experts of any layer (the planner's search reads this for every candidate)
        return self.num_experts - min(self.num_gpu_experts) if self.num_gpu_experts else 0

    @property
    def is_resident(self) -> bool:
        return self.max_streamed == 0

    def label(self) -> str:
        if self.is_resident:
            return "resident"
        lo, hi = min(self.num_gpu_experts), max(self.num_gpu_experts)
        text = f"N={lo}" if lo == hi else f"N={lo}-{hi} ({self.total_gpu}/{len(self.num_gpu_experts) * self.num_experts})"
        if self.total_compressed:
            c_lo, c_hi = min(self.num_compressed_experts), max(self.num_compressed_experts)
            text += f" C={c_lo}" if c_lo == c_hi else f" C={c_lo}-{c_hi}"
        return text

    def to_dict(self) -> dict:
        return {"label": self.label(), "num_experts": self.num_experts, "num_gpu_experts": list(self.num_gpu_experts),
                "num_compressed_experts": list(self.num_compressed_experts),
                "compression_ratio": self.compression_ratio, "total_gpu": self.total_gpu,
                "total_compressed": self.total_compressed, "total_host": self.total_host}
