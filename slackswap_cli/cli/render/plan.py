"""The views of a plan (`plan`, `show PLAN`, `simulate`): the summary, bytes and actions per
layer, the largest tensors with their action and why, and activation memory over the step."""
from __future__ import annotations

import re
from typing import Sequence

from rich import box
from rich.console import Group
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from ...errors import SlackswapError
from ...hardware import HardwareSpec
from ...layers import op_layers
from ...schema import Action, Plan, Predicted, Profile
from ...simulate import recompute_chains
from ...units import MIB, fmt_bytes, fmt_us
from .format import Fit, bar_chart, fmt_pct, kv_table
from .layer_rows import collapse_rows, ordered_layers


# --------------------------------------------------------------------------------------------
# memory over the step
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


# --------------------------------------------------------------------------------------------
# plan
# --------------------------------------------------------------------------------------------
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
    return kv_table("Plan", rows)


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
    per = {name: [0, 0, 0, 0, 0, 0] for name in ordered_layers(profile, layers)}
    for t in profile.saved_activations:
        k = list(Action).index(act_of[t.id])
        s = per[layers[t.producer]]
        s[2 * k] += 1
        s[2 * k + 1] += t.size_bytes
    rows = [(name, tuple(v)) for name, v in per.items() if any(v)]
    merged = collapse_rows(rows, container, lambda a, b: a == b)
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
                         layers: list[str], feasible: bool, top: int) -> "Fit":
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
    return Fit(table(True, False), table(False, True))


def _memory_over_step(profile: Profile, result, budget: int, step_us: float) -> Group:
    bwd_us = None
    if result is not None and result.events:
        bwd_us = min((e.start_us for e in result.events if e.kind == "op" and e.op is not None
                      and e.op >= profile.n_forward), default=None)
    chart = MemoryChart(result.memory if result is not None else (), budget, step_us,
                        backward_us=bwd_us)
    return Group(Text("Activation memory over the step", style="italic"), chart)
