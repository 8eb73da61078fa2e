"""Modelled step time and throughput: the floors of shared/DESIGN.md ("Modelled step time"). Pure Python.

A step of T tokens is bounded below by four floors, each one resource working alone at its measured rate:
  PCIe floor    = bytes copied from the host tier / pinned H2D bandwidth
                  (every host-tier expert of every layer is copied every step, routed or not: the
                  router's choice is not known one layer ahead)
  decode floor  = bf16 bytes written by the lossless decoder / decoder throughput (compressed tier)
  HBM floor     = bytes every kernel reads or writes / HBM bandwidth:
                  backbone matmul weights + routed experts (the expected distinct experts
                  E*(1-(1-A/E)^T) per MoE layer, whatever tier they came from) + KV read + KV written
                  + copies landing in the buffers (H2D writes, device-to-device copies of the plain
                  double buffer, the decoder's reads and writes)
  compute floor = FLOPs / GEMM rate, FLOPs = T * (2 * active params + attention over the context).
Copies run on their own stream behind compute, so the step takes the largest floor, plus:
  fill          = what the pager's pipeline cannot hide. Layer l's experts are copied into buffer l mod 2
                  while layer l-1 computes (one layer ahead): `pipeline_s` plays the two streams layer by
                  layer (copy side split over the layers by each layer's streamed experts, compute side
                  evenly) and fill = its result - max(copy side, compute side). With the copies spread
                  evenly this is min(copy side, compute side) / MoE layers (the first copy, or the last
                  compute, has nothing beside it); a few host experts in a few layers cost each such layer
                  its whole copy less one layer of compute (measured: Mixtral at weights + 4 GiB, 3 host
                  experts, 42.5 ms steps against a 20.7 ms floor);
  overhead      = what the GPU spends beyond the floors on a step, fitted on the H200 (docs/benchmarks.md,
                  "Expert paging"): a constant, a part per decoder layer (launch gaps, kernels short of their
                  floor at small batch) and a part per sequence (host work: inputs, sampling, outputs).

Throughput of a workload (input_len in, output_len out) in steady state: B sequences run at once (as many
as the KV cache holds at full length, capped by max_num_seqs). Over one "generation" each of the B
sequences is prefilled once (in steps of up to max_num_batched_tokens prompt tokens, which pay the same
per-step expert streaming as decode) and then decodes output_len - 1 tokens in steps shared by all B:
  cycle = (output_len - 1) * decode_step(B, L) + B * prefill_per_seq,   L = input_len + output_len / 2
  output tokens/s = B * output_len / cycle.
Tensor parallelism over N GPUs (ModelShape.tensor_parallel_size; with expert parallelism the experts split
over the same N ranks, ModelShape.num_gpus): the engine's layout. Every rank runs the same B sequences on its
share of the weights, so the step is one rank's step plus the all-reduces (`comm`), and the throughput is
B * output_len / cycle, as on one GPU.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Sequence, Union

from pagedmoe.planning.model_shape import ModelShape


@dataclass(frozen=True)
class HardwareProfile:
    """Rates of one device. Defaults: the H200 ceilings of shared/H200.md (medians, 2026-11-30)."""

    name: str = "H200"
    hbm_bytes_per_s: float = 4.19e12             # device-to-device copy, bytes read + written
    pcie_h2d_bytes_per_s: float = 54.5e9         # pinned host -> device
    gemm_flops: float = 753e12                   # bf16 GEMM 8192^3
    lossless_decode_bytes_per_s: float = 1.5e12  # bf16 output of the lossless decoder (issue 6's target)
    step_overhead_s: float = 1e-3                # per step beyond the floors (fitted with the two below)
    layer_overhead_s: float = 0.19e-3            # per decoder layer and step (fitted, resident decode steps)
    seq_overhead_s: float = 48e-6                # per sequence and step (fitted, resident decode steps)
    # GPU-to-GPU bandwidth one GPU sends at in a collective (tensor parallelism's all-reduces): the H200 SXM
    # datasheet's NVLink 900 GB/s bidirectional, halved; not measured here.
    nvlink_bytes_per_s: float = 450e9

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "name" and not (isinstance(value, (int, float)) and value >= 0):
                raise ValueError(f"hardware profile: {f.name} must be a number >= 0, got {value!r}")
            if f.name.endswith("_per_s") or f.name == "gemm_flops":
                if value <= 0:
                    raise ValueError(f"hardware profile: {f.name} must be > 0, got {value!r}")

    @classmethod
    def from_json(cls, source: Union[str, Path, dict]) -> "HardwareProfile":
        """From a dict, a JSON string, or a JSON file; missing keys keep the H200 defaults."""
        if isinstance(source, dict):
            data = source
        else:
            text = str(source)
            if not text.lstrip().startswith("{"):
                path = Path(source)
                if not path.is_file():
                    raise FileNotFoundError(f"hardware profile {path} does not exist")
                text = path.read_text()
            try:
                data = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"hardware profile: not valid JSON ({e})") from e
        if not isinstance(data, dict):
            raise ValueError("hardware profile: expected a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"hardware profile: unknown keys {unknown}; known: {sorted(known)}")
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


H200 = HardwareProfile()


def expected_distinct_experts(num_experts: int, top_k: int, num_tokens: float) -> float:
    """Experts one layer touches when each of `num_tokens` tokens picks top_k of E uniformly at random."""
    if num_tokens <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** num_tokens)


@dataclass(frozen=True)
class StepTraffic:
    """Expert bytes moved every step whatever the batch, set by the placement (see planner.Placement)."""

    h2d_bytes: int = 0          # host tier -> buffers, over PCIe
    d2d_bytes: int = 0          # resident rows copied into a plain double buffer (read + written)
    decode_out_bytes: int = 0   # bf16 written by the lossless decoder
    decode_in_bytes: int = 0    # compressed bytes it reads
    # each MoE layer's share of the copy stream's work (sums to 1); empty: spread evenly over the layers
    layer_copy_shares: tuple[float, ...] = ()
    # the layer each MoE layer's copy waits for (ring buffers: ring_wait_layers); empty: l - 2
    layer_copy_waits: tuple[int, ...] = ()
    # HBM bytes the expert GEMMs read per bf16 byte of a routed expert, averaged over the experts: 1 unless a
    # fused compressed tier (issue 23: the GEMM decodes the stored bytes itself) holds some of them
    routed_read_factor: float = 1.0

    @property
    def hbm_bytes(self) -> int:
        """HBM traffic of the copies themselves (H2D copies land in HBM)."""
        return self.h2d_bytes + self.d2d_bytes + self.decode_out_bytes + self.decode_in_bytes


@dataclass(frozen=True)
class StepCost:
    num_tokens: int
    pcie_s: float
    decode_s: float
    hbm_s: float
    compute_s: float
    fill_s: float
    overhead_s: float
    comm_s: float = 0.0   # tensor-parallel all-reduces of the attention and FFN outputs, not overlapped


    @property
    def floor_s(self) -> float:
        return max(self.pcie_s, self.decode_s, self.hbm_s, self.compute_s)

    @property
    def total_s(self) -> float:
        return self.floor_s + self.fill_s + self.overhead_s + self.comm_s

    @property
    def bound(self) -> str:
        """Which floor sets the step time."""
        floors = {"pcie": self.pcie_s, "decode": self.decode_s, "hbm": self.hbm_s, "compute": self.compute_s}
        return max(floors, key=floors.get)

    def to_dict(self) -> dict:
        return {**asdict(self), "floor_s": self.floor_s, "total_s": self.total_s, "bound": self.bound}


def step_cost(shape: ModelShape, hw: HardwareProfile, traffic: StepTraffic, num_tokens: int,
              kv_read_bytes: float, context_len: float, num_seqs: int = 1) -> StepCost:
    """Floors of one step of `num_tokens` tokens attending over `context_len` cached tokens on average.

    Under tensor parallelism (shape.tensor_parallel_size = N > 1) this is one rank's step: the shape is the
    rank's share (heads, intermediate sizes; with expert parallelism E / N whole experts of every layer, of
    which the rank runs the ones its tokens route to: shape.routed_experts). Each decoder layer all-reduces
    its attention output and its FFN output, T x H values each, over NVLink; a ring sends 2 (N - 1) / N of
    them from every GPU (`comm_s`, added to the step: the next layer needs the sum).
    """
    distinct = shape.routed_experts(num_tokens)
    routed = shape.num_moe_layers * distinct
    hbm_bytes = (shape.backbone_read_bytes + routed * shape.expert_bytes * traffic.routed_read_factor + kv_read_bytes
                 + num_tokens * shape.kv_bytes_per_token + traffic.hbm_bytes)
    pcie_s = traffic.h2d_bytes / hw.pcie_h2d_bytes_per_s
    decode_s = traffic.decode_out_bytes / hw.lossless_decode_bytes_per_s
    hbm_s = hbm_bytes / hw.hbm_bytes_per_s
    compute_s = num_tokens * shape.flops_per_token(context_len) / hw.gemm_flops
    copy_side, gpu_side = max(pcie_s, decode_s), max(hbm_s, compute_s)
    L = shape.num_moe_layers
    shares = traffic.layer_copy_shares or ((1.0 / L,) * L if L else ())
    fill_s = (pipeline_s([copy_side * x for x in shares], gpu_side / L, traffic.layer_copy_waits)
              - max(copy_side, gpu_side)
              if L and copy_side > 0 else 0.0)
    N = shape.tensor_parallel_size
    comm_s = 0.0
    if N > 1:
        comm_bytes = 2 * shape.num_layers * num_tokens * shape.hidden_size * 2 * (N - 1) / N
        comm_s = comm_bytes * shape.dtype_bytes / hw.nvlink_bytes_per_s
    overhead_s = hw.step_overhead_s + shape.num_layers * hw.layer_overhead_s + num_seqs * hw.seq_overhead_s
    return StepCost(num_tokens, pcie_s, decode_s, hbm_s, compute_s, max(0.0, fill_s), overhead_s, comm_s)


def pipeline_s(copy_s: list[float], compute_s: float, wait_layers: Sequence[int] = ()) -> float:
    """One forward through the pager's pipeline. Layer l's copy starts once the copy before it is done and
    the layer whose buffer rows it reuses has computed: wait_layers[l] (-1: none), by default l - 2 (two
    buffers, layer l in buffer l mod 2); layer l computes after layer l-1 and its own copy."""
    copy_end, done = 0.0, []  # done[l]: compute end of layer l
    for l, c in enumerate(copy_s):
        w = wait_layers[l] if wait_layers else l - 2
        copy_end = max(copy_end, done[w] if w >= 0 else 0.0) + c
        done.append(max(done[-1] if done else 0.0, copy_end) + compute_s)
    return done[-1] if done else 0.0


def decode_step_cost(shape: ModelShape, hw: HardwareProfile, traffic: StepTraffic, num_seqs: int,
                     context_len: float) -> StepCost:
    """One decode token for each of `num_seqs` sequences holding `context_len` tokens each."""
    kv_read = num_seqs * context_len * shape.kv_bytes_per_token
    return step_cost(shape, hw, traffic, num_seqs, kv_read, context_len, num_seqs)


def prefill_step_cost(shape: ModelShape, hw: HardwareProfile, traffic: StepTraffic, num_tokens: int,
                      prompt_len: int) -> StepCost:
    """A step of `num_tokens` prompt tokens from prompts of `prompt_len` (causal: mean context len/2).
    The KV re-read of earlier chunks is left out (small next to the weights)."""
    return step_cost(shape, hw, traffic, num_tokens, 0.0, prompt_len / 2, max(1, -(-num_tokens // prompt_len)))


@dataclass(frozen=True)
class WorkloadEstimate:
    input_len: int
    output_len: int
    num_seqs: int                # concurrent sequences
    decode: StepCost             # one decode step of num_seqs sequences at the mean context
    prefill: StepCost            # one prefill step of prefill_tokens tokens
    prefill_tokens: int
    prefill_s_per_seq: float
    cycle_s: float               # all num_seqs sequences from prompt to last token

    @property
    def output_throughput(self) -> float:
        return self.num_seqs * self.output_len / self.cycle_s if self.num_seqs else 0.0

    @property
    def total_throughput(self) -> float:
        return (self.num_seqs * (self.input_len + self.output_len) / self.cycle_s
                if self.num_seqs else 0.0)

    @property
    def request_throughput(self) -> float:
        return self.num_seqs / self.cycle_s if self.num_seqs else 0.0

    def to_dict(self) -> dict:
        return {"input_len": self.input_len, "output_len": self.output_len, "num_seqs": self.num_seqs,
                "decode_step": self.decode.to_dict(), "prefill_step": self.prefill.to_dict(),
                "prefill_tokens_per_step": self.prefill_tokens, "prefill_s_per_seq": self.prefill_s_per_seq,
                "cycle_s": self.cycle_s, "output_throughput": self.output_throughput,
                "total_token_throughput": self.total_throughput,
                "request_throughput": self.request_throughput}


def estimate_workload(shape: ModelShape, hw: HardwareProfile, traffic: StepTraffic, num_seqs: int,
                      input_len: int, output_len: int, max_num_batched_tokens: int) -> WorkloadEstimate:
    """Steady-state throughput with `num_seqs` sequences in flight (see the module docstring)."""
    if input_len < 1 or output_len < 1:
        raise ValueError(f"input_len and output_len must be >= 1, got {input_len}, {output_len}")
    seqs = max(0, min(num_seqs, max_num_batched_tokens))
    decode = decode_step_cost(shape, hw, traffic, max(seqs, 1), input_len + output_len / 2)
    prefill_tokens = max(1, min(max_num_batched_tokens, max(seqs, 1) * input_len))
    prefill = prefill_step_cost(shape, hw, traffic, prefill_tokens, input_len)
    prefill_s_per_seq = prefill.total_s * input_len / prefill_tokens
    cycle_s = (output_len - 1) * decode.total_s + max(seqs, 1) * prefill_s_per_seq
    return WorkloadEstimate(input_len, output_len, seqs, decode, prefill, prefill_tokens, prefill_s_per_seq,
                            cycle_s)


def ring_wait_layers(streamed_rows: list[list[int]], ring_size: int) -> list[int]:
    """For each layer, the layer whose MoE must finish before its streamed rows may be overwritten: the one
    holding row k - S for the layer's last row k (earlier rows' previous users computed before it), or -1
    when none of its ring rows was used earlier in the forward (it waits only for the forward's fork)."""
    owner = {k: layer for layer, rows in enumerate(streamed_rows) for k in rows}
    return [owner[max(rows) - ring_size] if rows and max(rows) >= ring_size else -1 for rows in streamed_rows]
