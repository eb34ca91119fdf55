"""Terminal views of `slackswap fit`: the sweep's table, the baselines beside it, and a chart
of samples/s against batch (the style of format.py's bar charts; no printing here)."""
from __future__ import annotations

from rich.text import Text

from ...fit import FitResult, best_row
from ...units import fmt_bytes, fmt_us
from .format import Fit, fmt_pct, rows_table

# the chart's marks: the planner's sweep, then the baselines in fit.BASELINES order
_MARKS = ("●", "k", "c", "t", "m", "r")
_STYLES = ("bold green", "yellow", "cyan", "blue", "red", "magenta")


def _rate(x: float | None) -> str:
    return "-" if x is None else (f"{x:,.0f}" if x >= 100 else f"{x:.2f}")


def fit_table(result: FitResult, title: str) -> object:
    """One row per batch: static, budget, keep-all peak, planner, retention, step, rates, fits."""
    best = best_row(result.rows)
    tokens = any(r["tokens_per_s"] is not None for r in result.rows)
    cols = [("", "left"), ("batch", "right"), ("static", "right"), ("act. budget", "right"),
            ("keep-all peak", "right"), ("planner", "left"), ("retention", "right"),
            ("step", "right"), ("samples/s", "right")]
    cols += [("tokens/s", "right")] if tokens else []
    pipe = any(r.get("pipeline") for r in result.rows)
    cols += [("worst rank", "right"), ("bubbles", "right")] if pipe else []
    cols += [("fits", "left")]
    cells = []
    for r in result.rows:
        mark = r is best
        style = "bold green" if mark else ""
        row = [Text("▶" if mark else "", style=style), str(r["batch"]),
               fmt_bytes(r["static_bytes"]), fmt_bytes(r["budget_bytes"]),
               fmt_bytes(r["keep_all_peak_bytes"]), r["planner"],
               "-" if r["retention"] is None else fmt_pct(r["retention"]), fmt_us(r["step_us"]),
               Text(_rate(r["samples_per_s"]), style=style)]
        row += [_rate(r["tokens_per_s"])] if tokens else []
        row += [fmt_bytes(r["worst_rank_peak_bytes"]) if r.get("worst_rank_peak_bytes") else "-",
                "-" if r.get("bubble_fraction") is None else fmt_pct(r["bubble_fraction"])
                ] if pipe else []
        row += [Text("yes", style="green") if r["feasible"] else Text("no", style="red")]
        cells.append(row)
    # 80 columns: without the keep-all peak, the planner (the title names it) and the step
    narrow = [k for k, (c, _) in enumerate(cols)
              if c not in ("keep-all peak", "planner", "step", "static", "tokens/s")[:5 if pipe else 3]]
    return Fit(rows_table(title, cols, cells, fixed=("planner",)),
                rows_table(title, [cols[k] for k in narrow], [[c[k] for k in narrow] for c in cells],
                            compact=True))


def baselines_table(result: FitResult) -> object:
    """samples/s per batch of what users do otherwise (`-`: does not fit), the best marked."""
    names = list(result.baselines)
    batches = [r["batch"] for r in result.rows]
    cols = [("batch", "right"), *[(n, "right") for n in names]]
    bests = {n: best_row(rows) for n, rows in result.baselines.items()}
    cells = []
    for i, b in enumerate(batches):
        row = [str(b)]
        for n in names:
            r = result.baselines[n][i]
            row.append(Text(_rate(r["samples_per_s"]) + (" ▶" if r is bests[n] else ""),
                            style="bold" if r is bests[n] else ""))
        cells.append(row)
    return rows_table("Baselines: samples/s (- does not fit)", cols, cells)


