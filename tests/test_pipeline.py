"""Pipeline parallelism: the microbatches each rank holds, read from torch's schedules without a
process group, and one plan per stage under a per-rank budget (slackswap_cli/pipeline/stages.py,
slackswap_cli/run/parallel/pipeline.py). The runs on real ranks are in tests/test_pipeline_ranks.py."""
import dataclasses

import pytest
import torch
from workloads import HW

from slackswap_cli.errors import InfeasibleError, InputError
from slackswap_cli.pipeline.stages import (
    StageCost,
    format_rows,
    held_microbatches,
    plan_stages,
    rank_peak,
    stage_cost,
)
from slackswap_cli.planners import make_plan
from slackswap_cli.run.parallel.pipeline import schedule_order
from slackswap_testkit.synthetic import chain_profile


@pytest.mark.parametrize("name,held", [
    ("GPipe", [8, 8, 8, 8]),
    ("1F1B", [4, 3, 2, 1]),
    ("Interleaved1F1B", [11, 9, 7, 5]),      # chunk-microbatches: two stages per rank
    ("LoopedBFS", [16, 16, 16, 16]),
    ("InterleavedZeroBubble", [8, 8, 8, 8]),
    ("ZBVZeroBubble", [8, 8, 8, 8]),
    ("DualPipeV", [9, 9, 9, 9]),             # OVERLAP_F_B runs its forward before its backward
])
def test_held_microbatches_read_from_torchs_schedules(name, held):
    order = schedule_order(name, 4, 8)
    assert list(held_microbatches(order).values()) == held
    # every rank runs a forward and one backward end for each (stage, microbatch) it owns
    for steps in order.values():
        fwd = {(s, m) for k, s, m in steps if k == "F"}
        ends = [(s, m) for k, s, m in steps if k in ("B", "W")]
        assert sorted(ends) == sorted(fwd) and len(fwd) == len(ends)


def test_1f1b_order_is_the_loop_torch_runs():
    """Schedule1F1B runs `_step_microbatches`, not its `pipeline_order`: the representation
    numbers the last rank's forwards from 1 (microbatch 8 of 0..7, no 0), so read naively it
    holds 2 there where the loop holds 1. The other ranks agree with it."""
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
    ops = get_schedule_ops("1F1B", 4, 8)
    ours = schedule_order("1F1B", 4, 8)
    for rank in range(3):
        theirs = [(a.computation_type.value, a.stage_index, a.microbatch_index)
                  for a in ops[rank] if a is not None and a.computation_type.value in "FB"]
        assert theirs == list(ours[rank])
    assert {a.microbatch_index for a in ops[3] if a is not None
            and a.computation_type.value == "F"} == set(range(1, 9))
    assert ours[3][:4] == (("F", 3, 0), ("B", 3, 0), ("F", 3, 1), ("B", 3, 1))


def test_schedule_errors_are_plain():
    with pytest.raises(InputError, match="no pipeline schedule 'Zigzag'"):
        schedule_order("Zigzag", 4, 8)
    with pytest.raises(InputError, match="pp=0"):
        schedule_order("1F1B", 0, 8)
    with pytest.raises(InputError, match="not a pipeline schedule"):
        schedule_order(42, 4, 8)
    with pytest.raises(InputError, match="DualPipeV requires at least as many microbatches"):
        schedule_order("DualPipeV", 4, 2)
    with pytest.raises(InputError, match="ZBV requires exactly 2 stages per rank"):
        schedule_order("ZBVZeroBubble", 4, 8, stages_per_rank=3)
    with pytest.raises(InputError, match="not a pipeline step"):
        held_microbatches({0: [("X", 0, 0)]})


def test_rank_peak_by_hand():
    # 1F1B rank 0 of 2, 3 microbatches: F0 F1 B0 F2 B1 B2; held 60 each, own peak 100;
    # a backward also holds 10 of pipeline buffers
    steps = schedule_order("1F1B", 2, 3)[0]
    assert steps == (("F", 0, 0), ("F", 0, 1), ("B", 0, 0), ("F", 0, 2), ("B", 0, 1),
                     ("B", 0, 2))
    cost = {0: StageCost(held_bytes=60, peak_bytes=100, boundary_bytes=10)}
    assert rank_peak(steps, cost) == 60 + 100 + 10          # B0 with microbatch 1 held
    assert rank_peak(schedule_order("GPipe", 2, 3)[0], cost) == 2 * 60 + 100 + 10


