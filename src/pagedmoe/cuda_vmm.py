"""CUDA virtual memory management (cuda-python's driver API): the few calls pagedmoe needs, public.

Used by the expert compute buffers (experts/buffers.py: stable addresses, resident rows mapped in place)
and the lendable KV cache (kvcache/kv_cache.py: chunks unmapped and mapped again at run time). cuda-python
is optional: `available(device)` says whether these work; everything else assumes they do.
"""
from __future__ import annotations

import functools

import torch


def driver():
    """cuda.bindings.driver (optional package: imported on first use)."""
    from cuda.bindings import driver as cu

    return cu


def check(result):
    """cuda-python calls return (CUresult, *values); raise on error, return the values."""
    err, *values = result if isinstance(result, tuple) else (result,)
    cu = driver()
    if err != cu.CUresult.CUDA_SUCCESS:
        name = cu.cuGetErrorName(err)[1]
        raise RuntimeError(f"CUDA driver call failed: {name.decode() if isinstance(name, bytes) else name}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def allocation_prop(device_idx: int):
    """Pinned device memory on `device_idx`, as cuMemCreate takes it."""
    cu = driver()
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device_idx
    return prop


@functools.lru_cache(maxsize=None)
def granularity(device: torch.device) -> int:
    cu = driver()
    idx = device.index if device.index is not None else torch.cuda.current_device()
    flag = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
    return int(check(cu.cuMemGetAllocationGranularity(allocation_prop(idx), flag)))


def available(device: torch.device) -> bool:
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    try:
        torch.cuda.init()
        check(driver().cuInit(0))
        return granularity(device) > 0
    except Exception:  # no cuda-python, or a driver without VMM
        return False


class CudaArray:
    """Just enough of __cuda_array_interface__ for torch.as_tensor to wrap a raw device range (bytes). torch
    keeps this object alive with the tensor, and it keeps `owner` alive: e.g. the token whose collection
    frees the memory (kvcache/kv_cache.py), which must not be the tensor's own holder (a reference held
    inside a tensor is invisible to gc, so a cycle through it would never be freed)."""

    def __init__(self, ptr: int, nbytes: int, owner=None) -> None:
        self.owner = owner
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}


def access_desc(device_idx: int):
    """Read-write access for the device, as cuMemSetAccess takes it."""
    cu = driver()
    access = cu.CUmemAccessDesc()
    access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    access.location.id = device_idx
    access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    return access


def map_range(va: int, nbytes: int, handle, access) -> None:
    """Map a physical allocation (from offset 0) at `va` and make it readable and writable."""
    cu = driver()
    check(cu.cuMemMap(va, nbytes, 0, handle, 0))
    check(cu.cuMemSetAccess(va, nbytes, [access], 1))
