"""Tensor and expert parallelism (issue 24) on CPU over gloo: two ranks compute what one process does.

Each run starts a second process (parallel/launch.py) and compares greedy tokens (identical) and every
sampling step's logits with the single-process engine's. Tolerance: float32 sums over two ranks add in
another order than one matmul, so logits of magnitude ~3 differ by ~1e-6 (measured up to 1.7e-6);
atol 1e-5 leaves 6x room and still fails a wrong shard (errors of 1e-2 and more).
"""
from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from tiny_models import greedy_logits, make_tiny_checkpoint

# DeepSeek-V2/V3: multi-head latent attention, the latent replicated and the heads split (parallel/sharding.py)
FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "glm4_moe", "deepseek_v2", "deepseek_v3"]
LENGTHS, MAX_TOKENS = (7, 19, 3, 30), 5


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    paths = {}
    for i, fam in enumerate(FAMILIES):
        paths[fam] = tmp_path_factory.mktemp(fam)
        make_tiny_checkpoint(fam, paths[fam], seed=60 + i)
    return paths


_REFS: dict = {}


def _trace(path, device="cpu", max_model_len=96, **flags):
    from pagedmoe import LLM

    llm = LLM(str(path), device=device, max_model_len=max_model_len, **flags)
    try:
        logits, outs = greedy_logits(llm, LENGTHS, max_tokens=MAX_TOKENS, seed=5)
        return logits, [o.outputs[0].token_ids for o in outs], llm.engine
    finally:
        llm.engine.shutdown()


def _reference(path):
    if path not in _REFS:
        _REFS[path] = _trace(path)[:2]
    return _REFS[path]


def _assert_same(ref, got, atol=1e-5):
    (ref_logits, ref_tokens), (got_logits, got_tokens) = ref, got
    assert got_tokens == ref_tokens
    assert len(got_logits) == len(ref_logits)
    for a, b in zip(ref_logits, got_logits):
        torch.testing.assert_close(b, a, rtol=0, atol=atol)


CASES = ([(fam, {}) for fam in FAMILIES]
         + [(fam, dict(enable_expert_parallel=True)) for fam in FAMILIES]
         # paged placement on every rank: under EP each rank pages its own 4 experts
         + [("mixtral", dict(enable_expert_parallel=True, cpu_moe=True)),
            ("qwen3_moe", dict(enable_expert_parallel=True, num_gpu_experts=2)),
            ("olmoe", dict(num_gpu_experts=3))])


@pytest.mark.parametrize("family,flags", CASES, ids=[f"{f}-{'-'.join(k for k in fl) or 'tp'}" for f, fl in CASES])
def test_two_ranks_match_one_process(ckpts, family, flags):
    ref = _reference(ckpts[family])
    logits, tokens, engine = _trace(ckpts[family], tensor_parallel_size=2, **flags)
    _assert_same(ref, (logits, tokens))
    dims = engine.model.dims
    if flags.get("enable_expert_parallel"):
        assert dims.num_experts == 4 and engine.expert_store.table.num_experts == 4  # this rank's share
    else:
        assert dims.num_experts == 8 and dims.moe_intermediate_size == 16  # each expert split in two
    assert dims.num_heads == 2 and (dims.mla is not None or dims.num_kv_heads == 1)
    # `pagedmoe plan --tensor-parallel-size 2` plans the shape this rank was built and planned with
    from pagedmoe.planning.model_shape import ModelShape
    ep = bool(flags.get("enable_expert_parallel"))
    shape = ModelShape.from_hf_config(ckpts[family], 4, tensor_parallel_size=2, expert_parallel=ep)
    from pagedmoe.planning.resolve import rank_shape
    assert shape == dataclasses.replace(rank_shape(engine.config, dims, engine.model.spec, 4), name=shape.name)
    assert shape.num_experts == 8 and shape.experts_per_gpu == (4 if ep else 8)
    if "cpu_moe" in flags or "num_gpu_experts" in flags:
        n = 0 if "cpu_moe" in flags else flags["num_gpu_experts"]
        stats = engine.get_stats()["experts"]
        assert stats.get("resident/fp32", stats.get("resident/bf16", 0)) in (0, n * len(engine.model.moe_layers()))
        assert engine.pager is not None and engine.get_stats()["expert_bytes_h2d"] > 0


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v2"])
def test_two_ranks_swap_preempted_kv_as_one_process(ckpts, family):
    """--swap-space under tensor parallelism: 4 prompts in 5 blocks of 8 preempt; rank 0's scheduler names the host
    blocks and every rank copies its own KV shard out and back with the step. Tokens and logits are the single
    process's under the same flags (the same schedule), and nothing is left swapped."""
    flags = dict(max_model_len=40, block_size=8, num_kv_blocks=5, swap_space=0.01)
    ref = _trace(ckpts[family], **flags)
    logits, tokens, engine = _trace(ckpts[family], tensor_parallel_size=2, **flags)
    assert ref[2].scheduler.num_swapped_total > 0
    assert engine.scheduler.num_swapped_total == ref[2].scheduler.num_swapped_total
    assert engine.scheduler.swap.num_used_blocks == 0
    _assert_same(ref[:2], (logits, tokens))


