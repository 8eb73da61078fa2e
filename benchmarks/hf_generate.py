"""HF transformers `generate` on the same shape and batch as our benchmarks, for the record.

Random bf16 weights (N(0, 0.02), norms 1) generated on the GPU from a config.json folder.
Usage: python benchmarks/hf_generate.py benchmarks/configs/mixtral-8x7b --batch 32 --input-len 512 --output-len 32

`--gpu-memory-gb X`: what people do when the model does not fit, accelerate's big-model offload — the
model on the meta device, `infer_auto_device_map` with X GiB on the GPU and the rest in host memory,
`dispatch_model`, whose hooks copy each offloaded module's weights to the GPU on every forward. The
baseline pagedmoe's paged placement is compared with at the same budget (docs/benchmarks.md).
`--device cpu` runs the same code on the CPU (a smoke test on a tiny config; no offload there).
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
import transformers


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("config_dir")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--output-json", default=None)
    ap.add_argument("--gpu-memory-gb", type=float, default=None,
                    help="accelerate offload: this much of the model's weights on the GPU, the rest on the host")
    ap.add_argument("--host-memory-gb", type=float, default=120.0)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    cfg = transformers.AutoConfig.from_pretrained(args.config_dir)
    dev = torch.device(args.device)
    t0 = time.perf_counter()
    device_map = None
    if args.gpu_memory_gb is None:
        with dev:
            model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        _randomize(model, dev, {})
    else:
        model, device_map = _offloaded(cfg, dev, args.gpu_memory_gb, args.host_memory_gb)
    model.eval()
    build_s = time.perf_counter() - t0
    ids = torch.randint(10, cfg.vocab_size, (args.batch, args.input_len), device=dev)
    mask = torch.ones_like(ids)  # no padding: every prompt is input_len tokens
    kw = dict(max_new_tokens=args.output_len, min_new_tokens=args.output_len, do_sample=False,
              pad_token_id=0, attention_mask=mask)
    with torch.no_grad():
        # warm-up (one forward under offload: each forward copies every offloaded weight to the GPU)
        warm = 1 if device_map else 2
        model.generate(ids[:, :16], max_new_tokens=warm, min_new_tokens=warm, do_sample=False, pad_token_id=0,
                       attention_mask=mask[:, :16])
        _sync(dev)
        t0 = time.perf_counter()
        out = model.generate(ids, **kw)
        _sync(dev)
        elapsed = time.perf_counter() - t0
    n_out = (out.shape[1] - args.input_len) * args.batch
    result = {"model": os.path.basename(args.config_dir.rstrip("/")), "batch": args.batch,
              "input_len": args.input_len, "output_len": args.output_len, "elapsed_s": elapsed,
              "output_tokens_per_s": n_out / elapsed, "build_s": build_s,
              "transformers": transformers.__version__, "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name() if dev.type == "cuda" else None,
              "gpu_memory_gb": args.gpu_memory_gb,
              "offloaded_gb": _offloaded_bytes(model, device_map) / 2**30 if device_map else 0.0}
    how = (f", accelerate offload: {result['offloaded_gb']:.1f} GiB of weights on the host"
           if device_map else "")
    print(f"HF transformers generate: {result['output_tokens_per_s']:.1f} output tokens/s "
          f"(batch {args.batch}, {args.input_len} in / {args.output_len} out, {elapsed:.1f} s{how})")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _randomize(model, dev: torch.device, device_map: dict) -> None:
    """N(0, 0.02) (norms 1) into every parameter, generated on `dev`, each moved to where device_map puts
    it (empty map: it is already there)."""
    from accelerate.utils import set_module_tensor_to_device

    gen = torch.Generator(device=dev).manual_seed(0)
    with torch.no_grad():
        for name, p in list(model.named_parameters()):
            if not device_map:
                (p.fill_(1.0) if "norm" in name else p.normal_(0.0, 0.02, generator=gen))
                continue
            value = torch.empty(p.shape, dtype=torch.bfloat16, device=dev)
            (value.fill_(1.0) if "norm" in name else value.normal_(0.0, 0.02, generator=gen))
            target = _placement(name, device_map)
            if target in ("cpu", "disk"):
                # pages faulted in on every core first: a copy into fresh pageable memory faults them one by
                # one (the 68 GiB offloaded at 24 GiB took 53 s to build that way, 11 s this way)
                host = torch.zeros(p.shape, dtype=torch.bfloat16)
                host.copy_(value)
                target, value = "cpu", host
            set_module_tensor_to_device(model, name, target, value=value)


def _placement(name: str, device_map: dict):
    """The device_map entry of the longest module prefix of parameter `name`."""
    parts = name.split(".")
    for i in range(len(parts), -1, -1):
        key = ".".join(parts[:i])
        if key in device_map:
            return device_map[key]
    raise KeyError(f"{name} has no entry in the device map")


def _offloaded(cfg, dev: torch.device, gpu_gb: float, host_gb: float):
    from accelerate import dispatch_model, infer_auto_device_map, init_empty_weights

    with init_empty_weights():
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    gpu = 0 if dev.type == "cuda" else "cpu"
    max_memory = {gpu: f"{gpu_gb}GiB", "cpu": f"{host_gb}GiB"} if dev.type == "cuda" else {"cpu": f"{host_gb}GiB"}
    device_map = infer_auto_device_map(model, max_memory=max_memory, dtype=torch.bfloat16,
                                       no_split_module_classes=model._no_split_modules)
    _randomize(model, dev, device_map)
    model = dispatch_model(model, device_map=device_map, main_device=dev if dev.type == "cuda" else None)
    return model, device_map


def _offloaded_bytes(model, device_map: dict) -> int:
    return sum(p.numel() * 2 for name, p in model.named_parameters()
               if _placement(name, device_map) in ("cpu", "disk"))


if __name__ == "__main__":
    main()
