"""Terminal views of profiles, plans and simulated steps, as Rich renderables.

Every function here takes data and returns renderables (tables, text); none prints or exits,
so the commands decide where output goes and tests render into a recording console. This and
`render_fit.py` (the views of `fit`) are the only modules besides `output.py` that import Rich.

**Layers.** A model of 48 identical blocks should read as one row, not 48. `layers` finds the
repeated blocks from the module paths (`transformer.h.3.mlp` is in block `transformer.h.3`;
outside the blocks, a short prefix such as `transformer.wte` or `lm_head` names the row).
Consecutive blocks with the same structure (op count, saved bytes) and times within 25%
(measured times jitter) collapse into one row,
`transformer.h.0-47 (x48)`, showing per-block values.
"""
from __future__ import annotations

import re
from typing import Sequence

from rich import box
from rich.console import Group
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from ..hardware import HardwareSpec
from ..layers import layer_index, op_layers
from ..schema import Action, Plan, Predicted, Profile
from ..units import GIB, MIB, fmt_bytes, fmt_us

_BLOCKS = " ▁▂▃▄▅▆▇█"


def bar_chart(cols: Sequence[int], peak: int, budget_bytes: int | None, height: int, *,
              axis: str, under: str, dense_labels: bool = True,
              dots: Sequence[int | None] | None = None, over_factor: float = 1.0) -> Text:
    """The terminal bar chart of the plan's memory view and of verify's: one bar per value of
    `cols`, `height` rows high, scaled to the larger of `peak` and the budget.

    A bar is red where its value is above `over_factor` x the budget (cyan otherwise), each cell
    a full or partial block; the budget is a yellow line; `dots` (one per column, None: none)
    are drawn as a magenta • in the row of their value, over the bar. The y axis is labelled at
    0, the budget and the top (`dense_labels`: every other row from the top, and the budget's
    label clears its neighbours'); under the chart, `axis` (one character a column) and the
    line `under`.
    """
    scale = max(peak, budget_bytes or 0) or 1
    budget_row = (min(height - 1, int(budget_bytes / scale * height - 1e-9))
                  if budget_bytes else None)
    # a row is labelled with the value at its top edge
    labels = {row: fmt_bytes(scale * (row + 1) / height)
              for row in range(height - 1, 0, -2 if dense_labels else -height)}
    labels[0] = "0"
    if budget_row is not None:
        labels[budget_row] = f"budget {fmt_bytes(budget_bytes)}"
        if dense_labels:                    # keep the budget label clear of its neighbours
            labels.pop(budget_row + 1, None)
            if budget_row > 0:
                labels.pop(budget_row - 1, None)
    lw = max(len(v) for v in labels.values())
    dot_rows = [None if p is None else min(height - 1, int(p / scale * height - 1e-9))
                for p in (dots if dots is not None else [None] * len(cols))]
    text = Text()
    for row in range(height - 1, -1, -1):
        text.append(f"{labels.get(row, ''):>{lw}} ", style="dim")
        text.append("│", style="dim")
        for v, dot_row in zip(cols, dot_rows):
            if dot_row == row:
                text.append("•", style="bold magenta")
                continue
            level = v / scale * height - row       # how much of this cell the bar fills
            over = budget_bytes is not None and v > budget_bytes * over_factor
            if level >= 1:
                text.append("█", "red" if over else "cyan")
            elif level > 0:
                text.append(_BLOCKS[max(1, int(level * 8))], "red" if over else "cyan")
            elif row == budget_row:
                text.append("─", "yellow")
            else:
                text.append(" ", None)
        text.append("\n")
    text.append(" " * lw + " └" + axis + "\n", style="dim")
    text.append(" " * (lw + 2) + under, style="dim")
    return text


# --------------------------------------------------------------------------------------------
# formatting
# --------------------------------------------------------------------------------------------
def fmt_pct(x: float) -> str:
    return f"{100 * x:.1f}%"


class _Fit:
    """The first of several renderings of the same view that fits the console's width (the last
    one when none does): a wide table where there is room, a narrower one on 80 columns,
    rather than one table squeezed until every cell wraps."""

    def __init__(self, *choices):
        self.choices = choices

    def __rich_console__(self, console, options):
        unbounded = options.update_width(1 << 16)    # measure the natural width, unclamped
        for choice in self.choices[:-1]:
            if Measurement.get(console, unbounded, choice).maximum <= options.max_width:
                yield choice
                return
        yield self.choices[-1]


def _short_target(target: str) -> str:
    t = target[5:] if target.startswith("aten.") else target
    return t[:-8] if t.endswith(".default") else t


# --------------------------------------------------------------------------------------------
# layers (found by `layers`)
# --------------------------------------------------------------------------------------------
def _close(a: float, b: float, tol: float = 0.25) -> bool:
    return abs(a - b) <= tol * max(abs(a), abs(b), 1e-9)


def _collapse(rows: list[tuple[str, tuple]], container: str | None,
              same) -> list[tuple[str, int, tuple]]:
    """Merge runs of consecutive numbered blocks whose values `same(a, b)` agree.
    Returns (label, count, values of the run's first block averaged) per row."""
    out: list[tuple[str, int, list]] = []
    run: list[tuple[int, tuple]] = []

    def flush():
        if not run:
            return
        first, last = run[0][0], run[-1][0]
        n = len(run)
        pre = f"{container}." if container else ""
        label = f"{pre}{first}" if n == 1 else f"{pre}{first}-{last} (x{n})"
        vals = tuple(sum(v[k] for _, v in run) / n if isinstance(run[0][1][k], float)
                     else run[0][1][k] for k in range(len(run[0][1])))
        out.append((label, n, vals))
        run.clear()

    for name, vals in rows:
        idx = layer_index(name, container)
        if idx is not None and run and idx == run[-1][0] + 1 and same(run[0][1], vals):
            run.append((idx, vals))
            continue
        flush()
        if idx is not None:
            run.append((idx, vals))
        else:
            out.append((name, 1, vals))
    flush()
    return out