def test_kv_heads_replicated_when_fewer_than_ranks(ckpts, tmp_path):
    """One KV head, two ranks: each rank holds the head its query heads read (vLLM's replication)."""
    path = tmp_path / "mqa"
    make_tiny_checkpoint("qwen3_moe", path, seed=7, num_key_value_heads=1)
    ref = _trace(path)[:2]
    logits, tokens, engine = _trace(path, tensor_parallel_size=2)
    _assert_same(ref, (logits, tokens))
    assert engine.model.dims.num_kv_heads == 1


def test_split_that_cannot_take_effect(ckpts, tmp_path):
    from pagedmoe import LLM

    with pytest.raises(ValueError, match="does not divide the model's 4 attention heads"):
        LLM(str(ckpts["mixtral"]), device="cpu", tensor_parallel_size=3)
    with pytest.raises(ValueError, match="needs --tensor-parallel-size > 1"):
        LLM(str(ckpts["mixtral"]), device="cpu", enable_expert_parallel=True)
    # --num-gpu-experts counts a rank's experts: refused before any rank starts (check_split), naming both counts
    with pytest.raises(ValueError, match="6 exceeds the 4 experts per layer a rank holds .* the model's 8 over 2"):
        LLM(str(ckpts["mixtral"]), device="cpu", tensor_parallel_size=2, enable_expert_parallel=True,
            num_gpu_experts=6)
    path = tmp_path / "dsv3"
    make_tiny_checkpoint("deepseek_v3", path, seed=1, attention_bias=True)
    with pytest.raises(ValueError, match="multi-head latent attention with biases"):
        LLM(str(path), device="cpu", tensor_parallel_size=2)
    path = tmp_path / "few"
    make_tiny_checkpoint("mixtral", path, seed=1, num_local_experts=3, num_experts_per_tok=1)
    with pytest.raises(ValueError, match="multiple of 4 experts"):
        LLM(str(path), device="cpu", tensor_parallel_size=4, enable_expert_parallel=True)


