"""--gpu-memory-gb against the device (engine/startup.py::clamp_to_device), with the process's memory monitor faked:
above the device's total it is refused, above what the device can give beside other processes it is cut
(with a warning), below it is kept."""
import logging
from types import SimpleNamespace

import pytest

from pagedmoe.engine.startup import DEVICE_HEADROOM, clamp_to_device
from pagedmoe.planning.kv_sizing import GiB


@pytest.fixture
def engine():
    # a 140 GiB device of which other processes hold 10 GiB
    return SimpleNamespace(memory=SimpleNamespace(total_bytes=140 * GiB, others_bytes=10 * GiB))


def test_budget_above_the_device_is_refused(engine):
    with pytest.raises(ValueError, match="exceeds this device's 140.00 GiB"):
        clamp_to_device(engine.memory, 141 * GiB)


def test_budget_above_what_is_left_is_cut(engine, caplog):
    with caplog.at_level(logging.WARNING, logger="pagedmoe"):
        got = clamp_to_device(engine.memory, 139 * GiB)
    assert got == 130 * GiB - DEVICE_HEADROOM
    assert "is more than this device can give" in caplog.text and "other processes hold 10.00" in caplog.text


def test_budget_that_fits_is_kept(engine):
    assert clamp_to_device(engine.memory, 100 * GiB) == 100 * GiB