def _ordered_layers(profile: Profile, layers: list[str]) -> list[str]:
    seen: dict[str, None] = {}
    for i in range(len(profile.ops)):
        seen.setdefault(layers[i], None)
    return list(seen)


# --------------------------------------------------------------------------------------------
# profile
# --------------------------------------------------------------------------------------------
def _kv_table(title: str, rows: Sequence[tuple[str, str | Text]]) -> Table:
    t = Table(title=title, show_header=False, title_justify="left", box=None, pad_edge=False)
    t.add_column(style="bold")
    t.add_column()
    for k, v in rows:
        t.add_row(k, v)
    return t


def profile_views(profile: Profile, top: int = 10) -> list:
    """Totals, a per-layer table, and the largest saved activations."""
    layers = op_layers(profile)
    return [_profile_totals(profile), _profile_per_layer(profile, layers),
            _biggest_saved(profile, layers[1], top)]


def _profile_costs(profile: Profile) -> str:
    """Where the op times come from: measured on a device, or a hardware roofline."""
    ops = profile.ops
    hw = profile.env.get("hardware")
    hw = hw.get("name") if isinstance(hw, dict) else hw
    device = profile.env.get("device_name") or profile.env.get("device")
    if all(o.time_source == "measured" for o in ops) and ops:
        return f"op times measured on {device or '?'}"
    if hw:
        return f"{hw} roofline" + (f"; traced with {device}" if device else "")
    return f"- (traced on {device})" if device else "-"


def _profile_totals(profile: Profile) -> Table:
    ops = profile.ops
    nf = profile.n_forward
    saved = profile.saved_activations
    sources: dict[str, int] = {}
    for o in ops:
        sources[o.time_source] = sources.get(o.time_source, 0) + 1
    step_us, sum_us = (profile.summary.get("measured_step_us"),
                       profile.summary.get("op_sum_us"))
    wl = profile.workload.get("name") or profile.workload.get("path") or "?"
    return _kv_table("Profile", [
        ("workload", str(wl)),
        ("ops", f"{len(ops)} ({nf} forward, {len(ops) - nf} backward)"),
        ("forward time", fmt_us(sum(o.time_us for o in ops[:nf]))),
        ("backward time", fmt_us(sum(o.time_us for o in ops[nf:]))),
        ("saved activations", f"{fmt_bytes(sum(t.size_bytes for t in saved))} in "
                              f"{len(saved)} tensors"),
        ("keep-all peak", fmt_bytes(profile.keep_all_peak_bytes)),
        ("time source", ", ".join(f"{k} ({v} ops)" for k, v in sorted(sources.items())) or "-"),
        ("hardware", _profile_costs(profile)),
        *([("whole step", _step_check(step_us, sum_us))] if step_us and sum_us else []),
        ("fingerprint", profile.fingerprint),
    ])


def _profile_per_layer(profile: Profile, op_layers_: tuple[list[str], str | None]) -> Table:
    layers, container = op_layers_
    nf = profile.n_forward
    stats: dict[str, list] = {name: [0.0, 0.0, 0, 0, 0] for name in _ordered_layers(profile,
                                                                                       layers)}
    for o in profile.ops:
        s = stats[layers[o.id]]
        s[0 if o.id < nf else 1] += o.time_us
        s[4] += 1
    for t in profile.saved_activations:
        s = stats[layers[t.producer]]
        s[2] += t.size_bytes
        s[3] += 1
    rows = [(name, (float(v[0]), float(v[1]), v[2], v[3], v[4])) for name, v in stats.items()]
    merged = _collapse(rows, container,
                       lambda a, b: a[2:] == b[2:] and _close(a[0], b[0]) and _close(a[1], b[1]))
    per_layer = Table(title="Per layer" + (" (collapsed rows show one block)"
                                           if any(n > 1 for _, n, _ in merged) else ""),
                      title_justify="left")
    per_layer.add_column("layer")
    for col in ("ops", "forward", "backward", "saved", "tensors"):
        per_layer.add_column(col, justify="right")
    for label, _, v in merged:
        per_layer.add_row(label, str(v[4]), fmt_us(v[0]), fmt_us(v[1]), fmt_bytes(v[2]),
                          str(v[3]))
    return per_layer


def _biggest_saved(profile: Profile, container: str | None, top: int) -> "_Fit":
    ops = profile.ops
    saved = profile.saved_activations
    title = f"Largest saved activations (top {min(top, len(saved))} of {len(saved)})"
    cols = (("tensor", "left"), ("shape", "left"), ("dtype", "left"), ("size", "right"),
            ("producer", "left"), ("module", "left"), ("recompute", "right"),
            ("per MiB", "right"))
    rows = []
    for t in sorted(saved, key=lambda t: (-t.size_bytes, t.id))[:top]:
        op = ops[t.producer]
        rc = op.time_us
        per_mib = rc / (t.size_bytes / MIB) if t.size_bytes else None
        rows.append((t.name, "x".join(map(str, t.shape)) or "()", t.dtype,
                     fmt_bytes(t.size_bytes), _short_target(op.target), op.module or "-",
                     fmt_us(rc) if t.recomputable else "no (random)",
                     fmt_us(per_mib) if per_mib is not None and t.recomputable else "-"))
    # narrow terminals: drop producer and dtype (the tensor's name and shape say most of it)
    # and shorten module paths inside the blocks (transformer.h.3.mlp -> h.3.mlp)
    narrow_keep = (0, 1, 3, 5, 6, 7)
    narrow_rows = [[_short_module(r[i], container) if i == 5 else r[i] for i in narrow_keep]
                   for r in rows]
    return _Fit(_rows_table(title, cols, rows),
                _rows_table(title, [cols[i] for i in narrow_keep], narrow_rows, compact=True))


