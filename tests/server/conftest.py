"""Fixtures for the server tests: a tiny random checkpoint and a module-wide server on it."""
from __future__ import annotations

import pytest

from server_utils import MAX_MODEL_LEN, ServerThread, make_engine
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


@pytest.fixture(scope="module")
def client(server):
    """The official `openai` client on the module's server."""
    openai = pytest.importorskip("openai")  # the serve extra; the GPU machine has none
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def ref(tiny_model_dir):
    """The offline API on the same checkpoint: the reference for the server's outputs."""
    from pagedmoe.llm import LLM

    return LLM(str(tiny_model_dir), max_model_len=MAX_MODEL_LEN, max_num_seqs=4)
