"""How long the whole `slackswap fit` takes.

- Llama-7B-style (`examples/llama_7b.py`, seq 4096) on h100-pcie5, batch 1,2,4,8,16
  (target: 90 s);
- Llama-70B-style (`examples/llama_70b.py`) with `--shard 8`, batch 1,2,4 (target: 120 s).

Each runs as the CLI in a subprocess (imports included); recorded: wall time, the child's CPU
time (user + sys: on a shared machine the wall time depends on the other jobs, the CPU time
much less), the load average around it, and the per-batch lines fit prints on stderr. The
Llama-7B sweep runs three times: by default (batches after the first two derived from the last
two traced where exact, traces in forked processes ahead of planning: `--jobs 2`), with
`--jobs 1` (the same, traced in this process) and with `--profile-each` (every batch traced);
the Llama-70B sweep by default and with `--jobs 1`. The JSON outputs must give the
same rows, which checks the derived profiles against direct traces and the forked traces
against in-process ones on these models.

    python benchmarks/fit_speed.py            # writes benchmarks/results/fit_speed.json
    python benchmarks/fit_speed.py --quick    # Llama-7B default mode only
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CASES = {
    "llama_7b": (["examples/llama_7b.py", "--hardware", "h100-pcie5", "--batch", "1,2,4,8,16"], 90.0),
    "llama_7b --jobs 1": (["examples/llama_7b.py", "--hardware", "h100-pcie5", "--batch",
                           "1,2,4,8,16", "--jobs", "1"], None),
    "llama_7b --profile-each": (["examples/llama_7b.py", "--hardware", "h100-pcie5", "--batch",
                                 "1,2,4,8,16", "--profile-each"], None),
    "llama_70b --shard 8": (["examples/llama_70b.py", "--hardware", "h100-pcie5", "--shard", "8",
                             "--batch", "1,2,4"], 120.0),
    "llama_70b --shard 8 --jobs 1": (["examples/llama_70b.py", "--hardware", "h100-pcie5",
                                      "--shard", "8", "--batch", "1,2,4", "--jobs", "1"], None),
}
SAME_ROWS = {"derived_rows_equal_traced_rows": ("llama_7b", "llama_7b --profile-each"),
             "jobs_2_rows_equal_jobs_1_rows_7b": ("llama_7b", "llama_7b --jobs 1"),
             "jobs_2_rows_equal_jobs_1_rows_70b": ("llama_70b --shard 8",
                                                   "llama_70b --shard 8 --jobs 1")}


def run(args: list[str], out_dir: Path) -> dict:
    exe = Path(sys.executable).with_name("slackswap")
    cmd = [str(exe), "fit", *args, "--json", "-o", str(out_dir / "best.plan.json")]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    data = json.loads(p.stdout)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"command": "slackswap fit " + " ".join(args), "wall_s": round(wall, 1),
            "cpu_s": round(cpu, 1), "load_avg_1min_before": load0,
            "load_avg_1min_after": os.getloadavg()[0],
            "progress": [line for line in p.stderr.splitlines() if line.startswith("[")],
            "best": data["best"], "rows": data["rows"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="the Llama-7B default sweep only")
    ap.add_argument("--md-only", action="store_true", help="rewrite the .md from the .json")
    a = ap.parse_args()
    if a.md_only:
        out = json.loads((ROOT / "benchmarks" / "results" / "fit_speed.json").read_text())
        (ROOT / "benchmarks" / "results" / "fit_speed.md").write_text(markdown(out))
        return
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (args, target) in CASES.items():
            if a.quick and name != "llama_7b":
                continue
            r = run(args, Path(tmp))
            r["target_s"] = target
            results[name] = r
            print(f"{name}: {r['wall_s']} s wall, {r['cpu_s']} s CPU "
                  f"(load {r['load_avg_1min_before']:.1f})", flush=True)
            for line in r["progress"]:
                print("   ", line, flush=True)
    out = {"machine": {"cpus": os.cpu_count()}, "results": results}
    drop = lambda rows: [{k: v for k, v in x.items() if k != "derived_from"} for x in rows]
    for key, (a_name, b_name) in SAME_ROWS.items():
        if a_name in results and b_name in results:
            out[key] = drop(results[a_name]["rows"]) == drop(results[b_name]["rows"])
            print(f"{key}: {out[key]}")
    for r in results.values():
        r.pop("rows")
    (ROOT / "benchmarks" / "results" / "fit_speed.json").write_text(json.dumps(out, indent=1))
    (ROOT / "benchmarks" / "results" / "fit_speed.md").write_text(markdown(out))


def markdown(out: dict) -> str:
    lines = ["| sweep | wall | CPU (user + sys) | target | load average (1 min) before / after | traced / derived |",
             "|---|---|---|---|---|---|"]
    for name, r in out["results"].items():
        done = [x for x in r["progress"] if " in " in x]
        derived = sum("derived from" in x for x in done)
        target = f"{r['target_s']:.0f} s" if r["target_s"] else "-"
        lines.append(f"| `{r['command']}` | {r['wall_s']:.0f} s | {r['cpu_s']:.0f} s | {target} | "
                     f"{r['load_avg_1min_before']:.1f} / {r['load_avg_1min_after']:.1f} | "
                     f"{len(done) - derived} / {derived} |")
    lines.append("")
    for key, (a_name, b_name) in SAME_ROWS.items():
        if key in out:
            lines.append(f"- `{a_name}` and `{b_name}` give identical rows: {out[key]}.")
    lines.extend(f"- {note}" for note in out.get("notes", []))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