def _short_module(module: str, container: str | None) -> str:
    if container and module.startswith(container + "."):
        return container.rsplit(".", 1)[-1] + module[len(container):]
    return module


def _step_check(step_us: float, sum_us: float) -> Text:
    """A measured profile's two clocks: the whole step and the sum of its ops. Python dispatch
    between ops makes the step somewhat longer; far apart, the machine was busy while it was
    timed and the per-op times are not to be trusted."""
    text = Text(f"{fmt_us(step_us)} measured end to end; ops sum to {fmt_us(sum_us)}")
    ratio = max(step_us, sum_us) / min(step_us, sum_us)
    if ratio > 2:
        text.append(f" ({ratio:.0f}x apart: timing was noisy, re-profile on an idle machine)",
                    style="yellow")
    return text


def _rows_table(title: str, cols, rows, compact: bool = False, fixed: tuple = ()) -> Table:
    """A table whose cells never wrap (a number and its unit split over two lines read wrong);
    what does not fit ends in an ellipsis."""
    t = Table(title=title, title_justify="left",
              **({"box": box.SIMPLE_HEAD, "show_edge": False, "padding": 0}
                 if compact else {}))
    for k, (col, just) in enumerate(cols):
        # numbers keep their width; names (left-justified) give way first
        widest = max([len(col)] + [len(str(r[k])) for r in rows])
        keep = just == "right" or col in fixed
        t.add_column(col, justify=just, no_wrap=keep, overflow="ellipsis",
                     min_width=widest if keep else None)
    for r in rows:
        t.add_row(*r)
    return t


# --------------------------------------------------------------------------------------------
# plan
# --------------------------------------------------------------------------------------------
def memory_chart(memory: Sequence[tuple[float, int]], budget_bytes: int | None,
                 step_us: float | None = None, width: int = 60, height: int = 8,
                 backward_us: float | None = None) -> Text:
    """Activation memory over the step as a bar chart of `width` columns (the highest value in
    each time slice), with the budget drawn as a line, the y axis labelled every other row,
    and the start of backward marked on the time axis when `backward_us` is given."""
    if not memory:
        return Text("(no memory timeline: simulate with record=True)", style="dim")
    end = step_us if step_us else max(t for t, _ in memory)
    end = end or 1.0
    cols = [0] * width
    cur = 0
    k = 0
    pts = sorted(memory, key=lambda x: x[0])
    for c in range(width):
        lo, hi = c * end / width, (c + 1) * end / width
        # the value carried in from the left holds at `lo` unless a point sits exactly there
        m = cur if not (k < len(pts) and pts[k][0] <= lo) else 0
        while k < len(pts) and (pts[k][0] < hi or (c == width - 1 and pts[k][0] <= hi)):
            cur = pts[k][1]
            m = max(m, cur)
            k += 1
        cols[c] = m
    peak = max(max(cols), max(m for _, m in pts))
    axis = ["─"] * width
    bwd_col = None
    if backward_us is not None and 0 <= backward_us <= end:
        bwd_col = min(width - 1, int(backward_us / end * width))
        axis[bwd_col] = "┴"
    right = fmt_us(end)
    under = list("0" + right.rjust(width - 1))
    if bwd_col is not None:
        mark = "^ backward"
        at = bwd_col if bwd_col + len(mark) <= width - len(right) - 1 else None
        if at is None and bwd_col - len(mark) + 1 > 1:   # no room on the right: end at it
            mark, at = "backward ^", bwd_col - len(mark) + 1
        if at is not None and at > 1:
            under[at:at + len(mark)] = mark
    return bar_chart(cols, peak, budget_bytes, height, axis="".join(axis), under="".join(under))


class MemoryChart:
    """`memory_chart` drawn as wide as the console allows (60 to 200 columns of bars)."""

    def __init__(self, memory, budget_bytes, step_us=None, backward_us=None, height: int = 8):
        self.args = (memory, budget_bytes, step_us)
        self.backward_us, self.height = backward_us, height

    def __rich_console__(self, console, options):
        probe = memory_chart(*self.args, width=60, height=self.height)
        labels = max(map(len, probe.plain.splitlines())) - 60      # y labels and the axis
        width = max(60, min(200, options.max_width - labels))
        yield memory_chart(*self.args, width=width, height=self.height,
                           backward_us=self.backward_us)

    def __rich_measure__(self, console, options):
        return Measurement(60, options.max_width)


