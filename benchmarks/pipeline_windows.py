"""What spending a pipeline's idle windows on swaps gains: per schedule, ranks, microbatches and
per-rank budget, the stages planned as today (`plan_stages`: each stage's swaps hidden under
its own microbatch) against window-aware plans (`plan_stages(..., windows=Windows(...))`:
planned as on a faster link, kept where the rank-level judge says so), both judged by the
same rank-level judge (`pipeline_copies.judge`: every rank's schedule with bubbles, the
copies on its shared engines, copies back issued as early as the budget allows).

Every stage of a pipeline is priced as one profile (as `simulate --pp` does): the sample
profiles (whole models standing in for a stage), the tiny GPT and Llama stages of
examples/gpt_stage.py (profiled here with fake tensors, microbatch 8), and a synthetic chain
of 6 ops of 50 us each making 3 MiB (copies slower than its ops: where planned alone it
recomputes). The budget is a fraction of rank 0's keep-all peak (the rank that holds the
most), the same for every rank.

    python benchmarks/pipeline_windows.py            # every case (hours on 2 cores: not run)
    python benchmarks/pipeline_windows.py --quick    # the tiny stages; bert-large at pp 2 x 4
                                                     # and 4 x 8 microbatches per schedule

Writes benchmarks/results/pipeline_windows.{json,md}.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from slackswap_cli.errors import InfeasibleError  # noqa: E402
from slackswap_cli.hardware import load_hardware  # noqa: E402
from slackswap_cli.pipeline.copies import judge  # noqa: E402
from slackswap_cli.pipeline.orders import order  # noqa: E402
from slackswap_cli.pipeline.stages import plan_stages, rank_peak, stage_cost  # noqa: E402
from slackswap_cli.pipeline.step import SENDS_OF, boundary_of  # noqa: E402
from slackswap_cli.pipeline.windows import Windows  # noqa: E402
from slackswap_cli.planning import plan_profile  # noqa: E402
from slackswap_cli.schema import load_profile  # noqa: E402
from slackswap_testkit.synthetic import chain_profile  # noqa: E402

PIPELINES = [(s, pp, mb) for s in ("1F1B", "Interleaved1F1B", "GPipe")
             for pp in (2, 4) for mb in (4, 8)]
FRACTIONS = (0.5, 0.75)
SAMPLES = ("bert-large", "llama-7b", "gpt2-xl", "resnet50")
HW = load_hardware("a100-pcie4")


def _tiny(family: str, tmp: Path) -> Path:
    out = tmp / f"{family}_stage.profile.json"
    cli = "import sys; from slackswap_cli.cli import main; sys.argv[0] = 'slackswap'; main()"
    subprocess.run([sys.executable, "-c", cli, "profile", str(ROOT / "examples" / "gpt_stage.py"),
                    "--device", "fake", "--arg", "batch=8", "--arg", f"family={family}",
                    "-o", str(out)], check=True, capture_output=True, cwd=ROOT,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})
    return out


class Planner:
    """slackswap plans, one per (profile, budget, hardware), kept for every case."""

    def __init__(self):
        self.memo: dict = {}
        self.calls = 0

    def __call__(self, prof, budget, hw=HW):
        key = (id(prof), budget, hw.name)
        if key not in self.memo:
            self.calls += 1
            self.memo[key] = (prof, plan_profile(prof, hw, budget, None, "slackswap")[0])
        return self.memo[key][1]


def _bounds(prof, steps, schedule):
    n = 1 + max(s for st in steps.values() for _, s, _ in st)
    rank_of = {s: r for r, st in steps.items() for _, s, _ in st}
    return {s: boundary_of(prof, s, n, SENDS_OF[schedule],
                           (rank_of.get(s - 1) == rank_of[s], rank_of.get(s + 1) == rank_of[s]))
            for s in range(n)}


def _figures(table, prof, steps, bound, budget, windows) -> dict:
    work = {s: windows.work(prof, p, bound[s]) for s, p in table.plans.items()}
    got = judge(steps, work, budget)
    return {"step_us": got.step_us,
            "exposed_us": [got.ranks[r].exposed_us for r in sorted(got.ranks)],
            "judged_peak_bytes": [got.ranks[r].peak_bytes for r in sorted(got.ranks)],
            "fits": all(j.peak_bytes <= budget for j in got.ranks.values()),
            "swapped_bytes": sum(r.swapped_bytes for r in table.rows),
            "recomputed_bytes": sum(r.recomputed_bytes for r in table.rows),
            "link_factors": [r.link_factor for r in table.rows],
            "fractions": [round(r.fraction, 4) for r in table.rows]}


def case(name, prof, schedule, pp, mb, fraction, planner) -> dict:
    steps = order(schedule, pp, mb, 2)
    bound = _bounds(prof, steps, schedule)
    keep = {s: stage_cost(prof, None, b) for s, b in bound.items()}
    budget = int(fraction * rank_peak(steps[0], keep))
    windows = Windows(planner, HW)
    row = {"profile": name, "schedule": schedule, "pp": pp, "microbatches": mb,
           "fraction": fraction, "budget_bytes": budget}
    profiles = {s: prof for s in bound}
    t0 = time.perf_counter()
    try:
        current = plan_stages(steps, profiles, budget, lambda p, b: planner(p, b), bound)
        row["current"] = _figures(current, prof, steps, bound, budget, windows)
    except InfeasibleError:
        row["current"] = None
    t1 = time.perf_counter()
    try:
        win = plan_stages(steps, profiles, budget, None, bound, windows=windows)
        row["windows"] = _figures(win, prof, steps, bound, budget, windows)
    except InfeasibleError:
        row["windows"] = None
    row["seconds"] = [round(t1 - t0, 2), round(time.perf_counter() - t1, 2)]
    return row


def _cell(fig, key, scale=1.0, fmt="{:.0f}"):
    return "-" if fig is None else fmt.format(fig[key] / scale)


def _over(fig, budget: int) -> str:
    return "-" if fig is None else f"{100 * (max(fig['judged_peak_bytes']) / budget - 1):+.1f}%"


def markdown(rows) -> str:
    head = ("| profile | schedule | pp | mb | budget | step now (us) | step windows (us) | gain "
            "| recomputed now / windows (MiB) | swapped now / windows (MiB) | exposed now / "
            "windows (us, worst rank) | worst rank's judged peak over budget, now / windows | factors |")
    lines = [head, "|" + "---|" * 13]
    for r in rows:
        c, w = r["current"], r["windows"]
        gain = ("-" if c is None or w is None else
                f"{100 * (c['step_us'] - w['step_us']) / c['step_us']:+.1f}%")
        mib = 1 << 20
        lines.append(
            f"| {r['profile']} | {r['schedule']} | {r['pp']} | {r['microbatches']} | "
            f"{r['fraction']} | {_cell(c, 'step_us')} | {_cell(w, 'step_us')} | {gain} | "
            f"{_cell(c, 'recomputed_bytes', mib, '{:.1f}')} / "
            f"{_cell(w, 'recomputed_bytes', mib, '{:.1f}')} | "
            f"{_cell(c, 'swapped_bytes', mib, '{:.1f}')} / "
            f"{_cell(w, 'swapped_bytes', mib, '{:.1f}')} | "
            f"{'-' if c is None else round(max(c['exposed_us']))} / "
            f"{'-' if w is None else round(max(w['exposed_us']))} | "
            f"{_over(c, r['budget_bytes'])} / {_over(w, r['budget_bytes'])} | "
            f"{'-' if w is None else ','.join(f'{f:g}' for f in w['link_factors'])} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="the tiny stages, and bert-large at 2 x 4 and 4 x 8 only")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--render", metavar="JSON", help="only write the table of a results file")
    args = ap.parse_args()
    if args.render:
        data = json.loads(Path(args.render).read_text())
        return _write(Path(args.out), data["meta"], data["rows"])
    planner, rows = Planner(), []
    with tempfile.TemporaryDirectory() as tmp:
        profiles = {f"tiny-{f}": load_profile(_tiny(f, Path(tmp))) for f in ("gpt", "llama")}
    profiles["chain-3MiB"] = chain_profile(6, act_bytes=3 << 20, fwd_us=50.0)
    for name in SAMPLES[:1] if args.quick else SAMPLES:
        profiles[name] = load_profile(ROOT / "sample_profiles" / f"{name}.json")
    for name, prof in profiles.items():
        for schedule, pp, mb in PIPELINES:
            if args.quick and name in SAMPLES and (pp, mb) not in ((2, 4), (4, 8)):
                continue
            for fraction in FRACTIONS:
                rows.append(case(name, prof, schedule, pp, mb, fraction, planner))
                print(json.dumps(rows[-1]), flush=True)
    meta = {"hardware": HW.name, "planner": "slackswap", "plans_made": planner.calls,
            "command": "python benchmarks/pipeline_windows.py" + (" --quick" if args.quick else "")}
    _write(Path(args.out), meta, rows)


def _write(out: Path, meta: dict, rows: list) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "pipeline_windows.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (out / "pipeline_windows.md").write_text(
        f"# Pipeline idle windows: current plans vs window-aware ({meta['command']})\n\n"
        f"Both judged by pipeline_copies.judge on {HW.name}; budget: a fraction of rank 0's "
        "keep-all peak, every rank.\n\n" + markdown(rows) + "\n")


if __name__ == "__main__":
    main()