def rate_chart(result: FitResult, planner: str, height: int = 10, col: int = 8) -> Text:
    """samples/s (y) against batch (x, one column group per batch of the sweep): one mark per
    sweep where its row fits (see the legend under the chart)."""
    series = [(planner, result.rows), *result.baselines.items()]
    col = max(col, 2 * len(series))    # one mark every other column, each sweep its own
    top = max((r["samples_per_s"] for _, rows in series for r in rows if r["feasible"]),
              default=0.0)
    if not top:
        return Text("(no batch fits: nothing to chart)", style="dim")
    labels = {row: _rate(top * (row + 1) / height) for row in range(height - 1, 0, -2)}
    labels[0] = "0"
    lw = max(len(v) for v in labels.values())
    n = len(result.rows)
    text = Text()
    for row in range(height - 1, -1, -1):
        text.append(f"{labels.get(row, ''):>{lw}} │", style="dim")
        for i in range(n):
            cell = [" "] * col
            styles = [None] * col
            for k, (_, rows) in enumerate(series):
                r = rows[i]
                if r["feasible"] and min(height - 1, int(r["samples_per_s"] / top * height
                                                         - 1e-9)) == row:
                    at = 1 + 2 * k
                    cell[at], styles[at] = _MARKS[k], _STYLES[k]
            for ch, st in zip(cell, styles):
                text.append(ch, st)
        text.append("\n")
    text.append(" " * lw + " └" + "─" * (col * n) + "\n", style="dim")
    text.append(" " * (lw + 2) + "".join(f"{r['batch']:^{col}}" for r in result.rows) + "  batch\n",
                style="dim")
    text.append(" " * (lw + 2))
    for k, (name, _) in enumerate(series):
        text.append(_MARKS[k], _STYLES[k])
        text.append(f" {name}  ", "dim")
    return text


def fit_views(result: FitResult, *, planner: str, hardware: str, memory_bytes: int,
              optimizer: str, shard: int, tp: int = 1) -> list:
    title = (f"fit: {planner} on {hardware} ({fmt_bytes(memory_bytes)}), {optimizer}"
             + (f", per rank of {shard}" if shard > 1 else "")
             + (f", tensor parallel {tp} (the workload's local shard)" if tp > 1 else ""))
    pipe = next((r["pipeline"] for r in result.rows if r.get("pipeline")), None)
    if pipe:
        title += (f"; pipeline {pipe['schedule']}, {pipe['pp']} ranks, {pipe['microbatches']} "
                  "microbatches (batch = microbatch, static and budget per rank)")
        if shard > 1 or tp > 1:
            title += (f"; mesh pp {pipe['pp']} x fsdp {shard} x tp {tp} = "
                      f"{pipe['pp'] * shard * tp} ranks")
    views: list = [fit_table(result, title)]
    best = best_row(result.rows)
    if pipe and best is not None:
        views.append(Text(f"  batch {best['batch']} per rank: peak "
                          + ", ".join(fmt_bytes(b) for b in best["rank_peak_bytes"])
                          + "; microbatches held " + ", ".join(map(str, best["rank_held"]))
                          + _exposed(best),
                          style="dim"))
    reasons = [(r["batch"], r["reason"]) for r in result.rows if r["reason"]]
    if reasons:
        views.append(Text("\n".join(f"  batch {b}: {why}" for b, why in reasons), style="dim"))
    views += [baselines_table(result), Text("samples/s against batch", style="bold"),
              rate_chart(result, planner)]
    base = {n: best_row(rows) for n, rows in result.baselines.items()}
    if best is not None:
        gains = [f"{n} {best['samples_per_s'] / b['samples_per_s']:.2f}x (batch {b['batch']})"
                 if b else f"{n}: no batch fits" for n, b in base.items()]
        views.append(Text(f"best: batch {best['batch']} with {planner}, "
                          f"{_rate(best['samples_per_s'])} samples/s; against the best of "
                          + ", ".join(gains), style="bold"))
    return views


def _exposed(row: dict) -> str:
    """The rank-level judge's exposed copy time per rank, where the row has it."""
    exposed = row.get("rank_exposed_copy_us")
    return "" if exposed is None else "; exposed copy time " + ", ".join(map(fmt_us, exposed))
