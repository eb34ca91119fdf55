"""Behaviour unchanged: a digest of what the planners, the simulator and the views produce.

Plans the four shipped samples (`sample_profiles/*.json`, a100-pcie4) at budgets 0.1, 0.2, ...,
1.0 with every fast planner (all registered ones but `optimal`, whose MILP runs under a time
limit), simulates each plan with its timeline, and hashes, per case, the decisions, schedule,
prediction, feasibility, notes and every timeline event and memory point. It also hashes the
terminal views of each sample (as `show profile.json` prints them) and of its slackswap plan at
0.5 (as `plan` prints them, and as `simulate --hardware h100-pcie5` does), at 80 and 100
columns, and a few synthetic profiles
(`slackswap_testkit.synthetic`). A refactoring that claims to change no behaviour must leave
every digest as it was:

    python benchmarks/plans_unchanged.py                       # writes benchmarks/results/plans_unchanged.json
    python benchmarks/plans_unchanged.py --check benchmarks/results/plans_unchanged.json
                                                               # exit 1, naming the cases, if any differs

Solve times are left out (they are clock readings); everything else is deterministic, and the
same on every machine: run it with numpy's CPU dispatch restricted too (docs/planning.md,
"Plans identical on every machine"), e.g.

    NPY_DISABLE_CPU_FEATURES="X86_V3 X86_V4" python benchmarks/plans_unchanged.py --check benchmarks/results/plans_unchanged.json
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import io
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rich.console import Console  # noqa: E402

from slackswap_cli.cli.render import plan_views, profile_views  # noqa: E402
from slackswap_cli.hardware import PRESETS  # noqa: E402
from slackswap_cli.planners import PLANNERS, plan_and_simulate, planner_names  # noqa: E402
from slackswap_cli.schema import dumps, load_profile  # noqa: E402
from slackswap_cli.simulate import simulate  # noqa: E402
from slackswap_testkit.synthetic import random_profile, transformer_profile  # noqa: E402

HW = PRESETS["a100-pcie4"]
BUDGETS = [round(0.1 * i, 1) for i in range(1, 11)]
SYNTHETIC = {"gpt2-4": dict(arch="gpt2", layers=4), "llama-3": dict(arch="llama", layers=3),
             "bert-2": dict(arch="bert", layers=2)}


def digest(obj) -> str:
    return hashlib.sha256(dumps(obj)).hexdigest()[:16]


def case_digest(plan, res) -> str:
    d = plan.to_dict()
    d.pop("solve_ms")
    return digest({"plan": d, "events": [dataclasses.asdict(e) for e in res.events],
                   "memory": res.memory})


def text(views, width: int) -> str:
    out = io.StringIO()
    console = Console(file=out, width=width, color_system=None, force_terminal=False)
    for view in views:
        console.print(view)
    return out.getvalue()


def views_text(plan, profile, result, planned=None, width: int = 100) -> str:
    return text(plan_views(dataclasses.replace(plan, solve_ms=0.0), profile, result,
                           planned=planned), width)


def run(samples: list[Path]) -> dict:
    planners = [p for p in planner_names() if PLANNERS[p].quick]  # a MILP per case: too slow
    cases: dict[str, str] = {}
    for path in samples:
        prof = load_profile(path)
        peak = prof.summary["peak_activation_bytes"]
        for name in planners:
            for frac in BUDGETS:
                plan, res = plan_and_simulate(name, prof, HW, int(peak * frac), frac, record=True)
                cases[f"{path.stem}/{name}/{frac}"] = case_digest(plan, res)
        plan, res = plan_and_simulate("slackswap", prof, HW, int(peak * 0.5), 0.5, record=True)
        cases[f"{path.stem}/views/plan"] = digest(views_text(plan, prof, res))
        h100 = PRESETS["h100-pcie5"]
        again = simulate(prof, plan.decisions, h100, plan.budget_bytes, record=True)
        what_if = dataclasses.replace(plan, hardware=h100.to_dict())
        cases[f"{path.stem}/views/simulate-h100"] = digest(views_text(what_if, prof, again, planned=plan))
        cases[f"{path.stem}/views/plan-80"] = digest(views_text(plan, prof, res, width=80))
        for width in (80, 100):
            cases[f"{path.stem}/views/profile-{width}"] = digest(text(profile_views(prof), width))
    for name, kw in SYNTHETIC.items():
        cases[f"synthetic/{name}"] = digest(transformer_profile(hw=HW, **kw).to_dict())
    for seed in range(5):
        cases[f"synthetic/random-{seed}"] = digest(random_profile(seed).to_dict())
    return cases


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", type=Path, help="compare with this earlier output instead of writing")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "plans_unchanged.json")
    args = ap.parse_args()
    t0 = time.perf_counter()
    cases = run(sorted((ROOT / "sample_profiles").glob("*.json")))
    seconds = time.perf_counter() - t0
    if args.check:
        before = json.loads(args.check.read_text())["cases"]
        changed = sorted(k for k in before if before[k] != cases.get(k))
        new = sorted(cases.keys() - before.keys())
        print(f"{len(before)} cases in {seconds:.0f} s: "
              + (f"{len(changed)} differ: {', '.join(changed)}" if changed else "all identical")
              + (f" ({len(new)} cases new here, not compared: {', '.join(new)})" if new else ""))
        return 1 if changed else 0
    args.out.write_text(json.dumps({"hardware": HW.name, "budgets": BUDGETS, "cases": cases},
                                   indent=1) + "\n")
    print(f"{len(cases)} cases in {seconds:.0f} s; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
