"""worker/host_copy.py: host tensors reach the device through pinned memory, without waiting for the GPU."""
from __future__ import annotations

import time

import pytest
import torch

from pagedmoe.worker.host_copy import to_device_async


def test_cpu_copy_is_the_tensor_itself():
    t = torch.arange(10)
    assert to_device_async(t, torch.device("cpu")) is t


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_copy_does_not_wait_for_the_stream_and_owns_its_bytes():
    """A 1 MiB pageable tensor (over the driver's inline limit, where a pageable copy may synchronise with the
    stream) queued behind ~1 s of GPU work: the call returns long before that work ends, and changing the
    source afterwards does not change what arrives (the bytes went through their own pinned block)."""
    src = torch.arange(256 * 1024, dtype=torch.int32)
    want = src.clone()
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e9))       # ~1 s of cycles on the current stream
    t0 = time.perf_counter()
    out = to_device_async(src, torch.device("cuda"))
    took = time.perf_counter() - t0
    src.zero_()
    assert took < 0.2, f"the copy waited {took:.3f} s for the stream"
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), want)