def test_sends_kept_to_the_step_end_count_after_each_backward():
    """The runtime schedules (Interleaved1F1B, ...) wait for their sends when the step ends:
    each backward leaves its sent output and input gradient behind; GPipe its input gradient;
    1F1B nothing. A stage's output is held from its forward to its backward."""
    from slackswap_cli.pipeline.stages import boundary_bytes
    from slackswap_cli.run.parallel.pipeline import sends_kept
    assert [sends_kept(s) for s in ("1F1B", "GPipe", "Interleaved1F1B", "ZBVZeroBubble")] == \
        ["none", "gpipe", "runtime", "runtime"]
    middle = boundary_bytes(40, 30, first=False, last=False, sends="runtime")
    assert (middle.held, middle.backward, middle.linger) == (40, 40 + 40 + 30, 40 + 30)
    assert boundary_bytes(40, 30, False, False, "gpipe").linger == 30
    assert boundary_bytes(40, 30, False, False, "none").linger == 0
    assert boundary_bytes(40, 30, True, True, "runtime").linger == 0
    assert boundary_bytes(40, 30, False, False, "runtime", local=(True, True)).linger == 0
    with pytest.raises(InputError, match="sends='late'"):
        boundary_bytes(40, 30, False, False, "late")
    # rank 0 of Interleaved1F1B on 2 ranks, 4 microbatches (16 steps, at most 5 pairs
    # held): without sends kept, 4 held and one running: 4 * 60 + 100; with them the last
    # backward runs alone after 7 others, each of which left 70
    steps = schedule_order("Interleaved1F1B", 2, 4)[0]
    plain = {s: StageCost(held_bytes=60, peak_bytes=100) for s in (0, 2)}
    cost = {s: StageCost(held_bytes=60, peak_bytes=100, linger_bytes=70) for s in (0, 2)}
    assert rank_peak(steps, plain) == 4 * 60 + 100
    assert rank_peak(steps, cost) == 100 + 7 * 70


def test_torch_215s_per_step_buffers_by_hand():
    """torch 2.15's PipelineStage ("per-step" buffers): a stage that receives holds that
    microbatch's buffer with it (the last stage until the step ends, its loss keeping it);
    under 1F1B and GPipe a sent output is dropped before the rank's next backward, so a
    backward holds neither its own output nor the others'; the action-list schedules drop it
    right after its own backward (nothing sent lingers but input gradients)."""
    from slackswap_cli.pipeline.stages import boundary_bytes
    from slackswap_cli.run.parallel.pipeline import stage_buffers
    assert [stage_buffers(v) for v in ("2.13.0", "2.14.1+cu130", "2.15.0+cu132", "2.16.0")] \
        == ["reused", "reused", "per-step", "per-step"]
    middle = boundary_bytes(40, 30, False, False, "none", buffers="per-step")
    assert (middle.held, middle.backward, middle.linger, middle.received, middle.released) \
        == (40, 40 + 30, 0, 30, True)
    last = boundary_bytes(40, 30, False, True, "none", buffers="per-step")
    assert (last.backward, last.linger, last.received, last.released) == (40 + 30, 30, 30, False)
    first = boundary_bytes(40, 30, True, False, "runtime", buffers="per-step")
    assert (first.backward, first.linger, first.received, first.released) == (80, 0, 0, False)
    with pytest.raises(InputError, match="buffers='fresh'"):
        boundary_bytes(40, 30, False, False, "none", buffers="fresh")
    # 1F1B rank 0 of 2, 3 microbatches: F0 F1 B0 F2 B1 B2; held 60 of which 40 is the
    # output, own peak 100, a backward 10 more: at F1 microbatch 0 holds all 60 (its send
    # is waited after F1), at B0 microbatch 1 holds 20 (its output's send was waited)
    steps = schedule_order("1F1B", 2, 3)[0]
    cost = {0: StageCost(held_bytes=60, peak_bytes=100, boundary_bytes=10, boundary_held=40,
                         released=True)}
    assert rank_peak(steps, cost) == 60 + 100
    cost = {0: StageCost(held_bytes=60, peak_bytes=100, boundary_bytes=50, boundary_held=40,
                         released=True)}
    assert rank_peak(steps, cost) == 20 + 100 + 50                  # B0
    # GPipe: every output held through the forwards (F2: 2 * 60 + 100), none at a backward
    # (B0: 2 * 20 + 100 + 50, under F2's peak)
    assert rank_peak(schedule_order("GPipe", 2, 3)[0], cost) == 2 * 60 + 100
    cost = {0: dataclasses.replace(cost[0], boundary_bytes=90)}
    assert rank_peak(schedule_order("GPipe", 2, 3)[0], cost) == 2 * 20 + 100 + 90
    # the last rank of 1F1B (F0 B0 F1 B1 F2 B2), receiving 30 a microbatch: each backward
    # leaves its buffer to the step's end, and the running microbatch holds its own: at B2
    # two left behind and one running
    last = {1: StageCost(held_bytes=60 + 30, peak_bytes=100, boundary_bytes=10,
                         linger_bytes=30, received_bytes=30)}
    assert rank_peak(schedule_order("1F1B", 2, 3)[1], last) == 100 + 10 + 30 + 2 * 30


