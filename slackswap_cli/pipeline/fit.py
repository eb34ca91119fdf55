"""`slackswap fit --pp`: one row of the batch sweep for a pipeline of stages like the workload.

The workload is one pipeline stage (as examples/gpt_stage.py) and the batch is the
microbatch. Every stage of the pipeline is priced as it, or, with `--stage-arg` (the workload
argument that picks the stage: `StageProfiles`), each stage is profiled and priced as it is
(the first with its embeddings, the last with its head and loss; `pipeline_step.pipeline_figures`).
Per rank:

- **static memory** (`rank_static`): its stages' parameters, gradients, optimizer state and
  buffers (`fit.static_memory` of each stage, `--shard` as without a pipeline but for what
  FSDP2 holds unsharded), summed over the stages the rank runs (`stages_per_rank` with
  Interleaved1F1B and ZBVZeroBubble, else one); the batch's inputs once;
- the **activation budget**: device memory - that static memory - the reserve; the rank's
  receive buffers count in it: all step beside its activation peak where PipelineStage keeps
  them (`buffers` "reused", torch 2.13 and 2.14: `stages.recv_buffer_bytes`,
  `rank_recv_bytes`), with each microbatch in the peak where it allocates them every step
  ("per-step", torch 2.15; `pipeline_step.buffers_of`, `fit --buffers`);
- one plan per stage (the same on every stage priced as one profile), each made at the same
  point between its stage's activation floor and its keep-all peak, the largest (bisected) at
  which EVERY rank, with the (chunk-)microbatches the schedule makes it hold, stays under its
  activation budget (`stages.rank_peak`, through `pipeline_figures`).

The step's time is the rank-level judge's (`pipeline_copies.judge`: every rank runs its
schedule's order, waiting for the step it depends on, the plans' copies on each rank's shared
engines): samples/s counts the global batch (microbatch x microbatches) over that step.
`bubble_step_us` is the step with the schedule's bubbles and no copies
(`pipeline_step.timeline`), `bubble_fraction` the ranks' mean idle time over it. Per rank the
compute time that waits for copies (`rank_exposed_copy_us`) and the peak with copies in
flight (`rank_judged_peak_bytes`). The plan written is the first stage's.

Torch-free.
"""
from __future__ import annotations

from typing import Callable

from ..fit import (
    FitSettings,
    StaticMemory,
    check_static_fits,
    infeasible_row,
    plan_kind,
    plan_row,
    row_head,
    tokens_per_sample,
)
from ..schema import Plan, Profile
from ..simulate import budget_floor_bytes
from ..units import fmt_bytes
from .orders import V_SCHEDULES, PipelineSpec, order, pipeline_spec
from .step import PipelineFigures, pipeline_figures

__all__ = ["stages_on_rank", "rank_static", "StageProfiles", "pipeline_row", "row_maker"]

# plans that do not change with the budget
FIXED = ("keep-all", "checkpoint-layers", "torchtitan-sac", "full-ac", "megatron-selective")
BISECTIONS = 8


def stages_on_rank(spec: PipelineSpec) -> int:
    return spec.stages_per_rank if spec.schedule in ("Interleaved1F1B", *V_SCHEDULES) else 1


def rank_static(static: StaticMemory | list[StaticMemory], stages: int = 1,
                shard: int = 1) -> StaticMemory:
    """A rank's static memory: `stages` stages like `static`, or the stages listed, summed
    (see the module docstring); the batch's inputs once. Sharded over `shard` FSDP2 ranks, a
    stage's parameters stay unsharded and its unsharded gradients accumulate from its first
    microbatch's backward to its last (PipelineStage runs the others without gradient sync and
    without resharding): twice the stage's parameters unsharded (each rank's padded chunk
    times `shard`), not FSDP2's root and two blocks."""
    each = static if isinstance(static, list) else [static] * stages

    def unsharded(st: StaticMemory) -> int:
        return (2 * st.params_bytes * shard if shard > 1 and st.unsharded_bytes
                else st.unsharded_bytes)
    return StaticMemory(params_bytes=sum(st.params_bytes for st in each),
                        grads_bytes=sum(st.grads_bytes for st in each),
                        optimizer_bytes=sum(st.optimizer_bytes for st in each),
                        buffers_bytes=sum(st.buffers_bytes for st in each),
                        inputs_bytes=max(st.inputs_bytes for st in each),
                        unsharded_bytes=sum(unsharded(st) for st in each))


