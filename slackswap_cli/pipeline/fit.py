"""`slackswap fit --pp`: one row of the batch sweep for a pipeline of stages like the workload.

The workload is one pipeline stage (as examples/gpt_stage.py) and the batch is the
microbatch; every stage of the pipeline is priced as it (`pipeline_step.pipeline_figures`).
Per rank:

- **static memory** (`rank_static`): its stages' parameters, gradients, optimizer state and
  buffers (`fit.static_memory` of the stage, `--shard` as without a pipeline), times the
  stages the rank runs (`stages_per_rank` with Interleaved1F1B, else one); the batch's inputs
  once;
- the **activation budget**: device memory - that static memory - the reserve; the rank's
  receive buffers (`stages.recv_buffer_bytes`, `rank_recv_bytes`) count in it beside its
  activation peak;
- one plan of the stage, the same on every stage, made at the largest stage budget (bisected
  between the stage's activation floor and its keep-all peak) at which EVERY rank, with the
  (chunk-)microbatches the schedule makes it hold, stays under its activation budget
  (`stages.rank_peak`, through `pipeline_figures`).

The step's time is the schedule's, with its bubbles (`pipeline_step.timeline`): samples/s
counts the global batch (microbatch x microbatches). `bubble_fraction` is the ranks' mean idle
time over the step. The row that fits also carries the rank-level judge's figures
(`pipeline_copies.judge`: the plan's copies on each rank's shared engines): per rank the
compute time that waits for copies (`rank_exposed_copy_us`) and the peak with copies in
flight (`rank_judged_peak_bytes`), and the step so judged (`judged_step_us`).

Torch-free.
"""
from __future__ import annotations

from typing import Callable

from ..fit import (
    FitSettings,
    StaticMemory,
    infeasible_row,
    plan_kind,
    plan_row,
    row_head,
    tokens_per_sample,
)
from ..schema import Plan, Profile
from ..simulate import budget_floor_bytes
from ..units import fmt_bytes
from .orders import V_SCHEDULES, PipelineSpec, pipeline_spec
from .step import PipelineFigures, pipeline_figures

__all__ = ["stages_on_rank", "rank_static", "pipeline_row", "row_maker"]

# plans that do not change with the budget
FIXED = ("keep-all", "checkpoint-layers", "torchtitan-sac", "full-ac", "megatron-selective")
BISECTIONS = 8


def stages_on_rank(spec: PipelineSpec) -> int:
    return spec.stages_per_rank if spec.schedule in ("Interleaved1F1B", *V_SCHEDULES) else 1


def rank_static(static: StaticMemory, stages: int) -> StaticMemory:
    """A rank's static memory: `stages` stages like the profiled one (see the module
    docstring); the batch's inputs once."""
    return StaticMemory(params_bytes=static.params_bytes * stages,
                        grads_bytes=static.grads_bytes * stages,
                        optimizer_bytes=static.optimizer_bytes * stages,
                        buffers_bytes=static.buffers_bytes * stages,
                        inputs_bytes=static.inputs_bytes,
                        unsharded_bytes=static.unsharded_bytes * stages)


def _fits(figs: PipelineFigures | None) -> bool:
    return figs is not None and all(r.fits for r in figs.rows)


def _search(at: Callable[[int], tuple[Plan, PipelineFigures | None]], floor: int, keep: int,
            fixed: bool):
    """(plan, figures) at the largest stage budget in [floor, keep] where every rank fits
    (keep itself first), else the floor's (which does not fit)."""
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


def pipeline_row(kind: str, batch: int, prof: Profile, static: StaticMemory, s: FitSettings,
                 spec: PipelineSpec) -> tuple[dict, Plan | None]:
    """One row of the sweep for the pipeline `spec` at microbatch `batch` (module docstring)."""
    per_rank = rank_static(static, stages_on_rank(spec))
    budget = s.memory_bytes - per_rank.total - s.reserve_bytes
    row = row_head(batch, kind, per_rank, s)
    row.update(budget_bytes=budget, keep_all_peak_bytes=prof.keep_all_peak_bytes,
               pipeline=spec._asdict(), global_batch=batch * spec.microbatches,
               rank_peak_bytes=None, rank_held=None, rank_recv_bytes=None,
               worst_rank_peak_bytes=None,
               bubble_fraction=None, judged_step_us=None, rank_exposed_copy_us=None,
               rank_judged_peak_bytes=None)
    if budget <= 0:
        return infeasible_row(row, f"a rank's static memory and reserve exceed the device by "
                        f"{fmt_bytes(-budget)}"), None
    hw = s.hardware
    copy = 1e6 / hw.d2h_bytes_per_s if hw.d2h_bytes_per_s else 0.0
    memo: dict = {}

    def at(stage_budget: int):
        if stage_budget not in memo:
            options = s.planner_options if kind == s.planner else {}
            plan = plan_kind(kind, prof, hw, stage_budget, options)
            figs = (pipeline_figures(prof, plan, spec.schedule, spec.pp, spec.microbatches,
                                     spec.stages_per_rank, budget, copy)
                    if plan.feasible else None)
            memo[stage_budget] = (plan, figs)
        return memo[stage_budget]
    plan, figs = _search(at, budget_floor_bytes(prof), prof.keep_all_peak_bytes, kind in FIXED)
    if figs is not None:
        row.update(rank_peak_bytes=[r.planned_peak_bytes for r in figs.rows],
                   rank_held=[r.held for r in figs.rows],
                   rank_recv_bytes=[r.recv_bytes for r in figs.rows],
                   worst_rank_peak_bytes=max(r.planned_peak_bytes for r in figs.rows))
    if not _fits(figs):
        worst = max(figs.rows, key=lambda r: r.planned_peak_bytes + r.recv_bytes) if figs else None
        why = (f"the worst rank's peak {fmt_bytes(worst.planned_peak_bytes)} and its receive "
               f"buffers {fmt_bytes(worst.recv_bytes)} are above its activation budget "
               f"{fmt_bytes(budget)}" if figs is not None else
               (plan.notes[-1] if plan.notes else "the plan does not fit"))
        return infeasible_row(row, why), None
    figs = pipeline_figures(prof, plan, spec.schedule, spec.pp, spec.microbatches,
                            spec.stages_per_rank, budget, copy, hw=hw)
    row.update(judged_step_us=figs.judged_step_us,
               rank_exposed_copy_us=[figs.exposed_us[r.rank] for r in figs.rows],
               rank_judged_peak_bytes=[figs.judged_peak_bytes[r.rank] for r in figs.rows])
    rate = batch * spec.microbatches / figs.step_us * 1e6
    seq = tokens_per_sample(prof, batch)
    idle = sum(figs.idle_us.values()) / len(figs.idle_us) if figs.idle_us else 0.0
    row.update(feasible=True, retention=plan.predicted.retention, step_us=figs.step_us,
               samples_per_s=rate, tokens_per_s=rate * seq if seq else None, reason=None,
               bubble_fraction=idle / figs.step_us if figs.step_us else 0.0)
    return row, plan


def row_maker(s: FitSettings, prof: Profile) -> Callable:
    """The sweep's row function (`fit.sweep`'s `row_maker`): `fit.plan_row`, or with a
    pipeline (the flags in `s.pipeline` over the one the profile's workload declares)
    `pipeline_row` for it."""
    spec = pipeline_spec(**s.pipeline, declared=(prof.workload or {}).get("pipeline"))
    if spec is None:
        return plan_row

    def row(kind, batch, prof, static, s):
        return pipeline_row(kind, batch, prof, static, s, spec)
    return row
