"""--gpu-memory-gb against the device (engine/startup.py::clamp_to_device), with the CUDA memory queries faked:
above the device's total it is refused, above what it can still give it is cut (with a warning), below
it is kept."""
import logging
from types import SimpleNamespace

import pytest
import torch

from pagedmoe.engine.startup import DEVICE_RESERVE, clamp_to_device
from pagedmoe.planning.kv_sizing import GiB


@pytest.fixture
def device(monkeypatch):
    # 140 GiB device, 50 GiB free after loading 88 GiB of weights, 1 GiB cached but unused
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (50 * GiB, 140 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 89 * GiB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 88 * GiB)
    return SimpleNamespace(device=torch.device("cuda", 0))


def test_budget_above_the_device_is_refused(device):
    with pytest.raises(ValueError, match="exceeds this device's 140.00 GiB"):
        clamp_to_device(device.device, 141 * GiB, 88 * GiB)


def test_budget_above_what_is_left_is_cut(device, caplog):
    with caplog.at_level(logging.WARNING, logger="pagedmoe"):
        got = clamp_to_device(device.device, 139 * GiB, 88 * GiB)
    assert got == 88 * GiB + 50 * GiB + 1 * GiB - DEVICE_RESERVE
    assert "is more than this device can give" in caplog.text


def test_budget_that_fits_is_kept(device):
    assert clamp_to_device(device.device, 100 * GiB, 88 * GiB) == 100 * GiB
