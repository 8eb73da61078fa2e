"""ModelRunner.host_inputs against a per-token reference: decode rows, chunks that start and end inside a block,
whole prompts and a pending (async) decode row, in every order (the chunk rows' positions and slots are tensor ops,
the decode rows' Python lists)."""
import itertools
import random
from types import SimpleNamespace

import torch

from pagedmoe.engine.request import Request
from pagedmoe.sampling_params import SamplingParams
from pagedmoe.scheduler_output import ScheduledRequest, SchedulerOutput
from pagedmoe.worker.block_tables import BlockTables
from pagedmoe.worker.model_runner import ModelRunner

BS = 4


def _reference(out: SchedulerOutput, tables: dict[str, list[int]]):
    ids, pos, slots = [], [], []
    for s in out.scheduled:
        req, start, n = s.request, s.num_computed_tokens, s.num_new_tokens
        for p in range(start, start + n):
            pending = n == 1 and p >= req.num_tokens - req.num_pending_tokens
            ids.append(0 if pending else (req.prompt_token_ids + req.output_token_ids)[p])
            pos.append(p)
            slots.append(tables[req.request_id][p // BS] * BS + p % BS)
    return ids, pos, slots


def _rows(rng: random.Random):
    """(request, num_computed, num_new) of each kind of row, with scattered blocks."""
    def req(rid, prompt_len, outputs=0, pending=0):
        r = Request(rid, [rng.randrange(1000) for _ in range(prompt_len)], SamplingParams())
        r.output_token_ids = [rng.randrange(1000) for _ in range(outputs)]
        r.num_pending_tokens = pending
        return r
    return [
        (req("decode", 9, outputs=3), 11, 1),            # decodes its last known token
        (req("chunk", 23), 6, 11),                        # positions 6..16: starts and ends inside a block
        (req("prompt", 13), 0, 13),                       # a whole prompt
        (req("pending", 7, outputs=1, pending=1), 8, 1),  # --async-scheduling: its input is still in flight
        (req("one-block", 3), 0, 3),                      # a prompt shorter than a block
    ]


def test_host_inputs_match_a_per_token_reference():
    rng = random.Random(0)
    rows = _rows(rng)
    for order in itertools.permutations(range(len(rows))):
        tables = {r.request_id: rng.sample(range(200), -(-(start + n) // BS)) for r, start, n in rows}
        out = SchedulerOutput([ScheduledRequest(rows[i][0], rows[i][2], rows[i][1]) for i in order])
        kv = SimpleNamespace(block_table=lambda rid: tables[rid], has=lambda rid: True)
        runner = SimpleNamespace(block_size=BS, block_tables=BlockTables(16))
        host = ModelRunner.host_inputs(runner, out, kv)
        ids, pos, slots = _reference(out, tables)
        assert host["input_ids"].tolist() == ids
        assert host["positions"].dtype == torch.int64 and host["positions"].tolist() == pos
        assert host["slots"].dtype == torch.int64 and host["slots"].tolist() == slots
        assert list(host["pending_ids"].values()) == ["pending"]
        assert host["qsl"].tolist() == list(itertools.accumulate([rows[i][2] for i in order], initial=0))


def test_decode_only_and_single_prompt_steps():
    rng = random.Random(1)
    rows = _rows(rng)
    tables = {r.request_id: list(range(10, 10 + -(-(start + n) // BS))) for r, start, n in rows}
    kv = SimpleNamespace(block_table=lambda rid: tables[rid], has=lambda rid: True)
    for pick in ([0, 3], [2], [1]):
        out = SchedulerOutput([ScheduledRequest(rows[i][0], rows[i][2], rows[i][1]) for i in pick])
        host = ModelRunner.host_inputs(SimpleNamespace(block_size=BS, block_tables=BlockTables(16)), out, kv)
        ids, pos, slots = _reference(out, tables)
        assert (host["input_ids"].tolist(), host["positions"].tolist(), host["slots"].tolist()) == (ids, pos, slots)


def test_fresh_marks_steps_of_whole_prompts_only():
    """AttentionMetadata.fresh (a prefill whose keys are all its own) holds for whole prompts, not when any row
    has cached context (a chunk, a decode row)."""
    rng = random.Random(2)
    rows = _rows(rng)
    tables = {r.request_id: list(range(10, 10 + -(-(start + n) // BS))) for r, start, n in rows}
    kv = SimpleNamespace(block_table=lambda rid: tables[rid], has=lambda rid: True)
    for pick, fresh in (([2, 4], True), ([2], True), ([2, 1], False), ([4, 0], False), ([0, 3], False)):
        out = SchedulerOutput([ScheduledRequest(rows[i][0], rows[i][2], rows[i][1]) for i in pick])
        runner = SimpleNamespace(block_size=BS, block_tables=BlockTables(16), device=torch.device("cpu"))
        inputs = ModelRunner.to_device(runner, ModelRunner.host_inputs(runner, out, kv))
        assert inputs.meta.fresh is fresh, pick


def test_prompt_logprob_rows_follow_the_sampling_rows():
    """SamplingParams.prompt_logprobs: the positions that predict a prompt token go after the sampling rows, in
    prompt_logprob_spans' order (a non-final chunk's last position too, not a whole prompt's); none asked: the
    logits_indices of the sampling rows only."""
    rng = random.Random(1)
    rows = _rows(rng)
    tables = {r.request_id: rng.sample(range(200), -(-(start + n) // BS)) for r, start, n in rows}
    kv = SimpleNamespace(block_table=lambda rid: tables[rid], has=lambda rid: True)
    runner = SimpleNamespace(block_size=BS, block_tables=BlockTables(16))
    out = SchedulerOutput([ScheduledRequest(r, n, start) for r, start, n in rows])
    plain = ModelRunner.host_inputs(runner, out, kv)
    assert plain["num_prompt_rows"] == 0 and plain["logits_indices"].tolist() == [0, 24, 25, 28]
    for r, _, _ in rows:
        r.params.prompt_logprobs = 1
    host = ModelRunner.host_inputs(runner, out, kv)
    # "chunk" (rows 1..11 of the step, positions 6..16 of 23) and "prompt" (rows 12..24, the last one samples)
    assert [(s.request.request_id, list(p)) for s, p in out.prompt_logprob_spans()] == [
        ("chunk", list(range(6, 17))), ("prompt", list(range(12))), ("one-block", list(range(2)))]
    assert host["logits_indices"].tolist() == [0, 24, 25, 28] + list(range(1, 12)) + list(range(12, 24)) + [26, 27]
    assert host["num_prompt_rows"] == 25