def _why(action: str, t, rc_us: float, copy_us: float, late_us: float | None,
         gap_ops: int = 1, gap_us: float = float("inf"), feasible: bool = False) -> str:
    """The reason shown beside a tensor's action. A kept tensor is kept for what is true of
    it: nothing else could be done with it, it is idle too briefly between its last forward
    read and first backward read (`gap_ops` ops taking `gap_us`) for moving it to pay, or the
    plan fits with it resident; only an infeasible plan's keeps are explained by their cost."""
    mib = t.size_bytes / MIB
    per_mib = f"{fmt_us(rc_us / mib)} per MiB" if mib else "empty"
    if action == Action.SWAP:
        hidden = ("copy hidden" if late_us is not None and late_us <= 0 else
                  f"prefetch late by {fmt_us(late_us)}" if late_us is not None else
                  f"{fmt_us(copy_us)} copy each way")
        if not t.recomputable:
            return f"swap: random op output, cannot recompute; {hidden}"
        return f"swap: {fmt_us(rc_us)} to recompute, {hidden}"
    if action == Action.RECOMPUTE:
        return f"recompute: {fmt_us(rc_us)} ({per_mib}) vs {fmt_us(copy_us)} copy"
    if not t.recomputable:
        return f"keep: random op output (cannot recompute), {fmt_us(copy_us)} copy"
    if gap_ops <= 0:
        return "keep: backward reads it right after forward: no idle time to free it in"
    idle = f"{fmt_us(gap_us)} ({gap_ops} op{'s' if gap_ops > 1 else ''})"
    if gap_us < copy_us:
        return (f"keep: idle only {idle} between its forward and backward reads, "
                f"less than a {fmt_us(copy_us)} copy")
    if feasible:
        return f"keep: the budget holds with it resident (idle {idle})"
    return f"keep: would cost {fmt_us(rc_us)} to recompute or a {fmt_us(copy_us)} copy"


def _change(planned: Plan, now: Predicted) -> str:
    """How a re-simulation differs from what the plan predicted when it was made."""
    was = planned.predicted
    where = planned.hardware.get("name", "?")
    if now == was:
        return f"same as predicted on {where}"
    parts = [f"retention {fmt_pct(was.retention)} -> {fmt_pct(now.retention)}",
             f"step {fmt_us(was.step_us)} -> {fmt_us(now.step_us)}"]
    if now.peak_bytes != was.peak_bytes:
        parts.append(f"peak {fmt_bytes(was.peak_bytes)} -> {fmt_bytes(now.peak_bytes)}")
    return f"planned on {where}: " + ", ".join(parts)


def _idle(profile: Profile, tensor_id: int) -> dict:
    """The ops between a saved tensor's last forward read and its first backward read."""
    lo = profile.last_forward_use(tensor_id) + 1
    hi = profile.first_backward_use(tensor_id)
    hi = lo if hi is None else hi
    return {"gap_ops": max(0, hi - lo),
            "gap_us": sum(op.time_us for op in profile.ops[lo:hi])}


def _chain_rows(plan: Plan, profile: Profile) -> list[tuple[str, str]]:
    """One summary row on recompute chains, when the plan has any."""
    from ..errors import SlackswapError
    from ..simulate import recompute_chains
    try:
        chains = recompute_chains(profile, plan.decisions)
    except SlackswapError:
        return []
    if not chains:
        return []
    owner, ops = max(chains.items(), key=lambda kv: (len(kv[1]), -kv[0]))
    total = sum(len(v) for v in chains.values())
    return [("recompute chains",
             f"{total} ops re-run before {len(chains)} backward ops; longest {len(ops)} ops "
             f"before op {owner} ({profile.ops[owner].name})")]


def plan_views(plan: Plan, profile: Profile, result=None, top: int = 12,
               planned: Plan | None = None) -> list:
    """Summary, bytes per action, actions per layer, biggest tensors with their action and why,
    and memory over time (from `result`, a SimResult, when given).

    `planned`: for a re-simulation (`slackswap simulate`), the plan as written: the summary
    then shows the change against its prediction instead of its solve time and notes, which
    belong to the original run."""
    pr: Predicted = result.predicted if result is not None else plan.predicted
    feasible = result.feasible if result is not None else plan.feasible
    act_of = plan.action_of(profile)
    layers = op_layers(profile)
    return [_plan_summary(plan, profile, pr, feasible, getattr(result, "reason", None), planned),
            _bytes_per_action(profile, act_of),
            _actions_per_layer(profile, act_of, layers),
            _biggest_with_action(plan, profile, result, act_of, layers[0], feasible, top),
            _memory_over_step(profile, result, plan.budget_bytes, pr.step_us)]


def _budget_text(plan: Plan, keep_all: int) -> str:
    budget = plan.budget_bytes
    txt = fmt_bytes(budget)
    if plan.budget_fraction is not None:
        txt += f" ({plan.budget_fraction:g} of the keep-all peak"
        txt += f" {fmt_bytes(keep_all)})" if keep_all else ")"
    elif keep_all and budget and budget >= keep_all:
        txt += f" (above the keep-all peak {fmt_bytes(keep_all)}: nothing has to move)"
    elif keep_all and budget:
        txt += f" ({budget / keep_all:.2g} of the keep-all peak {fmt_bytes(keep_all)})"
    return txt


def _hardware_text(hwd: dict, profile: Profile) -> str:
    txt = str(hwd.get("name", "?"))
    if any(o.time_source == "measured" for o in profile.ops):
        # measured op times are the traced device's, whatever --hardware says: say so, or a
        # what-if on a faster GPU reads as if compute had been re-costed there
        where = profile.env.get("device_name") or profile.env.get("device") or "the traced device"
        txt += f" (host link and copies); op times as measured on {where}"
    return txt


