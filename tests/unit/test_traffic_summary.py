"""The pager's one-line traffic summary (engine/expert_stats.py::traffic_summary): the copy rate and the hidden share
come from the eager steps the CUDA events timed, never from bytes that graph replays moved untimed."""
from pagedmoe.engine.expert_stats import traffic_summary


def _stats(**kw):
    base = dict(expert_bytes_h2d=0, expert_bytes_decoded=0, expert_copy_s=0.0, expert_wait_s=0.0, expert_steps=0,
                expert_timed_steps=0, expert_timed_bytes_h2d=0)
    base.update(kw)
    return base


def test_rate_is_the_timed_steps_bytes_over_their_copy_time():
    # 1032 steps moved 2308 GB; only 10 eager steps were timed: 22.4 GB in 0.448 s = 50 GB/s (a PCIe rate), not
    # 2308 GB / 0.448 s
    now = _stats(expert_bytes_h2d=2308e9, expert_copy_s=0.448, expert_wait_s=0.112, expert_steps=1032,
                 expert_timed_steps=10, expert_timed_bytes_h2d=22.4e9)
    line = traffic_summary(now, None, cuda=True)
    assert "2308.00 GB host->device over 1032 steps (2.236 GB/step)" in line
    assert "(50.0 GB/s," in line
    assert "in the 10 eager steps timed" in line
    assert "75% of copying hidden" in line


def test_every_step_timed_says_no_more_and_since_subtracts():
    since = _stats(expert_bytes_h2d=1e9, expert_copy_s=0.1, expert_steps=5, expert_timed_steps=5,
                   expert_timed_bytes_h2d=1e9)
    now = _stats(expert_bytes_h2d=3e9, expert_copy_s=0.14, expert_wait_s=0.0, expert_steps=7, expert_timed_steps=7,
                 expert_timed_bytes_h2d=3e9)
    line = traffic_summary(now, since, cuda=True)
    assert "2.00 GB host->device over 2 steps" in line
    assert "(50.0 GB/s," in line and "eager steps timed" not in line and "100% of copying hidden" in line


def test_untimed_run_says_so():
    line = traffic_summary(_stats(expert_bytes_h2d=4e9, expert_steps=4), None, cuda=True)
    assert line.endswith("copy time not timed (CUDA-graph replays)")
