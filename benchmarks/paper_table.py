"""Reproduce the reference paper's table: retention of every planner on the sample profiles.

For each profile (default: sample_profiles/bert-large.json, gpt2-xl.json, llama-7b.json, resnet50.json) this
plans the step with every registered planner at budgets 0.3, 0.5 and 0.7 of the keep-all
activation peak on `a100-pcie4` (the published figures are at 0.5), computes the sound bound
(`slackswap_cli/planners/bound.py`: no plan the simulator accepts has a higher retention), then
sweeps the budget from 0.1 to 1.0 with the heuristic planners, and writes

- `<out>/paper_table.json`: every (profile, planner, budget) result with the simulator's numbers,
- `<out>/paper_table.md`: the table at 0.5 next to the published figures, and the sweep,
- `<out>/paper_table.png`: retention against budget, one panel a profile (if matplotlib imports).

    python benchmarks/paper_table.py [--profiles a.json b.json] [--out benchmarks/results]
                                     [--budgets 0.3,0.5,0.7] [--hardware a100-pcie4]
                                     [--optimal-time-limit 60]
                                     [--synthetic]

`--synthetic` (or a missing sample profile) uses transformer-shaped synthetic profiles built
by `slackswap_testkit.synthetic.transformer_profile`, so the benchmark runs before the traced
samples exist. Those are stand-ins, not the paper's workloads: the table says which was used.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from slackswap_cli.hardware import HardwareSpec, load_hardware  # noqa: E402
from slackswap_cli.schema import Profile  # noqa: E402
from slackswap_testkit.synthetic import SYNTHETIC_SHAPES, synthetic_sample  # noqa: E402

# Published retention at half the activation peak, A100 + PCIe 4.0 (the table in docs/results.md, 'Retention on the sample profiles').
PUBLISHED = {"bert-large": 0.963, "gpt2-xl": 0.976, "llama-7b": 0.996}
SAMPLES = ["sample_profiles/bert-large.json", "sample_profiles/gpt2-xl.json",
           "sample_profiles/llama-7b.json", "sample_profiles/resnet50.json"]
SWEEP = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]

# --------------------------------------------------------------------------------------------
# The benchmark
# --------------------------------------------------------------------------------------------
def _profile_key(prof: Profile, path: str | None) -> str:
    name = str(prof.workload.get("name") or Path(path or "profile").stem)
    return name.removeprefix("synthetic-")


def run_one(prof: Profile, hw: HardwareSpec, planner: str, fraction: float,
            optimal_time_limit_s: float) -> dict:
    from slackswap_cli.errors import SlackswapError
    from slackswap_cli.planners import make_plan
    from slackswap_cli.simulate import budget_floor_bytes

    peak = int(prof.summary["peak_activation_bytes"])
    budget = int(fraction * peak)
    row = {"planner": planner, "budget_fraction": fraction, "budget_bytes": budget}
    if budget < budget_floor_bytes(prof):
        row.update(feasible=False, below_floor=True, retention=None)
        return row
    options = {"time_limit_s": optimal_time_limit_s} if planner == "optimal" else {}
    try:
        t0 = time.perf_counter()
        plan = make_plan(planner, prof, hw, budget, budget_fraction=fraction, **options)
        wall_ms = (time.perf_counter() - t0) * 1e3
    except SlackswapError as exc:
        row.update(feasible=False, error=str(exc), retention=None)
        return row
    pr = plan.predicted
    acts = [d.action for d in plan.decisions]
    row.update(feasible=plan.feasible, retention=pr.retention, step_us=pr.step_us,
               ideal_us=pr.ideal_us, peak_bytes=pr.peak_bytes, stall_us=pr.stall_us,
               recompute_us=pr.recompute_us, swapped_bytes=pr.swapped_bytes,
               n_keep=acts.count("keep"), n_swap=acts.count("swap"),
               n_recompute=acts.count("recompute"), solve_ms=plan.solve_ms,
               plan_and_simulate_ms=wall_ms, notes=list(plan.notes))
    return row


def bound_row(prof: Profile, hw: HardwareSpec, fraction: float) -> dict:
    """The sound bound at `fraction` of the keep-all peak, as a result row."""
    from slackswap_cli.planners.bound import sound_bound
    budget = int(fraction * int(prof.summary["peak_activation_bytes"]))
    t0 = time.perf_counter()
    b = sound_bound(prof, hw, budget)
    return {"planner": "sound bound", "budget_fraction": fraction, "budget_bytes": budget,
            "feasible": b.fits, "below_floor": not b.fits, "retention": b.retention,
            "overhead_us": b.overhead_us, "solve_s": time.perf_counter() - t0,
            "message": b.message}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profiles", nargs="*", default=None,
                    help="profile JSON files [default: the three sample profiles]")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"),
                    help="output folder [default: benchmarks/results]")
    ap.add_argument("--hardware", default="a100-pcie4")
    ap.add_argument("--budget", type=float, default=0.5,
                    help="budget of the published figures [default 0.5]")
    ap.add_argument("--budgets", default="0.3,0.5,0.7",
                    help="comma-separated budgets of the main table (every planner and the "
                         "sound bound); --budget is added if missing")
    ap.add_argument("--sweep", default=",".join(str(x) for x in SWEEP),
                    help="comma-separated budget fractions of the sweep")
    ap.add_argument("--planners", default=None, help="comma-separated subset")
    ap.add_argument("--optimal-time-limit", type=float, default=60.0,
                    help="seconds for the MILP at the main budget [default 60]")
    ap.add_argument("--sweep-optimal-time-limit", type=float, default=0.0,
                    help="seconds for the MILP at each sweep budget; 0 leaves optimal out of "
                         "the sweep [default 0]")
    ap.add_argument("--synthetic", action="store_true",
                    help="use the synthetic transformer stand-ins instead of sample profiles")
    ap.add_argument("--plot-only", action="store_true",
                    help="redraw <out>/paper_table.png from <out>/paper_table.json, run nothing")
    args = ap.parse_args(argv)
    if args.plot_only:
        import orjson
        results = orjson.loads((Path(args.out) / "paper_table.json").read_bytes())
        names = list(dict.fromkeys(r["planner"] for e in results["profiles"] for r in e["main"]))
        png = plot(results, names, Path(args.out) / "paper_table.png")
        print(f"[paper_table] wrote {png}" if png else "[paper_table] matplotlib is not installed")
        return 0 if png else 1

    from slackswap_cli.planners import planner_names
    from slackswap_cli.schema import dumps, load_profile, write_atomic

    hw = load_hardware(args.hardware)
    names = args.planners.split(",") if args.planners else planner_names()
    sweep = [float(x) for x in args.sweep.split(",") if x.strip()]
    mains = sorted({float(x) for x in args.budgets.split(",") if x.strip()} | {args.budget})
    profiles: list[tuple[str, Profile, str]] = []
    paths = args.profiles if args.profiles is not None else [str(ROOT / s) for s in SAMPLES]
    for path in paths:
        if not args.synthetic and Path(path).exists():
            prof = load_profile(path)
            profiles.append((_profile_key(prof, path), prof, str(path)))
        else:
            key = Path(path).stem
            if key not in SYNTHETIC_SHAPES:
                raise SystemExit(f"profile {path} does not exist")
            print(f"[paper_table] {path} missing: using the synthetic stand-in", flush=True)
            profiles.append((key, synthetic_sample(key, hw), "synthetic"))

    results = {"hardware": hw.name, "budget": args.budget, "budgets": mains, "sweep": sweep,
               "optimal_time_limit_s": args.optimal_time_limit, "profiles": []}
    for key, prof, source in profiles:
        slack = (prof.summary.get("forward_us", 0.0) * 1e-6 * hw.d2h_bytes_per_s
                 / max(1, prof.summary["peak_activation_bytes"]))
        entry = {"name": key, "source": source, "workload": prof.workload,
                 "slack_fraction": slack,
                 "n_ops": len(prof.ops), "n_saved": len(prof.saved_activations),
                 "peak_activation_bytes": prof.summary["peak_activation_bytes"],
                 "published_retention": PUBLISHED.get(key), "main": [], "sweep": []}
        entry["bound"] = []
        for frac in mains:
            entry["bound"].append(bound_row(prof, hw, frac))
            print(f"[paper_table] {key:12s} {frac:.2f} sound bound "
                  f"{_fmt_ret(entry['bound'][-1])}", flush=True)
            for name in names:
                row = run_one(prof, hw, name, frac, args.optimal_time_limit)
                entry["main"].append(row)
                print(f"[paper_table] {key:12s} {frac:.2f} {name:17s} "
                      f"{_fmt_ret(row)} ({row.get('plan_and_simulate_ms', 0):.0f} ms)",
                      flush=True)
        for frac in sweep:
            for name in names:
                if name == "optimal" and args.sweep_optimal_time_limit <= 0:
                    continue
                done = [r for r in entry["main"] if r["planner"] == name
                        and abs(r["budget_fraction"] - frac) < 1e-9]
                if done:
                    row = done[0]
                else:
                    row = run_one(prof, hw, name, frac, args.sweep_optimal_time_limit)
                entry["sweep"].append(row)
            print(f"[paper_table] {key:12s} {frac:.2f} " + "  ".join(
                f"{r['planner']}={_fmt_ret(r)}" for r in entry["sweep"]
                if r["budget_fraction"] == frac), flush=True)
        results["profiles"].append(entry)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "paper_table.json", dumps(results))
    write_atomic(out / "paper_table.md", render_markdown(results, names).encode())
    png = plot(results, names, out / "paper_table.png")
    print(f"[paper_table] wrote {out / 'paper_table.json'}, {out / 'paper_table.md'}"
          + (f", {png}" if png else ""))
    return 0


def _fmt_ret(row: dict) -> str:
    if row.get("below_floor"):
        return "below floor"
    if row.get("retention") is None:
        return "error"
    mark = "" if row["feasible"] else " (over budget)"
    return f"{100 * row['retention']:.2f}%{mark}"


def render_markdown(results: dict, names: list[str]) -> str:
    budgets = results.get("budgets", [results["budget"]])
    lines = [f"# Paper table: retention on {results['hardware']} at budgets "
             + ", ".join(f"{b:g}" for b in budgets) + " of the keep-all peak",
             "",
             "Retention = ideal step time / simulated step time (the simulator of "
             "`slackswap_cli/simulate.py`). A plan over budget is marked; 'below floor' means no "
             "plan can meet that budget. *Sound bound*: the LP of "
             "`slackswap_cli/planners/bound.py`, a relaxation of the simulator's rules: no plan "
             "the simulator accepts has a higher retention. The published figures are at "
             f"{results['budget']}.", ""]
    head = ("| workload | budget | published | " + " | ".join(names)
            + " | sound bound | slackswap plan+sim |")
    lines += [head, "|" + "---|" * (len(names) + 5)]
    for e in results["profiles"]:
        pub = e["published_retention"]
        for frac in budgets:
            cells = []
            for name in names:
                row = _row(e["main"], name, frac)
                cells.append(_fmt_ret(row) if row else "-")
            ss = _row(e["main"], "slackswap", frac) or {}
            bnd = _row(e.get("bound", []), "sound bound", frac)
            pub_cell = (f"{100 * pub:.1f}%" if pub is not None
                        and abs(frac - results["budget"]) < 1e-9 else "-")
            lines.append(f"| {e['name']} | {frac:g} | {pub_cell} | " + " | ".join(cells)
                         + f" | {_fmt_ret(bnd) if bnd else '-'}"
                         + f" | {ss.get('plan_and_simulate_ms', 0):.0f} ms |")
    lines += ["", "How far the planners are from the sound bound. *Slack* = forward time x D2H "
              "bandwidth / keep-all peak: the share of the peak that copies hidden under forward "
              "compute can move out; the rest of what must leave has to be recomputed.", "",
              "| workload | budget | slackswap | optimal | sound bound | slackswap to bound "
              "| slack |", "|---|---|---|---|---|---|---|"]
    for e in results["profiles"]:
        for frac in budgets:
            ss, opt = _row(e["main"], "slackswap", frac), _row(e["main"], "optimal", frac)
            bnd = _row(e.get("bound", []), "sound bound", frac)
            diff = (f"{100 * (bnd['retention'] - ss['retention']):.2f} points"
                    if ss and bnd and ss.get("retention") is not None
                    and bnd.get("retention") is not None else "-")
            slack = e.get("slack_fraction")
            lines.append(f"| {e['name']} | {frac:g} | {_fmt_ret(ss) if ss else '-'} | "
                         f"{_fmt_ret(opt) if opt else '-'} | {_fmt_ret(bnd) if bnd else '-'} | "
                         f"{diff} | {'-' if slack is None else f'{100 * slack:.1f}%'} |")
    lines.append("")
    for e in results["profiles"]:
        for row in e["main"]:
            if row["planner"] == "optimal" and row.get("notes"):
                lines.append(f"- {e['name']} at {row['budget_fraction']:g}, optimal: "
                             + "; ".join(row["notes"]))
    lines += ["", "## Budget sweep", ""]
    for e in results["profiles"]:
        swept = sorted({r["planner"] for r in e["sweep"]}, key=names.index)
        lines += [f"### {e['name']}", "", "| budget | " + " | ".join(swept) + " |",
                  "|" + "---|" * (len(swept) + 1)]
        for frac in results["sweep"]:
            cells = []
            for name in swept:
                row = _row(e["sweep"], name, frac)
                cells.append(_fmt_ret(row) if row else "-")
            lines.append(f"| {frac:.1f} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines) + "\n"


def _row(rows: list[dict], planner: str, frac: float) -> dict | None:
    return next((r for r in rows if r["planner"] == planner
                 and abs(r["budget_fraction"] - frac) < 1e-9), None)


MARKERS = ("o", "s", "^", "D", "v", "P", "X")


def plot(results: dict, names: list[str], path: Path) -> str | None:
    """Retention against budget, one panel a profile, the hardware in the title.

    The y axis spans the band where the planners differ: a planner whose every point lies
    far below it (swap-all, flat where the link cannot hide its copies) is named in the
    legend with its value instead of flattening the band. Each planner has its own marker
    and a small sideways offset, so equal points stay visible."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:   # matplotlib is optional
        return None
    profs = results["profiles"]
    fig, axes = plt.subplots(1, len(profs), figsize=(5 * len(profs), 5.2), squeeze=False)
    for ax, e in zip(axes[0], profs):
        lines = {}
        for name in names:
            pts = [(r["budget_fraction"], r["retention"]) for r in e["sweep"]
                   if r["planner"] == name and r.get("retention") is not None and r["feasible"]]
            if pts:
                lines[name] = sorted(pts)
        tops = [max(y for _, y in pts) for pts in lines.values()]
        # the band: from the lowest point of the lines that reach within 0.3 of the best
        near = [pts for pts in lines.values() if max(y for _, y in pts) >= max(tops) - 0.3]
        lo = min(y for pts in near for _, y in pts) - 0.02 if near else 0.0
        lo = max(0.0, min(lo, 0.95))
        step = 0.006 * (max(x for pts in lines.values() for x, _ in pts) or 1.0)
        for i, (name, pts) in enumerate(lines.items()):
            xs, ys = zip(*pts)
            if max(ys) < lo:            # entirely below the band: say where, do not squash it
                flat = min(ys) == max(ys)
                where = f"{ys[0]:.2f}" if flat else f"{min(ys):.2f}-{max(ys):.2f}"
                ax.plot([], [], marker=MARKERS[i % len(MARKERS)], ls="--", color=f"C{i}",
                        label=f"{name}: {where}, below the axis")
                continue
            dx = (i - (len(lines) - 1) / 2) * step
            ax.plot([x + dx for x in xs], ys, marker=MARKERS[i % len(MARKERS)], ms=5,
                    color=f"C{i}", alpha=0.85, label=name)
        opts = [(r["budget_fraction"], r["retention"]) for r in e["main"]
                if r["planner"] == "optimal" and r.get("retention") is not None]
        if opts:
            ax.plot(*zip(*opts), "kx", ms=9, label="optimal")
        bnds = [(r["budget_fraction"], r["retention"]) for r in e.get("bound", [])
                if r.get("retention") is not None]
        if bnds:
            ax.plot(*zip(*bnds), "k_", ms=14, mew=2, label="sound bound")
        if e.get("published_retention"):
            ax.plot([results["budget"]], [e["published_retention"]], "k*", ms=12,
                    label="published")
        ax.set_ylim(lo, 1.005)
        ax.set_title(e["name"])
        ax.set_xlabel("budget (fraction of keep-all peak)")
        ax.set_ylabel("retention")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2,
                  frameon=False)
    fig.suptitle(f"Retention against activation budget, simulated on {results['hardware']}",
                 fontsize=11)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    tmp.replace(path)
    plt.close(fig)
    return str(path)


if __name__ == "__main__":
    raise SystemExit(main())