def _plan_summary(plan: Plan, profile: Profile, pr: Predicted, feasible: bool,
                  reason: str | None, planned: Plan | None) -> Table:
    """The "Plan" panel: planner, hardware, verdict, budget, and the simulator's figures."""
    budget = plan.budget_bytes
    feas = Text("yes", style="green") if feasible else Text("NO", style="bold red")
    if not feasible and reason:
        feas.append(f": {reason}", style="red")
    stall_txt = fmt_us(pr.stall_us)
    if pr.stall_by_cause:
        stall_txt += " (" + ", ".join(f"{k.replace('_', ' ')} {fmt_us(v)}"
                                      for k, v in sorted(pr.stall_by_cause.items())) + ")"
    slowdown = pr.step_us / pr.ideal_us - 1 if pr.ideal_us else 0.0
    rows = [
        ("planner", plan.planner),
        ("hardware", _hardware_text(plan.hardware or {}, profile)),
        ("feasible", feas),
        ("budget", _budget_text(plan, profile.keep_all_peak_bytes)),
        ("peak", f"{fmt_bytes(pr.peak_bytes)} ({fmt_pct(pr.peak_bytes / budget)} of budget)"
         if budget else fmt_bytes(pr.peak_bytes)),
        ("retention", Text(fmt_pct(pr.retention), style="bold")),
        ("step", f"{fmt_us(pr.step_us)} vs ideal {fmt_us(pr.ideal_us)} (+{fmt_pct(slowdown)})"),
        ("stall", stall_txt),
        ("recompute", f"{fmt_us(pr.recompute_us)} ({fmt_bytes(pr.recomputed_bytes)} "
                      "re-produced)"),
        ("copied", f"{fmt_bytes(pr.swapped_bytes)} to host, "
                   f"{fmt_bytes(pr.prefetched_bytes)} back"),
        *_chain_rows(plan, profile),
    ]
    if planned is None:
        rows.append(("solve time", f"{plan.solve_ms:.1f} ms"))
        rows.extend(("note", note) for note in plan.notes)
    else:
        rows.append(("vs the plan", _change(planned, pr)))
    return _kv_table("Plan", rows)


def _bytes_per_action(profile: Profile, act_of: dict[int, Action]) -> Table:
    saved = profile.saved_activations
    total = sum(t.size_bytes for t in saved) or 1
    table = Table(title="Bytes per action", title_justify="left")
    for col in ("action", "tensors", "bytes", "share"):
        table.add_column(col, justify="left" if col == "action" else "right")
    for a in Action:
        ts = [t for t in saved if act_of[t.id] == a]
        b = sum(t.size_bytes for t in ts)
        table.add_row(a, str(len(ts)), fmt_bytes(b), fmt_pct(b / total))
    return table


def _actions_per_layer(profile: Profile, act_of: dict[int, Action],
                       op_layers_: tuple[list[str], str | None]) -> Table:
    layers, container = op_layers_
    per = {name: [0, 0, 0, 0, 0, 0] for name in _ordered_layers(profile, layers)}
    for t in profile.saved_activations:
        k = list(Action).index(act_of[t.id])
        s = per[layers[t.producer]]
        s[2 * k] += 1
        s[2 * k + 1] += t.size_bytes
    rows = [(name, tuple(v)) for name, v in per.items() if any(v)]
    merged = _collapse(rows, container, lambda a, b: a == b)
    table = Table(title="Actions per layer: tensors and bytes"
                        + (" (collapsed rows show one block)"
                           if any(n > 1 for _, n, _ in merged) else ""),
                  title_justify="left")
    table.add_column("layer")
    for a in Action:
        table.add_column(a, justify="right")
    for label, _, v in merged:
        table.add_row(label, *(f"{int(v[2 * k])}  {fmt_bytes(v[2 * k + 1])}" if v[2 * k]
                               else "-" for k in range(3)))
    return table


def _prefetch_lateness(profile: Profile, result) -> dict[int, float]:
    """Per prefetched tensor, how long after its first backward reader started it arrived."""
    late: dict[int, float] = {}
    if result is not None and result.events:
        op_start = {e.op: e.start_us for e in result.events if e.kind == "op"}
        for e in result.schedule:
            if e.kind == "prefetch":
                fb = profile.first_backward_use(e.tensor)
                if fb is not None and fb in op_start:
                    late[e.tensor] = e.end_us - op_start[fb]
    return late


def _biggest_with_action(plan: Plan, profile: Profile, result, act_of: dict[int, Action],
                         layers: list[str], feasible: bool, top: int) -> "_Fit":
    """The largest saved activations, their action and why; narrower without the layer."""
    hwd = plan.hardware or {}
    try:
        hw = HardwareSpec.from_dict(dict(hwd)) if hwd else None
    except Exception:   # a plan from elsewhere with odd hardware: explain without copy times
        hw = None
    late = _prefetch_lateness(profile, result)
    saved = profile.saved_activations
    title = f"Largest saved activations and their action (top {min(top, len(saved))})"
    styles = {Action.KEEP: "green", Action.SWAP: "cyan", Action.RECOMPUTE: "yellow"}
    rows = []
    for t in sorted(saved, key=lambda t: (-t.size_bytes, t.id))[:top]:
        a = act_of[t.id]
        rc = profile.ops[t.producer].time_us
        cp = hw.copy_us(t.size_bytes, "d2h") if hw else 0.0
        rows.append((t.name, layers[t.producer], fmt_bytes(t.size_bytes),
                     Text(a, style=styles[a]),
                     _why(a, t, rc, cp, late.get(t.id), feasible=feasible,
                          **_idle(profile, t.id))))

    def table(with_layer: bool, compact: bool) -> Table:
        tb = Table(title=title, title_justify="left",
                   **({"box": box.SIMPLE_HEAD, "show_edge": False, "padding": (0, 0, 0, 1)}
                      if compact else {}))
        for col, just in (("tensor", "left"), ("layer", "left"), ("size", "right"),
                          ("action", "left"), ("why", "left")):
            if col != "layer" or with_layer:
                tb.add_column(col, justify=just, no_wrap=col != "why")
        for r in rows:
            if with_layer:
                tb.add_row(*r)
            else:   # the action column already names the action: the reason alone
                tb.add_row(*r[:1], *r[2:4], re.sub(f"^({'|'.join(Action)}): ", "", r[4]))
        return tb

    # 80 columns: the reason matters more than the layer (the tensor's name hints at it)
    return _Fit(table(True, False), table(False, True))