def _chain(n=6):
    return chain_profile(n, act_bytes=1 << 20, fwd_us=100.0)


def test_plan_stages_meets_every_ranks_budget():
    """1F1B on 2 ranks, 4 microbatches: rank 0 holds 2, rank 1 one; under one budget the
    first rank's stage is planned tighter, the last one keeps everything."""
    profiles = {0: _chain(), 1: _chain()}
    order = schedule_order("1F1B", 2, 4)
    keep = stage_cost(profiles[0])
    budget = keep.held_bytes + keep.peak_bytes - (3 << 20)     # rank 0 must free 3 MiB

    def planner(prof, budget_bytes):
        return make_plan("slackswap", prof, HW, budget_bytes)
    planned = plan_stages(order, profiles, budget, planner)
    rows = {r.rank: r for r in planned.rows}
    assert [rows[r].held for r in (0, 1)] == [2, 1]
    assert rows[0].keep_all_peak_bytes > budget >= rows[0].planned_peak_bytes
    assert rows[0].swapped_bytes + rows[0].recomputed_bytes > 0
    assert rows[1].fraction == 1.0 and planned.plans[1] is None     # nothing to do there
    assert rows[1].planned_peak_bytes == rows[1].keep_all_peak_bytes <= budget
    # the row's figures are those of the plan chosen
    cost = stage_cost(profiles[0], planned.plans[0])
    assert rows[0].planned_peak_bytes == rank_peak(order[0], {0: cost})
    assert rows[0].swapped_bytes == 4 * cost.swapped_bytes
    text = format_rows(planned.rows)
    assert text.splitlines()[0].split()[:3] == ["rank", "stages", "held"]
    assert len(text.splitlines()) == 3


def test_plan_stages_refuses_a_budget_below_every_plan():
    profiles = {0: _chain(), 1: _chain()}
    with pytest.raises(InfeasibleError, match="rank 0"):
        plan_stages(schedule_order("GPipe", 2, 4), profiles, 1 << 20,
                    lambda prof, b: make_plan("slackswap", prof, HW, b))
    with pytest.raises(InputError, match="no profile"):
        plan_stages(schedule_order("GPipe", 2, 4), {0: _chain()}, 1 << 30,
                    lambda prof, b: make_plan("slackswap", prof, HW, b))


