"""Where compute_checksums spends its time on the GPU machine: device->host copies vs crc32.

    PYTHONPATH=src python benchmarks/probe_checksum.py      # one Mixtral stacked expert matrix [8, 14336, 4096]
"""
import time
import zlib

import torch

from pagedmoe.codecs.lossless import compute_checksums, encode


def timed(label, fn):
    torch.cuda.synchronize()
    t = time.perf_counter()
    r = fn()
    torch.cuda.synchronize()
    print(f"{label}: {time.perf_counter() - t:.3f} s", flush=True)
    return r


x = (torch.randn(8, 14336, 4096, device="cuda") * 0.02).bfloat16()
ct = timed("encode (GPU only)", lambda: encode(x, num_parts=8, checksum=False))
print(f"compressed {ct.nbytes / 1e9:.3f} GB, zlib {zlib.ZLIB_RUNTIME_VERSION}")
c_gpu = timed("compute_checksums (first call: pins its staging buffers)", lambda: compute_checksums(ct))
timed("compute_checksums again", lambda: compute_checksums(ct))
ct_cpu = ct.to("cpu")
c_cpu = timed("compute_checksums of a CPU copy", lambda: compute_checksums(ct_cpu))
print("GPU (staged) checksums == CPU checksums:", c_gpu == c_cpu, flush=True)
names = ("part_word_offsets", "block_bit_offsets", "lane_bits", "stream", "raw")
host = timed(".cpu() of the arrays (pageable)", lambda: {n: getattr(ct, n).cpu() for n in names})
timed(".cpu() again", lambda: {n: getattr(ct, n).cpu() for n in names})
pinned = {n: torch.empty(getattr(ct, n).shape, dtype=getattr(ct, n).dtype, pin_memory=True) for n in names}
timed("copy into pinned buffers", lambda: [pinned[n].copy_(getattr(ct, n)) for n in names])
raw = host["raw"].numpy()
timed("crc32 of raw, one thread", lambda: zlib.crc32(raw))