class StageProfiles:
    """`fit.sweep`'s profile_at with a profile per stage: `profile_at(batch)` profiles every
    stage at `batch` (stage -> its profiler, each `profiler(batch)` -> (profile, facts)),
    keeps them (`got[batch]`: stage -> (profile, facts)) and gives the sweep the first
    stage's. No batch is derived from others (each stage would need it)."""

    def __init__(self, profilers: dict):
        self.profilers, self.got = profilers, {}

    def __call__(self, batch: int):
        got = {s: profiler(batch) for s, profiler in sorted(self.profilers.items())}
        self.got[batch] = got
        return got[0]

    def close(self) -> None:
        for profiler in self.profilers.values():
            profiler.close()


def _fits(figs: PipelineFigures | None) -> bool:
    return figs is not None and all(r.fits for r in figs.rows)


def _search(at: Callable[[int], tuple[Plan, PipelineFigures | None]], floor: int, keep: int,
            fixed: bool):
    """(plan, figures) at the largest point in [floor, keep] where every rank fits (keep
    itself first), else the floor's (which does not fit)."""
    plan, figs = at(keep)
    if _fits(figs) or fixed or floor >= keep:
        return plan, figs
    low = at(floor)
    if not _fits(low[1]):
        return low
    lo, hi, best = floor, keep, low
    for _ in range(BISECTIONS):
        mid = (lo + hi) // 2
        got = at(mid)
        if _fits(got[1]):
            lo, best = mid, got
        else:
            hi = mid
    return best


SCALE = 1 << 16     # per-stage plans: the point between each stage's floor and keep-all peak


