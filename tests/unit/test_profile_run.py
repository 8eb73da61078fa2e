"""The profile step start-up runs before sizing the KV cache (engine/profile_run.py): its shape, and that it
runs through the model (paged too) on a temporary KV cache it leaves nothing of. CPU: no bytes measured."""
import pytest

from pagedmoe.engine.profile_run import profile_lengths


def test_profile_lengths_fill_the_largest_step():
    lengths = profile_lengths(8192, 256, 2048)
    assert len(lengths) == 256 and sum(lengths) == 8192          # every sequence samples: largest logits
    assert profile_lengths(100, 4, 10) == [9, 9, 9, 9]             # a prompt leaves room for one token
    assert profile_lengths(5, 8, 100) == [1] * 5
    assert profile_lengths(10, 3, 100) == [4, 3, 3]


@pytest.mark.parametrize("placement", ["resident", "paged"])
def test_profile_step_runs_and_leaves_no_kv_cache(tmp_path, placement):
    from tiny_models import make_tiny_checkpoint

    from pagedmoe.config import EngineConfig
    from pagedmoe.engine.llm_engine import LLMEngine
    from pagedmoe.engine.profile_run import profile_step_bytes

    make_tiny_checkpoint("mixtral", tmp_path, seed=4)
    engine = LLMEngine(EngineConfig(model=str(tmp_path), device="cpu", max_model_len=64, num_kv_blocks=40,
                                    block_size=8, max_num_batched_tokens=96, max_num_seqs=4,
                                    expert_placement=placement))
    model = engine.model
    got = profile_step_bytes(model, 8, engine.device, engine.dtype, "auto", "auto", 4, 64, 96)
    assert got == 0                                                # CPU: nothing measured
    assert all(a.k_cache is None and a.v_cache is None for a in model.attention_layers())
    if model.pager is not None:
        assert model.pager.stats.as_dict()["bytes_h2d"] == 0      # not traffic of the workload