def test_copy_back_pins_follow_the_simulated_schedule():
    """Every patched stage issues a swap's copy back at the backward op the simulator issued
    it at (`chains.copy_back_pins`, from the plan's schedule), and the plan simulates the same
    with those pins written into its decisions."""
    import dataclasses

    from slackswap_cli.chains import copy_back_pins
    from slackswap_cli.simulate import simulate
    prof = _chain(8)
    plan = make_plan("swap-all", prof, HW, prof.keep_all_peak_bytes // 2)
    assert any(d.action == "swap" for d in plan.decisions)
    pins = copy_back_pins(plan.decisions, plan.schedule)
    pinned = [dataclasses.replace(d, prefetch_at=pins[d.tensor]) if d.tensor in pins else d
              for d in plan.decisions]
    issued = {e.tensor: e.issue_op for e in plan.schedule if e.kind == "prefetch"}
    swaps = [d for d in pinned if d.action == "swap"]
    assert swaps and all(d.prefetch_at == issued[d.tensor] for d in swaps)
    assert all(d.prefetch_at >= prof.n_forward for d in swaps)
    again = simulate(prof, pinned, HW, plan.budget_bytes, record=False)
    assert again.feasible and again.predicted.peak_bytes == plan.predicted.peak_bytes


def test_plan_pipeline_refuses_plainly_before_tracing():
    from slackswap_cli.run.parallel.pipeline import plan_pipeline
    stage = (torch.nn.Linear(4, 4), (torch.randn(2, 4),), None)
    with pytest.raises(InputError, match=r"ranks \[5\] are not in a pipeline of 2 ranks"):
        plan_pipeline({0: stage}, "1F1B", pp=2, microbatches=4, budget="1GiB", ranks=[5])


def _linear_stages(n: int) -> dict:
    torch.manual_seed(0)
    def mlp():
        return torch.nn.Sequential(*[m for _ in range(4) for m in (
            torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.Linear(128, 32),
            torch.nn.Tanh())])
    return {i: (mlp(), (torch.randn(16, 32, requires_grad=i > 0),), None) for i in range(n)}


def _plan(stages, schedule, **kw):
    from slackswap_cli.run.parallel.pipeline import plan_pipeline
    return plan_pipeline(stages, schedule, pp=2, device="fake", measure=False, **kw)


def test_1f1b_with_fewer_microbatches_than_stages_is_refused_with_a_hint_that_works():
    """torch's Schedule1F1B refuses microbatches < stages when it is built; so does planning."""
    with pytest.raises(InputError, match="at least as many microbatches") as err:
        schedule_order("1F1B", 2, 1)
    assert "microbatches=2" in err.value.hint
    assert len(schedule_order("1F1B", 2, 2)) == 2                    # the hint followed
    assert len(schedule_order("GPipe", 2, 1)) == 2                   # its other suggestion


def test_a_stage_the_schedule_does_not_run_is_refused_with_a_hint_that_works():
    stages = _linear_stages(3)
    with pytest.raises(InputError, match=r"stage\(s\) \[2\] given") as err:
        _plan(stages, "1F1B", microbatches=2, budget="1GiB")
    assert "give stages 0 to 1" in err.value.hint
    del stages[2]
    assert _plan(stages, "1F1B", microbatches=2, budget="1GiB").rows    # the hint followed


def test_a_pipe_of_one_stage_per_rank_under_an_interleaved_schedule_is_told_1f1b():
    """A 2-stage pipe under Interleaved1F1B on pp=2 (which runs 4): the hint is a one-stage
    schedule, which runs the pipe's 2 (torch refuses stages_per_rank=1 for Interleaved1F1B)."""
    from types import SimpleNamespace

    from slackswap_cli.run.parallel.pipe_stages import check_stage_count
    pipe = SimpleNamespace(num_stages=2)
    runs = 1 + max(s for steps in schedule_order("Interleaved1F1B", 2, 4).values()
                   for _, s, _ in steps)
    with pytest.raises(InputError, match="the pipe has 2 stages") as err:
        check_stage_count(pipe, runs, "Interleaved1F1B", 2)
    assert err.value.hint.startswith("schedule='1F1B'")
    runs = 1 + max(s for steps in schedule_order("1F1B", 2, 4).values() for _, s, _ in steps)
    check_stage_count(pipe, runs, "1F1B", 2)                          # the hint followed
    with pytest.raises(InputError) as err:          # 4 stages on 2 ranks, one-stage schedule
        check_stage_count(SimpleNamespace(num_stages=4), 2, "1F1B", 2)
    assert err.value.hint.startswith("stages_per_rank=2")


@pytest.mark.parametrize("schedule,tells_1f1b", [("1F1B", False), ("GPipe", True)])
def test_below_the_floor_names_the_budget_and_the_least_that_fits(schedule, tells_1f1b):
    """Below what any plan holds, the error names each short rank's budget and the least it
    holds; the hint's figure plans; 1F1B is suggested only to a schedule that holds more."""
    import re
    stages = _linear_stages(2)
    with pytest.raises(InfeasibleError, match=r"rank 0 \(budget 1000 B, at least") as err:
        _plan(stages, schedule, microbatches=4, budget=1000)
    assert ("(1F1B)" in err.value.hint) == tells_1f1b
    least = int(re.search(r"at least (\d+) bytes", err.value.hint).group(1))
    assert all(r.fits for r in _plan(stages, schedule, microbatches=4, budget=least).rows)


def test_a_per_rank_budget_may_be_a_fraction_of_the_ranks_keep_all_peak():
    """A user probes with a fraction first: 0.6 (or "60%") of each rank's own keep-all peak,
    its held microbatches, boundary buffers and receive buffers counted."""
    stages = _linear_stages(2)
    for budget in (0.6, "60%", {0: 0.6, 1: "60%"}):
        rows = _plan(stages, "1F1B", microbatches=4, budget=budget).rows
        for row in rows:
            assert row.recv_bytes > 0
            assert row.budget_bytes == int(0.6 * (row.keep_all_peak_bytes + row.recv_bytes))
            assert row.fits and row.planned_peak_bytes < row.keep_all_peak_bytes


@pytest.mark.parametrize("name", ["GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble",
                                  "DualPipeV"])
def test_torch_free_orders_are_torchs(name):
    """The CLI's orders (pipeline/orders.py, no torch) are the ones torch's schedules run."""
    from slackswap_cli.pipeline.orders import order
    odd = ((3, 7), (5, 13)) if name in ("ZBVZeroBubble", "DualPipeV") else ()
    for pp, n in ((1, 1), (2, 4), (3, 6), (4, 8), (4, 12), (8, 16), (4, 3), *odd):
        if name == "1F1B" and n < pp or name == "DualPipeV" and n < 2 * pp:
            continue              # (refused: fewer microbatches than stages, as torch does)
        spr = 2 if name in ("Interleaved1F1B", "ZBVZeroBubble", "DualPipeV") else None
        assert order(name, pp, n) == schedule_order(name, pp, n, spr), (pp, n)
    if name == "Interleaved1F1B":
        assert order(name, 4, 8, 3) == schedule_order(name, 4, 8, 3)


def test_eager_excess_counts_at_the_stages_peak():
    """What eager was measured to hold beyond the simulator under a plan (`Boundary.eager`:
    what Python still names of what the plan evicts) is added to the planned stage's peak
    and nowhere else; keeping everything, there is nothing evicted to hold longer."""
    from slackswap_cli.pipeline.stages import Boundary
    prof = _chain()
    plan = make_plan("slackswap", prof, HW, prof.keep_all_peak_bytes // 2)
    plain, more = stage_cost(prof, plan), stage_cost(prof, plan, Boundary(eager=1000))
    assert more.peak_bytes == plain.peak_bytes + 1000
    assert more.held_bytes == plain.held_bytes
    assert stage_cost(prof, None, Boundary(eager=1000)) == stage_cost(prof, None)


def test_a_patched_stage_lines_up_without_its_loss(capfd):
    """PipelineStage runs a stage's module and sends its output (no loss on a stage that is not
    the last): the profile's stand-in loss ops are trailing ops outside every module, not
    counted as missed, so a patched stage says nothing of re-profiling."""
    from slackswap_cli.run.parallel.pipeline import plan_pipeline
    torch.manual_seed(0)

    def stage():
        torch.manual_seed(1)
        return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(),
                                   torch.nn.Linear(64, 64), torch.nn.GELU(),
                                   torch.nn.Linear(64, 16))
    x = torch.randn(4, 16, requires_grad=True)
    planned = plan_pipeline({1: (stage(), (x,), None)}, "GPipe", pp=3, microbatches=4,
                            budget=13_000, ranks=[1], measure=False)
    assert planned.rows[0].keep_all_peak_bytes > 13_000 and planned.plans[1] is not None
    module = stage()
    planned.patch({1: module})
    for _ in range(2):
        out = module(x.detach().requires_grad_())
        torch.autograd.backward(out, torch.ones_like(out))     # as PipelineStage does
    report = module.forward.__slackswap__.last_report
    assert report["lined_up"] == report["expected"] > 0
    assert "lined up" not in capfd.readouterr().err


def test_the_pipeline_api_is_exported_from_the_package():
    """`plan_pipeline` and the schedule readers are part of `slackswap_cli`'s face (loaded
    on first use, as `plan_model` is), the very functions of run/parallel/pipeline.py."""
    import slackswap_cli
    from slackswap_cli.run.parallel import pipeline
    for name in ("plan_pipeline", "PlannedPipeline", "schedule_order", "held_microbatches"):
        assert name in slackswap_cli.__all__ and name in dir(slackswap_cli)
        assert getattr(slackswap_cli, name) is getattr(pipeline, name)