def _memory_over_step(profile: Profile, result, budget: int, step_us: float) -> Group:
    bwd_us = None
    if result is not None and result.events:
        bwd_us = min((e.start_us for e in result.events if e.kind == "op" and e.op is not None
                      and e.op >= profile.n_forward), default=None)
    chart = MemoryChart(result.memory if result is not None else (), budget, step_us,
                        backward_us=bwd_us)
    return Group(Text("Activation memory over the step", style="italic"), chart)


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
    return _Fit(_rows_table(title, cols, cells, fixed=("planner",)),
                _rows_table(title, narrow_cols, [[c[k] for k in narrow] for c in cells],
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


def hardware_table(specs) -> Table:
    """Presets side by side: compute, HBM, memory, host link."""
    table = Table(title="hardware presets: bf16 TFLOP/s, HBM/H2D/D2H in GB/s, copy latency in us, "
                  "eff = achievable fraction", title_justify="left",
                  box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 0, 0, 1),
                  caption=(specs[0].description or None) if len(specs) == 1 else None,
                  caption_justify="left")
    table.add_column("preset", no_wrap=True)
    for col in ("TFLOPs", "eff", "HBM", "eff", "GiB", "H2D", "D2H", "lat", "duplex"):
        table.add_column(col, justify="right", no_wrap=True)
    for s in specs:
        table.add_row(
            s.name, f"{s.peak_flops_per_s / 1e12:.0f}", f"{s.matmul_efficiency:.2f}",
            f"{s.hbm_bytes_per_s / 1e9:.0f}", f"{s.hbm_efficiency:.2f}",
            f"{s.memory_bytes / GIB:.0f}", f"{s.h2d_bytes_per_s / 1e9:.1f}",
            f"{s.d2h_bytes_per_s / 1e9:.1f}", f"{s.copy_latency_us:.0f}",
            f"x{s.duplex_derate:.2f}" if s.duplex else "no")
    return table


def verify_view(report) -> Group:
    """`slackswap verify`: the verdict, the differences against their tolerances, then memory
    and time of the original and the patched step beside the plan's prediction (a
    VerifyReport or its dict)."""
    get = report.get if isinstance(report, dict) else (lambda k: getattr(report, k, None))
    passed = bool(get("passed"))
    steps, device = get("steps") or 1, get("device") or "?"
    verdict = Text()
    verdict.append("PASSED" if passed else "FAILED", style="bold green" if passed else "bold red")
    verdict.append(f": {get('patched')} against {get('workload')} ({steps} training "
                   f"step{'s' if steps != 1 else ''} on {device})")

    def diff(value, tol) -> Text:
        ok = value is not None and tol is not None and value <= tol
        return Text(f"max rel. difference {value:.2g} (tolerance {tol:g})",
                    style="green" if ok else "red")

    lo, lp = get("losses_original") or [], get("losses_patched") or []
    loss = diff(get("max_loss_rel_diff"), get("loss_tolerance"))
    if lo and lp:
        loss = Text(f"{lo[-1]:.6g} vs {lp[-1]:.6g}, ").append_text(loss)
    grads = diff(get("max_grad_rel_diff"), get("grad_tolerance"))
    if get("worst_grad_param") and get("max_grad_rel_diff"):
        grads.append(f" at {get('worst_grad_param')}")
    rows = [("loss", loss), ("gradients", grads),
            ("buffers", diff(get("max_buffer_rel_diff"), get("grad_tolerance"))),
            ("plan", f"{get('kept')} kept, {get('swapped')} swapped "
                     f"({fmt_bytes(get('swapped_bytes_per_step'))} copied per step), "
                     f"{get('recomputed')} recomputed"),
            ("budget", fmt_bytes(get("budget_bytes")) if get("budget_bytes") else "-")]
    ip = get("inplace")
    if ip:
        rows.insert(3, ("in place", Text(
            f"patch(model): loss {ip['max_loss_rel_diff']:.2g}, gradients "
            f"{ip['max_grad_rel_diff']:.2g} max rel. difference; {ip['ops_lined_up']} of "
            f"{ip['profile_forward_ops']} ops lined up, {ip['ops_rerun']} re-run, "
            f"{fmt_bytes(ip['held_bytes_after_forward'])} held after forward"
            + (f"; the guard swapped {ip['guard_swaps']} saved tensors the plan could not "
               f"place ({fmt_bytes(ip['guard_swapped_bytes'])})" if ip.get("guard_swaps")
               else ""),
            style="green" if ip["max_loss_rel_diff"] <= get("loss_tolerance")
            and ip["max_grad_rel_diff"] <= get("grad_tolerance") else "red")))
    checks = _kv_table("", rows)
    t = Table(title_justify="left")
    t.add_column("")
    for col in ("original", "patched", "predicted"):
        t.add_column(col, justify="right", no_wrap=True)
    t.add_row("activation memory *", fmt_bytes(get("original_peak_bytes")),
              fmt_bytes(get("patched_peak_bytes")), fmt_bytes(get("predicted_peak_bytes")))
    t.add_row("step time", fmt_us(1e3 * (get("original_step_ms") or 0.0)),
              fmt_us(1e3 * (get("patched_step_ms") or 0.0)), fmt_us(get("predicted_step_us")))
    notes = [f"* {get('memory_metric')}"]
    if device == "cpu":
        notes.append("step times: the fastest step measured here; CPU times say little about "
                      "a GPU's")
    parts = [verdict, checks, t, *(Text(n, style="dim") for n in notes)]
    parts += [Text(f"- {reason}", style="red") for reason in get("reasons") or []]
    return Group(*parts)


# --------------------------------------------------------------------------------------------
# verify: measured activation memory against the simulator's, op by op
# --------------------------------------------------------------------------------------------
def verify_compiled_view(report: dict, backend: str) -> Text:
    """`verify --compile`: the partitioned graphs' saved, offloaded and recomputed against the
    plan, and the differences from eager."""
    c, p = report["compiled"], report["plan"]
    lines = [f"{'PASSED' if report['passed'] else 'FAILED'}: compile_planned "
             f"({backend}) against the plan and {report.get('reference', 'eager')}",
             f"compiled ({backend}): {c['graphs']} graph(s) of the step, {c['lined_up_ops']} "
             f"of {c['graph_ops']} forward ops line up",
             f"{'':<20}{'compiled':>11}{'plan':>11}{'in graph':>11}"]
    for label, got, key in (("saved / kept B", c["saved_bytes"], "kept_bytes"),
                            ("offloaded / swapped B", c["offloaded_bytes"], "swapped_bytes")):
        lines.append(f"{label:<21}{got:>10}{p[key]:>11}{p[key + '_in_graph']:>11}")
    lines += [f"{'recomputed ops':<21}{c['recomputed_ops']:>10}{p['recomputed_ops']:>11}"
              f"   (+ {c['rederived_views']} views re-derived)",
              *_in_graph_lines(p),
              f"saved by ops that did not line up: {c['saved_bytes_not_lined_up']} B",
              *(f"recompile {r['graph_set']} ({', '.join(r['compile_ids'])}): {r['graphs']} "
                f"graph(s), saved {r['saved_bytes']} B, offloaded {r['offloaded_bytes']} B"
                f"{' (checked like the step)' if r['judged'] else ' (partial: shown only)'}"
                for r in report.get("recompiles", ())),
              *(f"{name} (relative): loss {d['max_loss_rel_diff']:.1e}, gradients "
                f"{d['max_grad_rel_diff']:.1e}, parameters {d['max_param_rel_diff']:.1e}"
                f"{suffix}" for name, d, suffix in _compiled_diffs(report)),
              *(f"note: {n}" for n in report.get("notes", ()))]
    return Text("\n".join(lines))


def _in_graph_lines(p: dict) -> list[str]:
    """What `plan` and `in graph` are: the whole plan's bytes as the profile sizes them, and
    the same plan as the compiled graphs hold it, with why they differ."""
    why = []
    if p.get("resized_roots"):
        why.append(f"{p['resized_roots']} root(s) held in another size (a dropout mask: a "
                   f"1-byte bool in the graph, float noise in the profile)")
    if p.get("merged_roots"):
        why.append(f"merged by the partitioner's CSE into an identical earlier op: "
                   f"{', '.join(p['merged_roots'])}")
    if p.get("recomputed_with_op_bytes"):
        why.append(f"{p['recomputed_with_op_bytes']} B of results re-made with their op "
                   f"(an op a recompute chain re-runs whole: layer norm's mean and rstd)")
    lines = ["plan: the whole plan's kept and swapped bytes, as the profile sizes them; "
             "in graph: the same plan as the compiled graphs hold it (what is checked)"]
    if why:
        lines.append("  they differ by: " + "; ".join(why))
    return lines


def _compiled_diffs(report: dict) -> list[tuple[str, dict, str]]:
    """verify --compile's differences: against its reference, and against eager where the
    reference is not eager, beside the reference's own distance from eager (what inductor's
    check compares with)."""
    ref = report.get("reference", "eager")
    tol = report["tolerances"]
    if ref == "eager":
        return [("vs eager", report, f" (tolerance {tol['loss']:g} / {tol['grad']:g})")]
    rows = [(f"vs {ref}", report, " (0 is bitwise)")]
    if "vs_eager" in report:
        ratio = tol.get("ratio_to_reference", 1)
        rows.append(("vs eager", report["vs_eager"],
                     f" (checked: within {ratio:g}x {ref}'s own + {tol['loss']:g} / "
                     f"{tol['grad']:g}; step-1 gradients "
                     f"{report['vs_eager'].get('first_grad_rel_diff', 0):.1e})"))
    if "reference_vs_eager" in report:
        d = report["reference_vs_eager"]
        rows.append((f"{ref} vs eager", d,
                     f" (step-1 gradients {d.get('first_grad_rel_diff', 0):.1e})"))
    return rows


def patch_usage(module: str) -> Text:
    """`apply`: how the patched module is used in a training loop."""
    return Text("use it in your training loop:\n"
                f"    from {module} import patch\n"
                "    patch(model)               # in place: same model, hooks, DDP, Trainer\n"
                "    loss = model(*inputs)      # trains under the plan\n"
                "    loss.backward(); optimizer.step()")


def two_curve_chart(measured: Sequence[int], predicted: Sequence[int | None],
                    budget_bytes: int | None = None, width: int = 60, height: int = 8) -> Text:
    """Measured (bars) and predicted (dots) memory per op, each column the highest value of
    its slice of ops, with the budget as a line. Unmatched predictions (None) are skipped."""
    n = len(measured)
    if not n:
        return Text("(no measured timeline)", style="dim")
    width = min(width, n)
    cols_m, cols_p = [], []
    for c in range(width):
        lo, hi = c * n // width, max(c * n // width + 1, (c + 1) * n // width)
        cols_m.append(max(measured[lo:hi]))
        ps = [p for p in predicted[lo:hi] if p is not None]
        cols_p.append(max(ps) if ps else None)
    peak = max(max(cols_m), max((p for p in cols_p if p is not None), default=0))
    return bar_chart(cols_m, peak, budget_bytes, height, axis="─" * width,
                     under="op 1" + f"op {n}".rjust(width - 4), dense_labels=False,
                     dots=cols_p, over_factor=1.05)


def verify_memory_view(report) -> Group:
    """`slackswap verify`: activation memory measured op by op (bars) against the simulator
    (dots), the peaks side by side, and the op where the run held the most more than predicted."""
    get = report.get if isinstance(report, dict) else (lambda k: getattr(report, k, None))
    cpu = get("device") == "cpu"
    t = Table(title="Activation memory, op by op (live activation storages, views once, "
                    "gradients out)", title_justify="left")
    t.add_column("")
    for col in ("measured", "predicted", "measured / predicted"):
        t.add_column(col, justify="right", no_wrap=True)

    def ratio(a, b) -> str:
        return f"{a / b:.3f}" if a and b else "-"

    orig_m, orig_p = get("measured_original_peak_bytes"), get("predicted_original_peak_bytes")
    t.add_row("original step peak", fmt_bytes(orig_m), fmt_bytes(orig_p) if orig_p else "-",
              ratio(orig_m, orig_p))
    pm, pp = get("measured_peak_bytes"), get("predicted_peak_bytes")
    t.add_row("patched step peak (plan)", fmt_bytes(pm), fmt_bytes(pp) if pp else "-",
              ratio(pm, pp))
    pd = get("predicted_device_peak_bytes")
    if pd is not None and cpu:
        t.add_row("patched step peak (copies synchronous)", fmt_bytes(pm), fmt_bytes(pd),
                  ratio(pm, pd))
    parts: list = [t]
    rows = get("timeline") or []
    if rows:
        key = "predicted_device_bytes"
        parts.append(two_curve_chart([r["measured_bytes"] for r in rows],
                                     [r.get(key) for r in rows], get("budget_bytes")))
        legend = ("█ measured   • predicted" + (" (the plan re-simulated with synchronous "
                  "copies, as this CPU run makes them)" if cpu else ""))
        parts.append(Text(legend, style="dim"))
    if get("plan_found"):
        parts.append(Text(f"{get('timeline_matched')} of {get('timeline_tasks')} simulated "
                          f"tasks matched to calls of the patched module", style="dim"))
    else:
        parts.append(Text("no plan found next to the patched module: pass --plan to compare "
                          "the timeline with the simulator's", style="dim"))
    w = get("worst_divergence")
    if w and w.get("excess_bytes", 0) > 0:
        what = "recomputing " if w["recompute"] else ""
        parts.append(Text(f"largest excess over the simulator: {fmt_bytes(w['excess_bytes'])} at "
                          f"{what}op {w['op']} ({w['name']}): measured "
                          f"{fmt_bytes(w['measured_bytes'])}, predicted "
                          f"{fmt_bytes(w['predicted_bytes'])}"))
        lt = Table(title_justify="left", box=None)
        for col in ("live there", "size", "profile: dead after op", "held past it"):
            lt.add_column(col, justify="right" if col == "size" else "left", no_wrap=True)
        for x in w.get("live_tensors", []):
            lu = (f"{x['profile_last_use']} ({x['profile_last_use_name']})"
                  if "profile_last_use" in x else "-")
            lt.add_row(x["tensor"], fmt_bytes(x["bytes"]), lu,
                       "yes" if x.get("held_past_last_use") else "")
        parts.append(lt)
    pro, mro = get("predicted_recompute_ops"), get("measured_recompute_ops")
    if pro is not None:
        parts.append(Text(f"ops re-run in backward: {mro} by the patched module, {pro} in the "
                          "simulator's schedule", style="dim" if mro == pro else "yellow"))
    extra, rc = get("extra_step_ms") or [], get("predicted_recompute_us")
    if extra and rc:
        srt = sorted(extra)
        med = srt[len(srt) // 2]
        src = get("profile_time_source")
        like = src == "measured"
        parts.append(Text(f"patched minus original step time: median {fmt_us(med * 1e3)} "
                          f"(min {fmt_us(srt[0] * 1e3)}, max {fmt_us(srt[-1] * 1e3)}, "
                          f"{len(extra)} steps) vs predicted recompute {fmt_us(rc)}"
                          + (f": ratio {med * 1e3 / rc:.2f}" if like and rc > 0 else
                             f" (the profile's times are {src or 'not measured'}: profile with "
                             "--device cpu for a like-for-like ratio)"),
                          style="dim"))
    return Group(*parts)
