"""The best `fit` row against the best row of every baseline and every other
planner, on the four sample workloads, on a100-pcie4 with 40 GiB and h100-pcie5 with 80 GiB.

Each (workload, batch) is profiled once with fake tensors (costed on h100-pcie5; batches after
the first two derived from the last two traced where exact, as `fit` does) and re-costed
for a100-pcie4 (`profile_build.recost`, what `plan --hardware` does: the roofline re-timed from
each op's FLOPs and bytes). Every row of every sweep is then planned by `fit.plan_row` in the
same budget (device memory - static - reserve, AdamW): `fit`'s planner (slackswap), the
baselines (keep-all, checkpoint-layers with every block, recompute-only) and the other
planners (optimal with a 10 s limit per batch, swap-all, checkpoint-layers choosing its k).

Llama-7B's AdamW state does not fit a 40 GiB device (50 GiB of parameters, gradients and
state): there it is sharded over 2 ranks (`--shard 2`, per-rank figures). The batch lists keep
the run to several minutes on a 2-core machine (each fake trace takes 10-50 s there).

    python benchmarks/fit_table.py            # writes benchmarks/results/fit_table.{json,md}
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from slackswap_cli.fit import (  # noqa: E402
    BASELINES,
    FitSettings,
    best_row,
    default_reserve,
    plan_row,
    static_memory,
)
from slackswap_cli.fit import profiles as fit_profiles  # noqa: E402
from slackswap_cli.hardware import PRESETS  # noqa: E402
from slackswap_cli.profile_build import recost  # noqa: E402
from slackswap_cli.trace.static_memory import Profiler  # noqa: E402
from slackswap_cli.units import GIB  # noqa: E402

WORKLOADS = {          # example -> (batches, shard on the 40 GiB A100)
    "llama_7b": ([1, 2, 4], 2),
    "gpt2_xl": ([4, 8, 16, 32], 1),
    "bert_large": ([16, 32, 64, 128], 1),
    "resnet50": ([64, 128, 256, 512], 1),
}
DEVICES = {"a100-pcie4": 40 * GIB, "h100-pcie5": 80 * GIB}
FIT = "slackswap"
OTHERS = [*BASELINES, "optimal", "swap-all", "checkpoint-layers (any k)"]


def settings(hw_name: str, memory: int, shard: int) -> FitSettings:
    hw = dataclasses.replace(PRESETS[hw_name], memory_bytes=memory)
    return FitSettings(hardware=hw, memory_bytes=memory, reserve_bytes=default_reserve(memory),
                       optimizer="adamw", shard=shard, planner=FIT)


def rows_for(kind: str, profiles, s: FitSettings) -> list[dict]:
    from slackswap_cli.planners import make_plan
    plan_fn = None
    if kind == "checkpoint-layers (any k)":      # as the registry runs it: the largest k that fits
        plan_fn = lambda prof, hw, budget: make_plan("checkpoint-layers", prof, hw, budget)
    s = dataclasses.replace(s, planner=kind,
                            planner_options={"time_limit_s": 10.0} if kind == "optimal" else {})
    rows = []
    for batch, (prof, facts) in profiles.items():
        static = static_memory(facts, s.optimizer, shard=s.shard)
        rows.append(plan_row(kind, batch, prof, static, s, plan_fn)[0])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="*", help="examples to run (default: all four)")
    a = ap.parse_args()
    out = {"machine": {"cpus": __import__("os").cpu_count(), "python": platform.python_version()},
           "optimizer": "adamw", "results": []}
    t_all = time.perf_counter()
    for name, (batches, shard40) in WORKLOADS.items():
        if a.only and name not in a.only:
            continue
        profiler = Profiler(str(ROOT / "examples" / f"{name}.py"), entry="workload", args={},
                            batch_arg="batch", device="fake", hardware=PRESETS["h100-pcie5"])
        profiles = {}     # traced, or derived where exact, as fit does
        for b, prof, facts, how in fit_profiles(batches, profiler, PRESETS["h100-pcie5"],
                                                "batch", lambda line: print(name, line, flush=True)):
            if prof is None:
                raise SystemExit(f"{name} batch {b}: {how}")
            profiles[b] = (prof, facts)
        for hw_name, memory in DEVICES.items():
            s = settings(hw_name, memory, shard40 if memory == 40 * GIB else 1)
            costed = {b: (recost(p, s.hardware), f) for b, (p, f) in profiles.items()}
            sweeps = {kind: rows_for(kind, costed, s) for kind in [FIT, *OTHERS]}
            best = {k: best_row(r) for k, r in sweeps.items()}
            entry = {"workload": name, "hardware": hw_name, "memory_bytes": memory,
                     "shard": s.shard, "batches": batches, "sweeps": sweeps,
                     "best": {k: (None if r is None else {"batch": r["batch"],
                                                          "samples_per_s": r["samples_per_s"]})
                              for k, r in best.items()}}
            f = best[FIT]
            entry["fit_at_or_above_all"] = f is not None and all(
                r is None or f["samples_per_s"] >= r["samples_per_s"] * (1 - 1e-9)
                for k, r in best.items() if k != FIT)
            out["results"].append(entry)
            print(f"{name} on {hw_name}: " + ", ".join(
                f"{k} " + ("-" if r is None else f"b{r['batch']} {r['samples_per_s']:.2f}")
                for k, r in best.items()), flush=True)
    out["wall_s"] = time.perf_counter() - t_all
    res = ROOT / "benchmarks" / "results"
    (res / "fit_table.json").write_text(json.dumps(out, indent=1))
    (res / "fit_table.md").write_text(markdown(out))
    print(markdown(out))


def markdown(out: dict) -> str:
    kinds = [FIT, *OTHERS]
    head = "| workload | device | " + " | ".join(
        "fit (slackswap)" if k == FIT else k for k in kinds) + " | fit best? |"
    lines = ["Best row of each sweep: samples/s (batch), AdamW, reserve 1 GiB + 5%, simulated "
             "(`benchmarks/fit_table.py`).", "", head,
             "|" + "---|" * (len(kinds) + 3)]
    for e in out["results"]:
        dev = f"{e['hardware']} {e['memory_bytes'] // GIB} GiB" + (
            f", shard {e['shard']}" if e["shard"] > 1 else "")
        cells = []
        for k in kinds:
            r = e["best"][k]
            cells.append("does not fit" if r is None else f"{r['samples_per_s']:.2f} (b{r['batch']})")
        lines.append(f"| {e['workload']} | {dev} | " + " | ".join(cells)
                     + f" | {'yes' if e['fit_at_or_above_all'] else 'NO'} |")
    lines.append("")
    lines.append(f"Total wall time {out['wall_s']:.0f} s on {out['machine']['cpus']} CPUs.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
