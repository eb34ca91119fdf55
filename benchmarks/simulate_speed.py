"""How long one `simulate` call takes: the planners call it many times, so it must stay fast.

For each sample profile, plans the step with `slackswap` at a budget fraction (default 0.5 of
the keep-all peak, on `a100-pcie4`), then times `simulate` on that plan, without the timeline
(`record=False`, as the planners call it) and with it (`record=True`, as `plan` and `show`
do). Reports the median and the fastest of `--repeats` calls; writes
benchmarks/results/simulate_speed.json.

    python benchmarks/simulate_speed.py [--profiles a.json ...] [--budget 0.5] [--repeats 30]

With `--against OLD.py` (a copy of an earlier slackswap_cli/simulate.py, e.g. `git show
main:slackswap_cli/simulate.py > /tmp/old_simulate.py`) it also times that version on the same
plans, the two calls interleaved round by round in one process, and reports the ratios of the
fastest and of the median calls in CPU time (this version / the old one): the way to tell
whether a change slowed the event loop on a noisy machine (on a loaded one, trust the median).
The ratios go into the JSON as `vs_reference`.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from slackswap_cli.hardware import load_hardware  # noqa: E402
from slackswap_cli.planners import run_planner  # noqa: E402
from slackswap_cli.schema import load_profile  # noqa: E402
from slackswap_cli.simulate import simulate  # noqa: E402

SAMPLES = ["sample_profiles/bert-large.json", "sample_profiles/gpt2-xl.json",
           "sample_profiles/llama-7b.json"]


def time_calls(fn, repeats: int) -> dict:
    fn()   # warm the per-profile tables
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return {"median_ms": statistics.median(times), "min_ms": min(times)}


def load_reference(path: str):
    """The `simulate` of an older copy of slackswap_cli/simulate.py (its relative imports
    resolve against the current package)."""
    spec = importlib.util.spec_from_file_location("slackswap_cli._simulate_reference", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module       # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module.simulate


def interleaved_ratio(fn, ref, repeats: int) -> dict:
    """Time of `fn` / time of `ref`, the two called alternately (order swapped every round) so
    that load on the machine hits both alike: the ratio of the fastest calls and of the median
    ones. Times are the process's CPU time (`time.process_time`), which time spent waiting for
    a core on a shared machine does not inflate."""
    fn(), ref()
    times: dict[int, list[float]] = {0: [], 1: []}
    for i in range(repeats):
        for k in ((0, 1) if i % 2 == 0 else (1, 0)):
            f = fn if k == 0 else ref
            t0 = time.process_time()
            f()
            times[k].append(time.process_time() - t0)
    return {"min": min(times[0]) / min(times[1]),
            "median": statistics.median(times[0]) / statistics.median(times[1])}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profiles", nargs="+", default=[str(ROOT / p) for p in SAMPLES])
    ap.add_argument("--budget", type=float, default=0.5)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--against", help="an older simulate.py to compare with (interleaved)")
    args = ap.parse_args(argv)
    reference = load_reference(args.against) if args.against else None
    hw = load_hardware("a100-pcie4")
    rows = []
    for path in args.profiles:
        prof = load_profile(path)
        budget = int(prof.keep_all_peak_bytes * args.budget)
        decisions, _, _ = run_planner("slackswap", prof, hw, budget)
        row = {"profile": Path(path).stem, "n_ops": len(prof.ops),
               "n_saved": len(prof.saved_activations), "budget_fraction": args.budget}
        for record in (False, True):
            key = "record" if record else "no_record"
            row[key] = time_calls(lambda: simulate(prof, decisions, hw, budget, record=record),
                                  args.repeats)
            if reference is not None:
                row.setdefault("vs_reference", {})[key] = interleaved_ratio(
                    lambda: simulate(prof, decisions, hw, budget, record=record),
                    lambda: reference(prof, decisions, hw, budget, record=record), args.repeats)
        rows.append(row)
        print(f"{row['profile']:12s} {row['n_ops']:5d} ops  record=False "
              f"{row['no_record']['median_ms']:7.2f} ms (min {row['no_record']['min_ms']:.2f})"
              f"  record=True {row['record']['median_ms']:7.2f} ms "
              f"(min {row['record']['min_ms']:.2f})", flush=True)
        if reference is not None:
            vs = row["vs_reference"]
            print(f"{'':12s} this / reference, interleaved (min, median): record=False "
                  f"{vs['no_record']['min']:.3f}, {vs['no_record']['median']:.3f}  record=True "
                  f"{vs['record']['min']:.3f}, {vs['record']['median']:.3f}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "simulate_speed.json").write_text(json.dumps(
        {"machine": platform.processor() or platform.machine(), "python": platform.python_version(),
         "repeats": args.repeats, "results": rows}, indent=2) + "\n")
    print(f"wrote {out / 'simulate_speed.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
