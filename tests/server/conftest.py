"""Fixtures for the server tests: a tiny random checkpoint and a module-wide server on it."""
from __future__ import annotations

import pytest

from server_utils import ServerThread, make_engine
from tiny_models import make_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen3_moe")
    make_tiny_checkpoint("qwen3_moe", path)
    return path


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with ServerThread(make_engine(tiny_model_dir)) as s:
        yield s
