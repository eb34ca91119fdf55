"""The tables of `compare` (planners side by side) and `hardware` (the presets)."""
from __future__ import annotations

from typing import Sequence

from rich import box
from rich.table import Table
from rich.text import Text

from ...schema import Predicted
from ...units import GIB, fmt_bytes, fmt_us
from .format import Fit, fmt_pct, rows_table


# --------------------------------------------------------------------------------------------
# compare
# --------------------------------------------------------------------------------------------
def compare_table(rows: Sequence[dict], budget_bytes: int | None = None, *,
                  hardware: str | None = None, keep_all_bytes: int | None = None):
    """One row per planner: rows are dicts {planner, feasible, predicted, solve_ms}."""
    title = "Planners compared" + (f" at a {fmt_bytes(budget_bytes)} budget"
                                   if budget_bytes else "")
    if budget_bytes and keep_all_bytes:
        title += f" ({budget_bytes / keep_all_bytes:.2g} of the keep-all peak)"
    if hardware:
        title += f" on {hardware}"
    cols = (("planner", "left"), ("feasible", "left"), ("retention", "right"),
            ("step", "right"), ("peak", "right"), ("stall", "right"), ("recompute", "right"),
            ("to host", "right"), ("solve", "right"))
    best = max((r["predicted"].retention for r in rows if r["feasible"]), default=None)
    cells = []
    for r in rows:
        p: Predicted = r["predicted"]
        is_best = r["feasible"] and best is not None and p.retention == best
        cells.append((
            Text(r["planner"], style="bold" if is_best else ""),
            Text("yes", style="green") if r["feasible"] else Text("no", style="red"),
            Text(fmt_pct(p.retention), style="bold green" if is_best else ""),
            fmt_us(p.step_us), fmt_bytes(p.peak_bytes), fmt_us(p.stall_us),
            fmt_us(p.recompute_us), fmt_bytes(p.swapped_bytes),
            _fmt_solve(r.get("solve_ms", 0.0))))
    # 80 columns: drop the step time (retention is ideal / step) and the box
    narrow = [k for k in range(len(cols)) if cols[k][0] != "step"]
    narrow_cols = [("fits", "left") if cols[k][0] == "feasible" else cols[k] for k in narrow]
    return Fit(rows_table(title, cols, cells, fixed=("planner",)),
                rows_table(title, narrow_cols, [[c[k] for k in narrow] for c in cells],
                            compact=True, fixed=("planner",)))


def compare_views(rows: Sequence[dict], budget_bytes: int, *, hardware: str,
                  keep_all_bytes: int) -> list:
    """`compare`: the table, then for torch.compile's row the knob it found, and for every
    planner that does not fit, why (its notes, in its own words)."""
    views: list = [compare_table(rows, budget_bytes, hardware=hardware,
                                 keep_all_bytes=keep_all_bytes)]
    for row in rows:
        if "activation_memory_budget" in row:
            views.append(Text(f"torch.compile: activation_memory_budget="
                              f"{row['activation_memory_budget']:.4g} "
                              + ("meets the budget" if row["met_budget"]
                                 else "(no value meets the budget)")
                              + f"; {len(row['knob_tried'])} values tried"))
        if not row["feasible"] and row["notes"]:
            grid = Table.grid(padding=(0, 1))
            grid.add_column(no_wrap=True)
            grid.add_column(style="dim")
            for note in row["notes"]:
                grid.add_row("  -", Text(str(note)))
            views += [Text(f"{row['planner']} does not fit:", style="bold"), grid]
    return views


def _fmt_solve(ms: float) -> str:
    """Solve times span 50 us to minutes: three significant figures are plenty."""
    if ms >= 1000:
        return f"{ms / 1000:.1f} s"
    return f"{ms:.0f} ms" if ms >= 1 else f"{ms * 1000:.0f} us"


# --------------------------------------------------------------------------------------------
# hardware
# --------------------------------------------------------------------------------------------
def _sustained(spec) -> str:
    """The line naming a preset's fitted bf16 fraction ("" where it is 1: not given)."""
    if spec.bf16_sustained_fraction == 1.0:
        return ""
    return (f"bf16/fp16 tensor-core rates (TFLOPs x eff, fused attention) x "
            f"{spec.bf16_sustained_fraction:.3f} sustained: fitted to published training runs "
            "(benchmarks/published_runs.py), not a datasheet figure")


def hardware_table(specs) -> Table:
    """Presets side by side: compute, HBM, memory, host link."""
    table = Table(title="hardware presets: bf16 and fp32 (FMA) TFLOP/s, HBM/H2D/D2H in GB/s, copy "
                  "latency in us, eff = achievable fraction", title_justify="left",
                  box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 0, 0, 1),
                  caption=("\n".join(x for x in (specs[0].description, specs[0].link_source
                                                   and f"host link: {specs[0].link_source}",
                                                   _sustained(specs[0]))
                                      if x) or None) if len(specs) == 1 else None,
                  caption_justify="left")
    table.add_column("preset", no_wrap=True)
    for col in ("TFLOPs", "eff", "fp32", "HBM", "eff", "GiB", "H2D", "D2H", "lat", "duplex"):
        table.add_column(col, justify="right", no_wrap=True)
    for s in specs:
        table.add_row(
            s.name, f"{s.peak_flops_per_s / 1e12:.0f}", f"{s.matmul_efficiency:.2f}",
            f"{s.fp32_flops_per_s / 1e12:.1f}" if s.fp32_flops_per_s else "-",
            f"{s.hbm_bytes_per_s / 1e9:.0f}", f"{s.hbm_efficiency:.2f}",
            f"{s.memory_bytes / GIB:.0f}", f"{s.h2d_bytes_per_s / 1e9:.1f}",
            f"{s.d2h_bytes_per_s / 1e9:.1f}", f"{s.copy_latency_us:.0f}",
            f"x{s.duplex_derate:.2f}" if s.duplex else "no")
    return table
