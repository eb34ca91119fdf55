"""How much the planners leave behind: local search from each planner's plan, next to the
sound bound.

For each profile and budget this runs `slackswap` and `optimal` (timed), computes the sound
bound (`slackswap_cli/planners/bound.py`: no plan the simulator accepts beats it), then runs a
first-improvement local search (`slackswap_testkit/local_search.py`: 1-moves, flip one
decision; 2-moves, exchange the actions of two tensors of similar size) from each planner's
plan, every candidate judged by the simulator. Writes

- `<out>/local_search.json`: every number, with the search's moves and plans evaluated,
- `<out>/local_search.md`: per profile and budget, slackswap, optimal, the sound bound, the
  best plan the search found, and planning times.

    python benchmarks/local_search.py [--profiles a.json ...] [--budgets 0.3,0.5,0.7]
        [--hardware a100-pcie4] [--optimal-time-limit 60] [--search-time-limit 90]
        [--no-two-moves] [--out benchmarks/results]
"""
from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from slackswap_cli.budget import parse_budget  # noqa: E402
from slackswap_cli.hardware import load_hardware  # noqa: E402
from slackswap_cli.planners import make_plan  # noqa: E402
from slackswap_cli.planners.bound import sound_bound  # noqa: E402
from slackswap_cli.profile_build import recost  # noqa: E402
from slackswap_cli.schema import dumps, load_profile, write_atomic  # noqa: E402
from slackswap_testkit.local_search import improve  # noqa: E402

SAMPLES = ["sample_profiles/bert-large.json", "sample_profiles/gpt2-xl.json",
           "sample_profiles/llama-7b.json", "sample_profiles/resnet50.json"]


def run_case(prof, hw, fraction: float, optimal_s: float, search_s: float,
             two_moves: bool) -> dict:
    budget, _ = parse_budget(str(fraction), prof)
    row: dict = {"budget_fraction": fraction, "budget_bytes": budget}
    t0 = time.perf_counter()
    b = sound_bound(prof, hw, budget)
    row["bound"] = {"retention": b.retention, "overhead_us": b.overhead_us, "fits": b.fits,
                    "solve_s": time.perf_counter() - t0, "message": b.message}
    plans = {}
    for name in ("slackswap", "optimal"):
        opts = {"time_limit_s": optimal_s} if name == "optimal" else {}
        t0 = time.perf_counter()
        plan = make_plan(name, prof, hw, budget, budget_fraction=fraction, **opts)
        wall = time.perf_counter() - t0
        plans[name] = plan
        row[name] = {"retention": plan.predicted.retention, "feasible": plan.feasible,
                     "solve_ms": plan.solve_ms, "plan_and_simulate_s": wall,
                     "notes": list(plan.notes)}
    row["optimal"]["model_error"] = model_error(row["optimal"]["notes"])
    row["search"] = {}
    for name, plan in plans.items():
        res = improve(prof, hw, budget, list(plan.decisions), two_moves=two_moves,
                      time_limit_s=search_s)
        row["search"][name] = {"start": res.start_retention, "retention": res.retention,
                               "moves": res.moves, "evaluated": res.evaluated,
                               "seconds": res.seconds}
    found = [s["retention"] for s in row["search"].values() if s["retention"] is not None]
    row["best_search"] = max(found) if found else None
    return row


AGREEMENT = re.compile(r"the MILP's plan simulates at ([0-9.]+) us of overhead, its objective "
                       r"says ([0-9.]+) us")


def model_error(notes) -> float | None:
    """(simulated - objective) / objective on the MILP's own plan, from optimal's note on it
    (None: the MILP found no plan, or it has no overhead)."""
    for n in notes:
        hit = AGREEMENT.search(n)
        if hit:
            sim, obj = float(hit.group(1)), float(hit.group(2))
            return (sim - obj) / obj if obj > 0 else (0.0 if sim == 0 else None)
    return None


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.2f}%"


def render(results: dict) -> str:
    lines = [f"# Local search and the sound bound on {results['hardware']}", "",
             "Retention (ideal / simulated step time). *bound*: the LP of "
             "`slackswap_cli/planners/bound.py`, which no plan the simulator accepts beats. "
             "*search*: the best plan a first-improvement 1- and 2-move local search found "
             f"from slackswap's and optimal's plans ({results['search_time_limit_s']:g} s "
             f"each at most). optimal: {results['optimal_time_limit_s']:g} s limit. "
             "*MILP error*: how far the simulation of the MILP's own plan (before polish) is "
             "from the MILP's objective.", "",
             "| workload | budget | slackswap | optimal | sound bound | search | "
             "slackswap time | optimal time | bound time | search moves (ss / opt) | "
             "MILP error |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in results["profiles"]:
        for r in e["rows"]:
            ss, op = r["slackswap"], r["optimal"]
            mark = {n: "" if r[n]["feasible"] else " (over)" for n in ("slackswap", "optimal")}
            s = r["search"]
            lines.append(
                f"| {e['name']} | {r['budget_fraction']:.1f} | {_pct(ss['retention'])}"
                f"{mark['slackswap']} | {_pct(op['retention'])}{mark['optimal']} | "
                f"{_pct(r['bound']['retention'])} | {_pct(r['best_search'])} | "
                f"{ss['plan_and_simulate_s']:.2f} s | {op['plan_and_simulate_s']:.1f} s | "
                f"{r['bound']['solve_s']:.1f} s | {s['slackswap']['moves']} / "
                f"{s['optimal']['moves']} | {_err(op.get('model_error'))} |")
    return "\n".join(lines) + "\n"


def _err(x) -> str:
    return "-" if x is None else f"{100 * x:+.2f}%"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profiles", nargs="*", default=None)
    ap.add_argument("--budgets", default="0.3,0.5,0.7")
    ap.add_argument("--hardware", default="a100-pcie4")
    ap.add_argument("--optimal-time-limit", type=float, default=60.0)
    ap.add_argument("--search-time-limit", type=float, default=90.0)
    ap.add_argument("--no-two-moves", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    hw = load_hardware(args.hardware)
    paths = args.profiles if args.profiles is not None else [str(ROOT / s) for s in SAMPLES]
    budgets = [float(x) for x in args.budgets.split(",") if x.strip()]
    results = {"hardware": hw.name, "optimal_time_limit_s": args.optimal_time_limit,
               "search_time_limit_s": args.search_time_limit,
               "two_moves": not args.no_two_moves, "profiles": []}
    for path in paths:
        prof = recost(load_profile(path), hw)
        name = str(prof.workload.get("name") or Path(path).stem)
        entry = {"name": name, "path": str(path), "rows": []}
        for frac in budgets:
            row = run_case(prof, hw, frac, args.optimal_time_limit, args.search_time_limit,
                           not args.no_two_moves)
            entry["rows"].append(row)
            print(f"[local_search] {name:12s} {frac:.1f} slackswap "
                  f"{_pct(row['slackswap']['retention'])} optimal "
                  f"{_pct(row['optimal']['retention'])} bound "
                  f"{_pct(row['bound']['retention'])} search {_pct(row['best_search'])}",
                  flush=True)
        results["profiles"].append(entry)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "local_search.json", dumps(results))
    write_atomic(out / "local_search.md", render(results).encode())
    print(f"[local_search] wrote {out / 'local_search.json'}, {out / 'local_search.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
