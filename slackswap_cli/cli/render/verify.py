"""The views of the run side: `apply`'s usage note, `verify`'s verdict and its memory measured
op by op against the simulator, and `verify --compile`'s report."""
from __future__ import annotations

from typing import Sequence

from rich.console import Group
from rich.table import Table
from rich.text import Text

from ...budget import MEMORY_TOLERANCE
from ...units import fmt_bytes, fmt_us
from .format import bar_chart, kv_table


# --------------------------------------------------------------------------------------------
# apply
# --------------------------------------------------------------------------------------------
def patch_usage(module: str) -> Text:
    """`apply`: how the patched module is used in a training loop."""
    return Text("use it in your training loop:\n"
                f"    from {module} import patch\n"
                "    patch(model)               # in place: same model, hooks, DDP, Trainer\n"
                "    loss = model(*inputs)      # trains under the plan\n"
                "    loss.backward(); optimizer.step()")


# --------------------------------------------------------------------------------------------
# verify: the verdict, the differences against their tolerances, memory and time
# --------------------------------------------------------------------------------------------
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
    checks = kv_table("", rows)
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
                     dots=cols_p, over_factor=1 + MEMORY_TOLERANCE)


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


# --------------------------------------------------------------------------------------------
# verify --compile: the partitioned graphs against the plan, values against eager
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
                f"{_symbolic(r)}"
                f"{' (checked like the step)' if r['judged'] else ' (partial: shown only)'}"
                for r in report.get("recompiles", ())),
              *(f"{name} (relative): loss {d['max_loss_rel_diff']:.1e}, gradients "
                f"{d['max_grad_rel_diff']:.1e}, parameters {d['max_param_rel_diff']:.1e}"
                f"{suffix}" for name, d, suffix in _compiled_diffs(report)),
              *(f"note: {n}" for n in report.get("notes", ()))]
    return Text("\n".join(lines))


def _symbolic(rc: dict) -> str:
    """A recompile's symbolic sizes, read at the profiled step's values, and its lined-up ops."""
    if not rc.get("symbolic"):
        return ""
    at = ", ".join(f"{k}={v}" for k, v in rc.get("symbols", {}).items())
    return (f", symbolic sizes read at {at or 'their hints'}, {rc.get('lined_up_ops')} of "
            f"{rc.get('graph_ops')} forward ops line up")


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
