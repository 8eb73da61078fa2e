import os
import sys

import pytest
import torch

# Tiny models on a 2-core machine: one intra-op thread is 10-30x faster than two threads that
# spin against each other (and against other test processes).
torch.set_num_threads(1)
os.environ.setdefault("PAGEDMOE_NO_PROGRESS", "1")
sys.path.insert(0, os.path.dirname(__file__))  # tests/tiny_models.py


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
