"""Build a model from a local HF checkpoint folder (or random weights for --load-format dummy); the
experts it is built with are made by engine/startup.py."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import SafetensorError
from tqdm.auto import tqdm

from pagedmoe.codecs.lossless import CorruptCheckpointError
from pagedmoe.models.compressed import iter_file_tensors
from pagedmoe.models.fp8 import Fp8Dequantizer, fp8_block_size
from pagedmoe.models.hf_config import CheckpointError, load_hf_config
from pagedmoe.models.moe_decoder import MoEForCausalLM
from pagedmoe.models.registry import rank_arch
from pagedmoe.oom import DeviceOutOfMemoryError, naming_oom

logger = logging.getLogger(__name__)

__all__ = ["CheckpointError", "load_hf_config", "resolve_dtype", "build_model", "checkpoint_files", "load_weights",
           "init_dummy_weights"]


def resolve_dtype(name: str, device: torch.device, hf_config) -> torch.dtype:
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cpu":
        return torch.float32
    cfg_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    return torch.float16 if str(cfg_dtype).endswith("float16") and "b" not in str(cfg_dtype) else torch.bfloat16


def build_model(hf_config, max_position: int, device: torch.device, dtype: torch.dtype,
                experts=None) -> MoEForCausalLM:
    """The module tree with uninitialised storage on the target device (no host round trip), built with
    the experts object its MoE layers call (experts/interface.py; engine/startup.py builds both)."""
    dims, spec = rank_arch(hf_config)
    with torch.device("meta"):
        model = MoEForCausalLM(hf_config, dims, spec, max_position, experts)
    model = model.to(dtype=dtype)
    with naming_oom("allocating the backbone", sum(p.numel() * p.element_size() for p in model.parameters())):
        model = model.to_empty(device=device)
    # q/k/v as row slices of one buffer per layer (one GEMM launch), before the weights load into them: each
    # layer's buffer takes the room the layer before it freed, so the backbone's memory stays as planned
    for attn in model.attention_layers():
        if hasattr(attn, "fuse_qkv"):
            attn.fuse_qkv()
    model.model.rotary.build(device)
    model.tie_weights()
    model.eval().requires_grad_(False)
    return model


def checkpoint_files(path: str) -> list[Path]:
    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(f"model folder {path} does not exist")
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from e
        files = [folder / f for f in sorted(set(weight_map.values()))]
        missing = [str(f.name) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{path}: shards listed in the index are missing: {missing}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors weight files")
    return files


def load_weights(model: MoEForCausalLM, path: str, show_progress: bool = True) -> None:
    params = dict(model.named_parameters())
    # compressed shards (pagedmoe compress) decode where the model lives: Triton on CUDA
    decode_device = next(iter(params.values())).device if params else torch.device("cpu")
    expected = model.expected_tensor_names()
    written: set[str] = set()
    fp8 = None
    block = fp8_block_size(model.hf_config)
    if block is not None:  # DeepSeek-V3's fp8 checkpoints: dequantised to the model dtype (models/fp8.py)
        fp8 = Fp8Dequantizer(block, model.model.embed_tokens.weight.dtype, decode_device)
    files = checkpoint_files(path)
    bar = tqdm(total=sum(f.stat().st_size for f in files), unit="B", unit_scale=True,
               desc="Loading weights", disable=not show_progress)
    nonfinite: list[str] = []
    for file in files:
        nonfinite += _load_file(model, file, params, fp8, decode_device, written)
        bar.update(file.stat().st_size)
    bar.close()
    if nonfinite:
        shown = ", ".join(nonfinite[:8]) + (f" and {len(nonfinite) - 8} more" if len(nonfinite) > 8 else "")
        logger.warning("%d checkpoint tensor(s) hold NaN or inf values (outputs will be NaN or garbage): %s",
                       len(nonfinite), shown)
    if fp8 is not None and fp8.unpaired():
        raise CheckpointError(f"{path}: fp8 weights and scales that do not pair up: {fp8.unpaired()[:8]}")
    missing = sorted(expected - written)
    if missing:
        shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise CheckpointError(f"{path}: {len(missing)} weights missing from the checkpoint: {shown}")
    model.tie_weights()


def _load_file(model, file: Path, params: dict, fp8, decode_device: torch.device, written: set) -> list[str]:
    """Place every tensor of one checkpoint file; return the names of those holding NaN or inf."""
    names, flags = [], []  # NaN/inf flags, read once per file (one device sync)
    current = None  # (name, bytes) of the tensor being placed; None while the file is read
    try:
        for raw_name, raw in iter_file_tensors(file, decode_device):
            try:
                ready = fp8.feed(raw_name, raw) if fp8 is not None else [(raw_name, raw)]
            except ValueError as e:
                raise CheckpointError(f"{file.name}: {e}") from None
            for name, tensor in ready:
                current = (name, tensor.numel() * tensor.element_size())
                names.append(name)
                flags.append(_nonfinite_flag(tensor))
                try:
                    written.update(model.load_tensor(name, tensor, params))
                except KeyError:
                    raise CheckpointError(f"{file.name}: unexpected tensor {name!r} for "
                                          f"{type(model.hf_config).__name__}") from None
                except ValueError as e:  # a shape the model does not have
                    raise CheckpointError(f"{file.name}: tensor {name!r}: {e}") from None
            current = None
        bad = _read_flags(flags, decode_device)
    except torch.OutOfMemoryError as e:  # before RuntimeError: running out of memory is not a bad file
        if current is None:
            raise DeviceOutOfMemoryError(f"reading {file.name}") from e
        raise DeviceOutOfMemoryError(f"loading tensor {current[0]!r} of {file.name}", current[1]) from e
    except CorruptCheckpointError as e:
        raise CheckpointError(f"{file}: {e}") from e
    except (SafetensorError, OSError, RuntimeError) as e:
        raise CheckpointError(f"{file}: cannot read weights ({e}); the file may be truncated or "
                              f"corrupt") from e
    return [f"{file.name}: {n}" for n, b in zip(names, bad) if b]


_CHECKED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_CHECK_CHUNK = 1 << 24  # elements per partial sum


def _nonfinite_flag(tensor: torch.Tensor) -> torch.Tensor:
    """A 0-d bool tensor, where `tensor` lives: whether it holds NaN or inf. A sum is non-finite exactly then
    (weights never sum past float32's range; fp16 sums in float32, whose range it lacks), and it reads the
    weights at ~8 GB/s a host core (isfinite: ~0.4) without a transient of the tensor's size."""
    flag = torch.zeros((), dtype=torch.bool, device=tensor.device)
    if tensor.dtype in _CHECKED_DTYPES:
        acc = torch.float32 if tensor.dtype == torch.float16 else None
        for chunk in tensor.reshape(-1).split(_CHECK_CHUNK):
            flag |= ~torch.isfinite(chunk.sum(dtype=acc))
    return flag


def _read_flags(flags: list[torch.Tensor], device: torch.device) -> list[bool]:
    """The flags of one file, read with one device sync."""
    return torch.stack([f.to(device) for f in flags]).tolist() if flags else []


def init_dummy_weights(model: MoEForCausalLM, seed: int) -> None:
    """Random N(0, 0.02) weights (norm scales 1), generated on the model's device. Never zeros."""
    gen = None
    for name, p in model.named_parameters():
        if gen is None:
            gen = torch.Generator(device=p.device).manual_seed(seed)
        if name.endswith("norm.weight") or "layernorm" in name:
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.02, generator=gen)
    model.tie_weights()
