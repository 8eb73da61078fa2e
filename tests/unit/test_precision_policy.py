"""Precision ladder, quality costs, budget policy and pressure controller (experts/dynamic/precision.py), on fake numbers."""
import pytest

from pagedmoe.codecs.quant import expert_bytes
from pagedmoe.experts.dynamic.controller import PressureController, Watermarks
from pagedmoe.experts.dynamic.precision import (LADDER, Move, PrecisionPolicy, QualityCosts,
                                               rung_bytes)

BYTES = {"bf16": 100, "lossless": 68, "fp8": 51, "int8": 51, "int4": 27}
REL = {"fp8": 0.03, "int8": 0.01, "int4": 0.10}


def costs(activity):
    """activity: {key: share}; the same relative errors for every expert."""
    return QualityCosts({k: dict(REL) for k in activity}, dict(activity))


def four_experts():
    return costs({(0, 0): 0.6, (0, 1): 0.3, (0, 2): 0.09, (0, 3): 0.01})


def rank(p):
    return LADDER.index(p)


def test_rung_bytes_match_quantiser_accounting():
    b = rung_bytes(384, 64, lossless_ratio=0.7)
    for p in ("bf16", "fp8", "int8", "int4"):
        assert b[p] == expert_bytes(p, 384, 64)
    assert b["lossless"] == int(2 * 3 * 64 * 384 * 0.7 + 0.999)
    assert list(b) == list(LADDER)


def test_frontier_drops_dominated_lossy_rungs():
    pol = PrecisionPolicy(BYTES, four_experts())
    # fp8 and int8 take the same bytes; int8 is more accurate here, so fp8 is skipped.
    assert pol.frontier((0, 0)) == ["bf16", "lossless", "int8", "int4"]
    c = QualityCosts({(0, 0): {"fp8": 0.01, "int8": 0.02, "int4": 0.1}}, {(0, 0): 1.0})
    assert PrecisionPolicy(BYTES, c).frontier((0, 0)) == ["bf16", "lossless", "fp8", "int4"]


def test_full_budget_keeps_everything_exact():
    pol = PrecisionPolicy(BYTES, four_experts())
    plan = pol.plan(400)
    assert set(plan.values()) == {"bf16"}


def test_exact_rungs_before_any_lossy():
    pol = PrecisionPolicy(BYTES, four_experts())
    plan = pol.plan(4 * 68)                   # an all-lossless plan fits: nothing is quantised
    assert set(plan.values()) == {"lossless"}
    plan = pol.plan(4 * 68 - 1)               # one lossy expert: the least active one
    assert plan[(0, 3)] == "int8" and all(plan[k] == "lossless" for k in [(0, 0), (0, 1), (0, 2)])


def test_plan_respects_budget_and_is_monotonic():
    acts = {(l, e): (e + 1) * (l + 1) / 100 for l in range(3) for e in range(8)}
    pol = PrecisionPolicy(BYTES, costs(acts))
    prev = None
    for budget in range(24 * 100, 24 * 27 - 1, -37):
        plan = pol.plan(budget)
        assert pol.total_bytes(plan) <= budget
        if prev is not None:   # less memory never raises any expert's precision
            assert all(rank(plan[k]) >= rank(prev[k]) for k in plan)
            assert pol.total_cost(plan) >= pol.total_cost(prev)
        prev = plan
    assert set(pol.plan(24 * 27).values()) == {"int4"}
    with pytest.raises(ValueError, match="minimum"):
        pol.plan(24 * 27 - 1)


def test_plan_prefers_demoting_quiet_experts():
    pol = PrecisionPolicy(BYTES, four_experts())
    plan = pol.plan(68 + 68 + 27 + 27)
    # Worked by hand: lossless for all (272), then by bytes saved per cost added: (0,3)->int8 (1.7e5 B per
    # unit cost), (0,3)->int4 (2.7e4), (0,2)->int8 (1.9e4), (0,1)->int8 (5.7e3), (0,2)->int4 (3.0e3): 173 <= 190.
    assert plan == {(0, 0): "lossless", (0, 1): "int8", (0, 2): "int4", (0, 3): "int4"}
    # Static int8 (204 B) does not fit 190 B; static int4 does, at a much higher cost.
    assert pol.total_bytes({k: "int8" for k in plan}) > 190
    assert pol.total_cost(plan) < 0.2 * pol.total_cost({k: "int4" for k in plan})


def test_floor():
    pol = PrecisionPolicy(BYTES, four_experts(), min_precision="int8")
    assert pol.plan(4 * 51) == {k: "int8" for k in four_experts().keys()}
    with pytest.raises(ValueError):
        pol.plan(4 * 51 - 1)
    pol = PrecisionPolicy(BYTES, four_experts(), min_precision="lossless")
    assert set(pol.plan(4 * 68).values()) == {"lossless"}
    with pytest.raises(ValueError):
        PrecisionPolicy(BYTES, four_experts(), min_precision="bf16", max_precision="int8")


