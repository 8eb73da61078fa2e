"""HF transformers `generate` on the same shape and batch as our benchmarks, for the record.

Random bf16 weights (N(0, 0.02)) built directly on the GPU from a config.json folder.
Usage: python benchmarks/hf_generate.py benchmarks/configs/mixtral-8x7b --batch 32 --input-len 512 --output-len 32
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
    args = ap.parse_args()
    cfg = transformers.AutoConfig.from_pretrained(args.config_dir)
    t0 = time.perf_counter()
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    model.eval()
    build_s = time.perf_counter() - t0
    ids = torch.randint(10, cfg.vocab_size, (args.batch, args.input_len), device="cuda")
    kw = dict(max_new_tokens=args.output_len, min_new_tokens=args.output_len, do_sample=False,
              pad_token_id=0)
    with torch.no_grad():
        model.generate(ids[:, :16], max_new_tokens=2, min_new_tokens=2, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(ids, **kw)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
    n_out = (out.shape[1] - args.input_len) * args.batch
    result = {"model": os.path.basename(args.config_dir.rstrip("/")), "batch": args.batch,
              "input_len": args.input_len, "output_len": args.output_len, "elapsed_s": elapsed,
              "output_tokens_per_s": n_out / elapsed, "build_s": build_s,
              "transformers": transformers.__version__, "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name()}
    print(f"HF transformers generate: {result['output_tokens_per_s']:.1f} output tokens/s "
          f"(batch {args.batch}, {args.input_len} in / {args.output_len} out, {elapsed:.1f} s)")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
