"""A pipeline of equal stages from one stage's profile: each rank's memory and the step's time
with the schedule's bubbles (`slackswap simulate --pp` and `show --pp`).

The profile is one stage's, for one microbatch (a workload that returns one stage of the
model); every stage of the pipeline is priced as it: the per-rank figures are those of a
pipeline split into equal stages. Per rank: the (chunk-)microbatches the schedule holds there
(`pipeline.held_microbatches`), the activation peak keeping everything and under the plan
(`stages.rank_peak`, with what PipelineStage holds beyond the profile: `boundary_of`), the
bytes swapped and recomputed per step.

The step's time: every rank runs its steps in the schedule's order, a forward of stage s
after the same microbatch's forward of stage s - 1, a backward after the same microbatch's
backward of stage s + 1 (`timeline`); a forward takes the profile's forward time, a backward
the rest of the plan's predicted step (its recomputes and stalls included), a split
backward's input pass and weight pass (ZBVZeroBubble, DualPipeV) half of it each, the previous stage's
backward waiting for the input pass. What a split backward holds from its input pass to its
weight pass beyond the saved activations (`Boundary.split`: the gradients its weight pass
starts from, measured on the stage module by `plan_pipeline`) is not in a profile, so not
counted here. Each rank's receive buffers (`recv_buffer_bytes`: a stage's input and its
output's gradient, the profile's output size, per microbatch) count against `--rank-budget`
beside the activation peak (a row's `fits`). Sends and
receives take no time here (on one node they are small against a stage's compute); a rank's
idle time (its bubbles) is the step's time less its own work.

Torch-free.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from ..schema import Plan, Profile
from .orders import order as schedule_steps
from .stages import (
    Boundary,
    RankRow,
    Step,
    boundary_bytes,
    held_microbatches,
    output_held,
    rank_peak,
    recv_buffer_bytes,
    stage_cost,
)

__all__ = ["SENDS_OF", "output_roots", "boundary_of", "timeline", "PipelineFigures",
           "pipeline_figures"]

SENDS_OF = {"GPipe": "gpipe", "1F1B": "none", "Interleaved1F1B": "runtime",
            "ZBVZeroBubble": "runtime", "DualPipeV": "runtime"}


def output_roots(prof: Profile) -> frozenset:
    """The stage's output in the profile: the activation roots made by a module's op and read
    by the loss (the forward ops after the last one of a module)."""
    fwd = prof.ops[:prof.n_forward]
    last = max((op.id for op in fwd if op.module), default=-1)
    roots = set()
    for op in fwd[last + 1:]:
        for tid in op.inputs:
            t = prof.tensors[prof.root(tid)]
            if t.kind == "activation" and t.producer is not None and t.producer <= last:
                roots.add(t.id)
    return frozenset(roots)


def boundary_of(prof: Profile, stage: int, n_stages: int, sends: str,
                local: tuple[bool, bool] = (False, False)) -> Boundary:
    """What stage `stage` of `n_stages` equal ones holds beyond the profile: its output (as
    the profile reads it), its input's gradient the size of the previous stage's output."""
    pinned = output_roots(prof)
    out = sum(prof.tensors[r].size_bytes for r in pinned)
    b = boundary_bytes(out, out, stage == 0, stage == n_stages - 1, sends, local)
    return b._replace(pinned=pinned, held=output_held(prof, pinned, out))


def timeline(order: Mapping[int, Sequence[Step]], fwd_us: float,
             bwd_us: float) -> tuple[float, dict[int, float]]:
    """(the step's time, rank -> its busy time): each rank runs its steps in order, each
    waiting for the step it depends on (see the module docstring)."""
    done: dict[tuple[str, int, int], float] = {}
    n_stages = 1 + max((s for steps in order.values() for _, s, _ in steps), default=0)
    pos = {r: 0 for r in order}
    free = {r: 0.0 for r in order}
    busy = {r: 0.0 for r in order}
    left = sum(len(s) for s in order.values())
    while left:
        moved = False
        for rank, steps in order.items():
            while pos[rank] < len(steps):
                kind, stage, mb = steps[pos[rank]]
                dep = (("F", stage - 1, mb) if kind == "F" and stage > 0 else
                       ("B", stage + 1, mb) if kind != "F" and stage < n_stages - 1 else None)
                if dep is not None and dep not in done:
                    break
                start = max(free[rank], done.get(dep, 0.0))
                took = fwd_us if kind == "F" else bwd_us if kind == "B" else bwd_us / 2
                # (the previous stage's backward waits for an input pass, not a weight pass)
                key = "F" if kind == "F" else "W" if kind == "W" else "B"
                free[rank] = done[(key, stage, mb)] = start + took
                busy[rank] += took
                pos[rank] += 1
                left -= 1
                moved = True
        if not moved:
            raise ValueError("the schedule's order waits on a step no rank runs: this is a bug in slackswap")
    return max(free.values(), default=0.0), busy


@dataclass(frozen=True)
class PipelineFigures:
    schedule: str
    pp: int
    microbatches: int
    rows: tuple[RankRow, ...]
    step_us: float                  # with the bubbles
    keep_all_step_us: float
    idle_us: dict[int, float]       # rank -> its bubbles under the plan
    swap_copy_us: dict[int, float]  # rank -> time its swaps' copies take per step, one way
    # with `hw`: the rank-level judge (pipeline_copies.judge), copies on each rank's engines
    judged_step_us: float | None = None
    exposed_us: dict[int, float] | None = None      # rank -> compute waiting for copies
    judged_peak_bytes: dict[int, int] | None = None  # rank -> peak with copies in flight


def pipeline_figures(prof: Profile, plan: Plan | None, schedule: str, pp: int,
                     microbatches: int, stages_per_rank: int = 2, rank_budget: int = 0,
                     copy_us_per_byte: float = 0.0, hw=None) -> PipelineFigures:
    """Per rank and for the step, a pipeline of stages like `prof` under `plan` (None: keep
    everything). `rank_budget`: each rank's activation memory (a row's `fits`);
    `copy_us_per_byte`: the host link's time per byte (for `swap_copy_us`); `hw`: the
    hardware, for the rank-level judge's figures (`judged`)."""
    steps = schedule_steps(schedule, pp, microbatches, stages_per_rank)
    n_stages = 1 + max(s for st in steps.values() for _, s, _ in st)
    rank_of = {s: r for r, st in steps.items() for _, s, _ in st}
    sends = SENDS_OF[schedule]
    bound = {s: boundary_of(prof, s, n_stages, sends,
                            (rank_of.get(s - 1) == rank_of[s], rank_of.get(s + 1) == rank_of[s]))
             for s in range(n_stages)}
    held = held_microbatches(steps)
    out = sum(prof.tensors[r].size_bytes for r in output_roots(prof))
    recv = recv_buffer_bytes(steps, microbatches, dict.fromkeys(rank_of, out),
                             dict.fromkeys(rank_of, out))
    fwd = float(prof.summary.get("forward_us", 0.0))
    keep_bwd = float(prof.summary.get("backward_us", 0.0))
    bwd = (plan.predicted.step_us - fwd) if plan is not None else keep_bwd
    rows, idle, copy = [], {}, {}
    step_us, busy = timeline(steps, fwd, max(0.0, bwd))
    keep_step, _ = timeline(steps, fwd, keep_bwd)
    for rank, st in sorted(steps.items()):
        stages = tuple(sorted({s for _, s, _ in st}))
        keep = {s: stage_cost(prof, None, bound[s]) for s in stages}
        cost = {s: stage_cost(prof, plan, bound[s]) for s in stages} if plan else keep
        n = sum(1 for k, _, _ in st if k == "F")
        swapped = sum(cost[s].swapped_bytes for s in stages) * n // len(stages)
        recomputed = sum(cost[s].recomputed_bytes for s in stages) * n // len(stages)
        fraction = (plan.budget_bytes / prof.keep_all_peak_bytes
                    if plan is not None and prof.keep_all_peak_bytes else 1.0)
        rows.append(RankRow(rank, stages, held[rank], rank_budget, rank_peak(st, keep),
                            rank_peak(st, cost), swapped, recomputed, min(1.0, fraction),
                            recv_bytes=recv[rank]))
        idle[rank] = step_us - busy[rank]
        copy[rank] = swapped * copy_us_per_byte
    figs = PipelineFigures(schedule, pp, microbatches, tuple(rows), step_us, keep_step, idle,
                           copy)
    return figs if hw is None else judged(figs, prof, plan, steps, bound, hw, rank_budget)


def judged(figs: PipelineFigures, prof: Profile, plan: Plan | None, steps, bound, hw,
           rank_budget: int) -> PipelineFigures:
    """`figs` with the rank-level judge's step, exposed copy time and peaks, every stage
    priced as `prof` under `plan`."""
    from dataclasses import replace

    from .copies import judge, stage_work
    work = {s: stage_work(prof, plan, hw, b) for s, b in bound.items()}
    got = judge(steps, work, rank_budget)
    return replace(figs, judged_step_us=got.step_us,
                   exposed_us={r: j.exposed_us for r, j in got.ranks.items()},
                   judged_peak_bytes={r: j.peak_bytes for r, j in got.ranks.items()})