def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if entry.isdigit() and int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    kids.append(int(entry))
        except (OSError, IndexError, ValueError):
            pass
    return kids


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_torchrun_launch(ckpts, tmp_path):
    """`torchrun --nproc-per-node 2 script.py`: every rank runs the script; LLM(...) returns on rank 0 only."""
    script = tmp_path / "script.py"
    out = tmp_path / "tokens.pt"
    script.write_text(textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {os.path.dirname(__file__) + '/..'!r})
        from tiny_models import greedy_logits
        from pagedmoe import LLM
        llm = LLM({str(ckpts['qwen2_moe'])!r}, device="cpu", max_model_len=96, tensor_parallel_size=2)
        logits, outs = greedy_logits(llm, {LENGTHS!r}, max_tokens={MAX_TOKENS}, seed=5)
        torch.save((logits, [o.outputs[0].token_ids for o in outs]), {str(out)!r})
    """))
    _torchrun(script)
    _assert_same(_reference(ckpts["qwen2_moe"]), torch.load(out))


def _torchrun(script, timeout=120) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PAGEDMOE_NO_PROGRESS="1")
    for attempt in range(2):  # a port found free can be taken by a parallel test before torchrun binds it: once more
        with socket.socket() as s:  # torchrun's --master-port 0 is not shared with the ranks: a free port
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                                 "--master-port", str(port), str(script)], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:  # the ranks too: killing torchrun alone leaves them running
            for pid in [*_children(proc.pid), proc.pid]:
                os.kill(pid, 9)
            stderr = proc.communicate()[1]
            pytest.fail(f"torchrun did not finish in {timeout} s:\n{stderr[-4000:]}")
        if proc.returncode == 0 or "address already in use" not in (stderr + stdout).lower():
            break
    assert proc.returncode == 0, f"torchrun exited {proc.returncode}:\n{stderr[-4000:]}"


def test_torchrun_second_engine_is_refused(ckpts, tmp_path):
    """Under torchrun the other ranks serve the first engine and exit with it: a second LLM(...) on rank 0 (with
    the first still open, or after its shutdown) is a ValueError instead of a wait for ranks that never come."""
    script, out = tmp_path / "script.py", tmp_path / "errors.txt"
    script.write_text(textwrap.dedent(f"""
        from pagedmoe import LLM
        kw = dict(device="cpu", max_model_len=96, tensor_parallel_size=2)
        llm = LLM({str(ckpts['qwen3_moe'])!r}, **kw)
        errors = []
        for shutdown in (False, True):
            if shutdown:
                llm.engine.shutdown()
            try:
                LLM({str(ckpts['qwen3_moe'])!r}, **kw)
            except ValueError as e:
                errors.append(str(e))
        open({str(out)!r}, "w").write("\\n".join(errors))
    """))
    _torchrun(script, timeout=60)
    errors = out.read_text().splitlines()
    assert len(errors) == 2 and all("once per launch" in e for e in errors), errors


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_ranks_outlive_the_starting_thread_and_die_with_rank0(ckpts, tmp_path):
    """LLM(..., tensor_parallel_size=2) built in a thread pool (a web app's start-up, asyncio.to_thread): its rank
    lives on after that thread ends (PR_SET_PDEATHSIG ended it with the thread, and the next step failed with
    gloo's "Connection closed by peer"), and still exits once rank 0's process is killed."""
    script, ready = tmp_path / "script.py", tmp_path / "ready"
    script.write_text(textwrap.dedent(f"""
        import time
        from concurrent.futures import ThreadPoolExecutor
        from pagedmoe import LLM, SamplingParams
        with ThreadPoolExecutor(1) as pool:
            llm = pool.submit(LLM, {str(ckpts['qwen3_moe'])!r}, device="cpu", max_model_len=96,
                              tensor_parallel_size=2).result()
        time.sleep(1)  # the thread is gone: give a signal sent at its end the time to land
        out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        open({str(ready)!r}, "w").write(str(out[0].outputs[0].token_ids))
        time.sleep(600)
    """))
    env = dict(os.environ, OMP_NUM_THREADS="1", PAGEDMOE_NO_PROGRESS="1")
    with open(tmp_path / "stderr", "w+") as err:
        proc = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.DEVNULL, stderr=err)
        workers = []
        try:
            deadline = time.monotonic() + 90
            while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
            workers = _children(proc.pid)
            err.seek(0)
            assert ready.exists(), f"rank 0 exited {proc.poll()}:\n{err.read()[-3000:]}"
            assert len(workers) == 1 and _running(workers[0])
            proc.kill()
            proc.wait(timeout=10)
            deadline = time.monotonic() + 10
            while _running(workers[0]) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not _running(workers[0]), "rank 1 outlived rank 0's process"
        finally:
            proc.kill()
            proc.wait(timeout=10)
            for pid in workers:
                if _running(pid):
                    os.kill(pid, 9)


def test_expert_parallel_triton_skips_the_other_ranks_routes(ckpts, tmp_path):
    """EP=2 with the Triton MoE kernels (the interpreter on CPU): the other rank's routes reach them as -1, so
    they are left out instead of run on local expert 0 at weight 0, and the tokens and logits are the single
    process's (Triton there too)."""
    script = tmp_path / "script.py"
    out = tmp_path / "res.pt"
    script.write_text(textwrap.dedent(f"""
        import os, sys, torch
        os.environ["TRITON_INTERPRET"] = "1"
        sys.path.insert(0, {os.path.dirname(__file__) + '/..'!r})
        sys.path.insert(0, {os.path.dirname(__file__) + '/../kernels'!r})
        from triton_interp import fix_interpreter_index
        fix_interpreter_index()
        from tiny_models import greedy_logits
        from pagedmoe import LLM
        from pagedmoe.kernels import fused_moe
        seen = []
        align = fused_moe.moe_align
        def spy(ids, E, block_m):
            seen.append(bool((ids < 0).any()))
            return align(ids, E, block_m)
        fused_moe.moe_align = spy
        res = {{}}
        for name, flags in (("one", {{}}), ("ep", dict(tensor_parallel_size=2, enable_expert_parallel=True))):
            seen.clear()
            llm = LLM({str(ckpts['mixtral'])!r}, device="cpu", max_model_len=96, moe_backend="triton", **flags)
            logits, outs = greedy_logits(llm, {LENGTHS!r}, max_tokens={MAX_TOKENS}, seed=5)
            llm.engine.shutdown()
            res[name] = (logits, [o.outputs[0].token_ids for o in outs], any(seen))
        torch.save(res, {str(out)!r})
    """))
    env = dict(os.environ, OMP_NUM_THREADS="1", PAGEDMOE_NO_PROGRESS="1", TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, str(script)], env=env, timeout=600, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = torch.load(out)
    (ref_logits, ref_tokens, ref_dropped), (logits, tokens, dropped) = res["one"], res["ep"]
    assert not ref_dropped and dropped          # -1 routes only under EP, and they reached the kernels
    _assert_same((ref_logits, ref_tokens), (logits, tokens))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("flags", [{}, dict(enable_expert_parallel=True),
                                   dict(enable_expert_parallel=True, cpu_moe=True)])
def test_nccl_two_gpus_match_one(ckpts, flags):
    """The same over NCCL on two GPUs (float32, so one GPU's logits are the reference within 1e-4)."""
    for fam in ("mixtral", "qwen3_moe"):
        ref = _trace(ckpts[fam], device="cuda", dtype="float32")[:2]
        got = _trace(ckpts[fam], device="cuda", dtype="float32", tensor_parallel_size=2, **flags)[:2]
        _assert_same(ref, got, atol=1e-4)
