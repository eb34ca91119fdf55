"""Terminal view of a pipeline's per-rank figures (`simulate --pp`, `show --pp`): per rank the
stages, the microbatches held, keep-all and planned peaks, swapped and recomputed bytes per
step, its bubbles, and (from the rank-level judge, `pipeline_copies`) its peak with copies in
flight and the compute time that waits for copies (either marked "(over)" where, with its
receive buffers, it is over the rank's budget); then the step's time with the schedule's
bubbles, and each rank's receive buffers (counted in its budget: all step beside its peaks,
or, on torch 2.15, with each microbatch in them)."""
from __future__ import annotations

from rich.console import Group

from ...pipeline.stages import ROW_HEADERS, row_cells
from ...pipeline.step import PipelineFigures
from ...units import fmt_bytes, fmt_us
from .format import Fit, kv_table, rows_table


def pipeline_views(figs: PipelineFigures, stage_note: str) -> list:
    cols = [(h, "right") for h in ROW_HEADERS]
    cols += [("idle/step", "right"), ("swap copies/step", "right")]
    judged = figs.exposed_us is not None
    if judged:
        cols += [("peak w/ copies", "right"), ("exposed copies/step", "right")]
    rows = [[*row_cells(r), fmt_us(figs.idle_us[r.rank]), fmt_us(figs.swap_copy_us[r.rank]),
             *((_judged_peak(figs, r.rank), fmt_us(figs.exposed_us[r.rank])) if judged else ())]
            for r in figs.rows]
    title = (f"Per rank: {figs.schedule}, {figs.pp} ranks, {figs.microbatches} microbatches "
             f"({stage_note})")
    return [Fit(rows_table(title, cols, rows), _narrow(title, cols, rows)),
            kv_table("Step with the schedule's bubbles", [
                ("step (plan)", fmt_us(figs.step_us)),
                ("step (keep all)", fmt_us(figs.keep_all_step_us)),
                *([("step (copies on each rank's engines)", fmt_us(figs.judged_step_us))]
                  if judged else []),
                ("receive buffers", _buffers_note(figs)),
                ("note", f"sends and receives take no time here; {stage_note}")])]


def _judged_peak(figs: PipelineFigures, rank: int) -> str:
    over = figs.judged_fits is not None and not figs.judged_fits[rank]
    return fmt_bytes(figs.judged_peak_bytes[rank]) + (" (over)" if over else "")


def _buffers_note(figs: PipelineFigures) -> str:
    """Where the receive buffers are counted, as the pipeline's torch holds them."""
    if figs.buffers == "per-step":
        return ("allocated every step, each held with its microbatch: in the peaks "
                "(torch 2.15's PipelineStage)")
    return (", ".join(f"rank {r.rank} {fmt_bytes(r.recv_bytes)}" for r in figs.rows)
            + " (all step, in the rank's budget beside its planned peak)")


def _narrow(title: str, cols: list, rows: list) -> Group:
    """The per-rank table on 80 columns (or piped): the same cells in tables of a few
    columns each, every one led by the rank (memory; then the plan's work and the bubbles;
    then the copies, as judged)."""
    names = [c for c, _ in cols]
    parts = [names[:6], ["rank", *names[6:9], "idle/step"], ["rank", *names[10:]]]
    out = []
    for i, part in enumerate(parts):
        idx = [names.index(c) for c in part]
        out.append(rows_table(title if i == 0 else "", [cols[k] for k in idx],
                               [[r[k] for k in idx] for r in rows]))
    return Group(*out)


def figures_json(figs: PipelineFigures) -> dict:
    """What --json prints of the pipeline."""
    return {"schedule": figs.schedule, "pp": figs.pp, "microbatches": figs.microbatches,
            "buffers": figs.buffers,
            "step_us": figs.step_us, "keep_all_step_us": figs.keep_all_step_us,
            "ranks": [{"rank": r.rank, "stages": list(r.stages), "held": r.held,
                       "budget_bytes": r.budget_bytes,
                       "keep_all_peak_bytes": r.keep_all_peak_bytes,
                       "planned_peak_bytes": r.planned_peak_bytes, "fits": r.fits,
                       "recv_bytes": r.recv_bytes,
                       "swapped_bytes": r.swapped_bytes,
                       "recomputed_bytes": r.recomputed_bytes,
                       "idle_us": figs.idle_us[r.rank],
                       "swap_copy_us": figs.swap_copy_us[r.rank],
                       **_judged(figs, r.rank)} for r in figs.rows],
            "judged_step_us": figs.judged_step_us}


def _judged(figs: PipelineFigures, rank: int) -> dict:
    if figs.exposed_us is None:
        return {}
    return {"judged_peak_bytes": figs.judged_peak_bytes[rank],
            "judged_fits": figs.judged_fits[rank],
            "exposed_copy_us": figs.exposed_us[rank]}
