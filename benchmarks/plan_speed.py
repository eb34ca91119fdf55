"""How long planning and simulating takes with the `slackswap` planner on the sample profiles
(targets: Llama-7B at most 1 s, a Llama-70B-style profile at most 3 s, on this 2-core machine).

The Llama-70B profile is made first if it is not there (`examples/llama_70b.py`, `--device
fake`, a100-pcie4 roofline: about 20 s; it is not shipped, 7 MB). Each row is the fastest of
`--repeats` runs of `planners.make_plan` (plan, then simulate) at budgets 0.3/0.5/0.7 of the
keep-all peak. Writes benchmarks/results/plan_speed.json.

    python benchmarks/plan_speed.py
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TARGETS_S = {"llama-7b": 1.0, "llama-70b": 3.0}


def main(argv=None) -> int:
    from slackswap_cli.hardware import PRESETS
    from slackswap_cli.planners import make_plan
    from slackswap_cli.schema import load_profile, save
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--llama70b", default=str(ROOT / "out" / "llama-70b.profile.json"))
    ap.add_argument("-o", default=str(ROOT / "benchmarks" / "results" / "plan_speed.json"))
    opts = ap.parse_args(argv)
    hw = PRESETS["a100-pcie4"]
    big = Path(opts.llama70b)
    if not big.exists():
        from slackswap_cli.trace import profile_workload
        t0 = time.perf_counter()
        prof = profile_workload(str(ROOT / "examples" / "llama_70b.py"), device="fake",
                                hardware=hw)
        big.parent.mkdir(parents=True, exist_ok=True)
        save(prof, big)
        print(f"profiled llama-70b in {time.perf_counter() - t0:.1f} s", flush=True)
    paths = {p.stem: p for p in sorted((ROOT / "sample_profiles").glob("*.json"))}
    paths["llama-70b"] = big
    rows = []
    for name, path in paths.items():
        prof = load_profile(path)
        peak = prof.keep_all_peak_bytes
        for frac in (0.3, 0.5, 0.7):
            best, plan = float("inf"), None
            for _ in range(opts.repeats):
                t0 = time.perf_counter()
                plan = make_plan("slackswap", prof, hw, int(frac * peak), frac)
                best = min(best, time.perf_counter() - t0)
            target = TARGETS_S.get(name)
            rows.append({"profile": name, "ops": len(prof.ops), "budget_fraction": frac,
                         "plan_and_simulate_s": round(best, 3), "feasible": plan.feasible,
                         "retention": plan.predicted.retention, "target_s": target,
                         "within_target": None if target is None else best <= target})
            print(f"{name:12s} {frac}: {best:.2f} s, retention {plan.predicted.retention:.2%}"
                  + (f" (target {target:g} s)" if target else ""), flush=True)
    out = Path(opts.o)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"cpus": os.cpu_count(), "hardware": hw.name, "rows": rows},
                              indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