def test_lru_breaks_ties():
    c = costs({(0, e): 0.25 for e in range(4)})
    pol = PrecisionPolicy(BYTES, c)
    last = {(0, 0): 9, (0, 1): 3, (0, 2): 7, (0, 3): 5}
    plan = pol.plan(3 * 100 + 68, last_access=last)
    assert plan[(0, 1)] == "lossless" and sum(p == "bf16" for p in plan.values()) == 3


def test_activity_refresh_changes_ranking():
    c = four_experts()
    pol = PrecisionPolicy(BYTES, c)
    assert pol.plan(3 * 68 + 27)[(0, 3)] == "int4"
    c.update_activity({(0, 0): 0.01, (0, 1): 0.3, (0, 2): 0.09, (0, 3): 0.6})
    assert pol.plan(3 * 68 + 27)[(0, 0)] == "int4"


def test_quality_costs_from_counts_and_json():
    rel = {(0, 0): dict(REL), (0, 1): dict(REL)}
    c = QualityCosts.from_counts(rel, {(0, 0): 8}, smoothing=1.0)
    assert c.activity == {(0, 0): 0.9, (0, 1): 0.1}
    assert c.cost((0, 1), "int4") == pytest.approx(0.01)
    assert c.cost((0, 1), "lossless") == 0.0
    back = QualityCosts.from_json(c.to_json())
    assert back.rel_error == c.rel_error and back.activity == c.activity


# -- pressure controller ----------------------------------------------------------------------------
def controller(max_bytes=1000):
    acts = {(0, e): 1 / (e + 1) for e in range(8)}
    pol = PrecisionPolicy(BYTES, costs(acts))
    return PressureController(pol, Watermarks(low=10, high=30), block_bytes=10, max_bytes_per_step=max_bytes,
                              assignment={k: "bf16" for k in acts})


def simulate(ctl, free, last, steps):
    """Apply moves; bytes freed by experts become KV blocks (and promotions take them back)."""
    history = []
    for _ in range(steps):
        moves = ctl.step(free, last)
        ctl.applied(moves)
        free -= sum(m.bytes_delta for m in moves) // ctl.block_bytes
        history.append((free, moves))
    return free, history


def test_hysteresis_band_does_nothing():
    ctl = controller()
    for free in (10, 20, 30):
        assert ctl.step(free, {}) == []


def test_demotes_under_pressure_one_rung_and_bounded_per_step():
    ctl = controller(max_bytes=70)
    moves = ctl.step(0, {})
    assert moves and sum(-m.bytes_delta for m in moves) <= 70
    assert all(m.bytes_delta < 0 and rank(m.dst) > rank(m.src) for m in moves)
    assert len({m.key for m in moves}) == len(moves)               # one rung per expert per step
    assert all(m.src == "bf16" and m.dst == "lossless" for m in moves)   # exact first


def test_pressure_then_relief_round_trip():
    ctl = controller(max_bytes=120)
    start = dict(ctl.assignment)
    free, hist = simulate(ctl, 0, {}, 20)
    assert free >= ctl.watermarks.mid                               # pressure relieved
    assert any(p not in ("bf16",) for p in ctl.assignment.values())
    for _, moves in hist:
        assert sum(abs(m.bytes_delta) for m in moves) <= 120
    demoted = dict(ctl.assignment)
    # Stable in the band: no more moves.
    assert ctl.step(free, {}) == []
    # Pressure eases (requests finished: 100 blocks freed): promotes back, never below the midpoint.
    free, hist = simulate(ctl, free + 100, {}, 40)
    for f, moves in hist:
        assert f >= ctl.watermarks.mid
        assert all(m.bytes_delta > 0 for m in moves)
    assert ctl.assignment == start
    assert any(demoted[k] != start[k] for k in start)


def test_progressive_demotion_keeps_busy_experts_exact():
    ctl = controller(max_bytes=200)
    simulate(ctl, -20, {}, 3)   # deep pressure: free rises by what is demoted
    a = ctl.assignment
    # the busiest expert (0, 0) is never lossier than the quietest (0, 7)
    assert rank(a[(0, 0)]) <= rank(a[(0, 7)])


def test_controller_lru_tie_break_and_applied_checks():
    c = costs({(0, e): 0.25 for e in range(4)})
    pol = PrecisionPolicy(BYTES, c)
    ctl = PressureController(pol, Watermarks(5, 15), block_bytes=32, max_bytes_per_step=32,
                             assignment={(0, e): "bf16" for e in range(4)})
    moves = ctl.step(0, {(0, 0): 4, (0, 1): 8, (0, 2): 1, (0, 3): 6})
    assert [m.key for m in moves] == [(0, 2)]
    with pytest.raises(ValueError):
        ctl.applied([Move((0, 1), "int8", "int4", -24)])
    with pytest.raises(ValueError):
        Watermarks(5, 5)