class _Stages:
    """The stages' profiles and static memory, per rank its static memory and budget."""

    def __init__(self, prof: Profile, static: StaticMemory, s: FitSettings, spec: PipelineSpec,
                 stages: dict | None, buffers: str = "reused"):
        self.buffers = buffers
        self.steps = order(spec.schedule, spec.pp, spec.microbatches, spec.stages_per_rank)
        n_stages = 1 + max(st for steps in self.steps.values() for _, st, _ in steps)
        self.one = stages is None
        self.profs = ({st: prof for st in range(n_stages)} if self.one
                      else {st: stages[st][0] for st in range(n_stages)})
        statics = ({st: static for st in range(n_stages)} if self.one
                   else {st: check_static_fits(stages[st][1], s) for st in range(n_stages)})
        self.static = {r: rank_static([statics[st] for st in sorted({x for _, x, _ in steps})],
                                       shard=s.shard)
                       for r, steps in self.steps.items()}
        self.budget = {r: s.memory_bytes - st.total - s.reserve_bytes
                       for r, st in self.static.items()}

    def budgets(self, x: int) -> dict[int, int]:
        """stage -> its budget at point `x` (one profile: `x` is the budget)."""
        if self.one:
            return dict.fromkeys(self.profs, x)
        return {st: budget_floor_bytes(p) + (p.keep_all_peak_bytes - budget_floor_bytes(p))
                * x // SCALE for st, p in self.profs.items()}

    def range(self) -> tuple[int, int]:
        p = self.profs[0]
        return (budget_floor_bytes(p), p.keep_all_peak_bytes) if self.one else (0, SCALE)


def _planner(kind: str, stg: _Stages, s: FitSettings, spec: PipelineSpec, copy: float):
    """x -> (the first stage's plan, figures or None) with every stage planned at point x."""
    memo: dict = {}
    options = s.planner_options if kind == s.planner else {}

    def at(x: int):
        if x not in memo:
            plans = {}
            for st, budget in stg.budgets(x).items():
                key = (id(stg.profs[st]), budget)
                if key not in memo:
                    memo[key] = plan_kind(kind, stg.profs[st], s.hardware, budget, options)
                plans[st] = memo[key]
            figs = (pipeline_figures(stg.profs, plans, spec.schedule, spec.pp,
                                     spec.microbatches, spec.stages_per_rank, stg.budget, copy,
                                     buffers=stg.buffers)
                    if all(p.feasible for p in plans.values()) else None)
            memo[x] = (plans, figs)
        return memo[x]
    return at


def pipeline_row(kind: str, batch: int, prof: Profile, static: StaticMemory, s: FitSettings,
                 spec: PipelineSpec, stages: dict | None = None,
                 buffers: str = "reused") -> tuple[dict, Plan | None]:
    """One row of the sweep for the pipeline `spec` at microbatch `batch` (module docstring).
    `stages`: stage -> (profile, facts) of each stage at this batch (None: every stage as
    `prof`); `buffers`: how its PipelineStages hold their buffers (`stages.BUFFERS`)."""
    stg = _Stages(prof, static, s, spec, stages, buffers)
    worst = max(stg.static, key=lambda r: stg.static[r].total)
    budget = min(stg.budget.values())
    row = row_head(batch, kind, stg.static[worst], s)
    row.update(budget_bytes=budget, keep_all_peak_bytes=prof.keep_all_peak_bytes,
               pipeline={**spec._asdict(), "buffers": buffers}, global_batch=batch * spec.microbatches,
               rank_budget_bytes=[stg.budget[r] for r in sorted(stg.budget)],
               rank_peak_bytes=None, rank_held=None, rank_recv_bytes=None,
               worst_rank_peak_bytes=None,
               bubble_fraction=None, bubble_step_us=None, judged_step_us=None,
               rank_exposed_copy_us=None, rank_judged_peak_bytes=None)
    if budget <= 0:
        return infeasible_row(row, f"a rank's static memory and reserve exceed the device by "
                        f"{fmt_bytes(-budget)}"), None
    hw = s.hardware
    copy = 1e6 / hw.d2h_bytes_per_s if hw.d2h_bytes_per_s else 0.0
    at = _planner(kind, stg, s, spec, copy)
    plans, figs = _search(at, *stg.range(), kind in FIXED)
    if figs is not None:
        row.update(rank_peak_bytes=[r.planned_peak_bytes for r in figs.rows],
                   rank_held=[r.held for r in figs.rows],
                   rank_recv_bytes=[r.recv_bytes for r in figs.rows],
                   worst_rank_peak_bytes=max(r.planned_peak_bytes for r in figs.rows))
    if not _fits(figs):
        bad = next((p for p in plans.values() if not p.feasible), None)
        worst = (max(figs.rows, key=lambda r: r.planned_peak_bytes + r.recv_bytes) if figs
                 else None)
        why = (f"the worst rank's peak {fmt_bytes(worst.planned_peak_bytes)} and its receive "
               f"buffers {fmt_bytes(worst.recv_bytes)} are above its activation budget "
               f"{fmt_bytes(worst.budget_bytes)}" if figs is not None else
               (bad.notes[-1] if bad is not None and bad.notes else "the plan does not fit"))
        return infeasible_row(row, why), None
    return _judged_row(row, batch, prof, plans, stg, spec, copy, hw), plans[0]


def _judged_row(row: dict, batch: int, prof: Profile, plans: dict, stg: _Stages,
                spec: PipelineSpec, copy: float, hw) -> dict:
    """The feasible row's step and rates, from the rank-level judge (module docstring)."""
    figs = pipeline_figures(stg.profs, plans, spec.schedule, spec.pp, spec.microbatches,
                            spec.stages_per_rank, stg.budget, copy, hw=hw, buffers=stg.buffers)
    ranks = [r.rank for r in figs.rows]
    rate = batch * spec.microbatches / figs.judged_step_us * 1e6
    seq = tokens_per_sample(prof, batch)
    idle = sum(figs.idle_us.values()) / len(figs.idle_us) if figs.idle_us else 0.0
    row.update(feasible=True, retention=plans[0].predicted.retention,
               step_us=figs.judged_step_us, judged_step_us=figs.judged_step_us,
               bubble_step_us=figs.step_us, samples_per_s=rate,
               tokens_per_s=rate * seq if seq else None, reason=None,
               bubble_fraction=idle / figs.step_us if figs.step_us else 0.0,
               rank_exposed_copy_us=[figs.exposed_us[r] for r in ranks],
               rank_judged_peak_bytes=[figs.judged_peak_bytes[r] for r in ranks])
    return row


def row_maker(s: FitSettings, prof: Profile, stages: StageProfiles | None = None,
              buffers: str = "reused", buffers_given: bool = False) -> Callable:
    """The sweep's row function (`fit.sweep`'s `row_maker`): `fit.plan_row`, or with a
    pipeline (the flags in `s.pipeline` over the one the profile's workload declares)
    `pipeline_row` for it; `stages`: each stage's profile (`StageProfiles`); `buffers`: as
    `pipeline_row` takes it; `buffers_given`: the user gave it (`fit --buffers`), refused
    where there is no pipeline."""
    spec = pipeline_spec(**s.pipeline, declared=(prof.workload or {}).get("pipeline"))
    if spec is None:
        if buffers_given:
            from ..errors import InputError
            raise InputError("--buffers describes a pipeline's buffers, and neither --pp nor "
                             "the workload declares a pipeline",
                             hint="add --pp N (the pipeline's ranks), e.g. --pp 4 --buffers "
                                  f"{buffers}, or leave --buffers out")
        return plan_row

    def row(kind, batch, prof, static, s):
        return pipeline_row(kind, batch, prof, static, s, spec,
                            None if stages is None else stages.got[batch], buffers)
    return row
