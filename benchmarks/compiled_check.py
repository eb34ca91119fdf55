"""compile_planned on the four small models: does the compiled graph carry the plan out, and
does it train like eager? (issue 20, items 3 and 4; CPU).

For tiny GPT (dropout on), HF GPT-2 (dropout on), Llama and the BatchNorm CNN, profiled with
fake tensors and planned by slackswap at 0.3/0.5/0.7 of the keep-all peak, `verify --compile`
(`run/verify_compiled.py`, 3 AdamW steps against eager) with backend aot_eager at every
budget and inductor at the budgets given by --inductor. Writes
benchmarks/results/compiled_check.json and .md.

    PYTHONPATH=$PWD python benchmarks/compiled_check.py [--inductor 0.5] [--models tiny_gpt,...]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="tiny_gpt,gpt2,llama,cnn")
    ap.add_argument("--budgets", default="0.3,0.5,0.7")
    ap.add_argument("--inductor", default="", help="budgets to run with inductor too")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "compiled_check"))
    a = ap.parse_args()
    from slackswap_cli.run.emit import apply_plan
    from slackswap_cli.run.verify_compiled import verify_compiled
    from workloads import ROOT as TROOT, SOURCES, plan_at
    from slackswap_cli.trace import profile_workload
    from workloads import HW
    tmp = Path(tempfile.mkdtemp())
    rows = []
    for name in a.models.split(","):
        path = TROOT / "examples" / "tiny_gpt.py" if name == "tiny_gpt" else tmp / f"{name}.py"
        if name != "tiny_gpt":
            path.write_text(SOURCES[name])
        prof = profile_workload(str(path), device="fake", hardware=HW)
        for frac in [float(x) for x in a.budgets.split(",")]:
            plan = plan_at(prof, frac * prof.summary["peak_activation_bytes"])
            mod = tmp / f"{name}_{frac}.py"
            mod.write_text(apply_plan(plan, prof))
            backends = ["aot_eager"] + (["inductor"] if str(frac) in a.inductor.split(",") else [])
            for backend in backends:
                r = verify_compiled(str(mod), backend=backend, steps=3)
                rows.append({"model": name, "budget": frac, **r})
                c, p = r["compiled"], r["plan"]
                print(f"{name:9} {frac:.1f} {backend:9} lined {c['lined_up_ops']}/{c['graph_ops']} "
                      f"saved {c['saved_bytes']} (not lined up {c['saved_bytes_not_lined_up']}) "
                      f"offloaded {c['offloaded_bytes']} recomputed {c['recomputed_ops']} | plan "
                      f"kept {p['kept_bytes']} swapped {p['swapped_bytes']} recomputed "
                      f"{p['recomputed_ops']} (lined up kept {p['lined_up_kept_bytes']} swapped "
                      f"{p['lined_up_swapped_bytes']}) | loss {r['max_loss_rel_diff']:.1e} "
                      f"param {r['max_param_rel_diff']:.1e} buffer {r['max_buffer_rel_diff']:.1e} "
                      f"passed {r['passed']}", flush=True)
    Path(a.out + ".json").write_text(json.dumps(rows, indent=1))
    lines = ["| model | budget | backend | lined up | saved B (not lined up) | offloaded B | "
             "recomputed | plan kept B | plan swapped B | plan recomputed | lined-up kept B | "
             "lined-up swapped B | max loss rel | max param rel | max buffer rel | passed |",
             "|" + "---|" * 16]
    for r in rows:
        c, p = r["compiled"], r["plan"]
        lines.append(f"| {r['model']} | {r['budget']} | {r['backend']} | {c['lined_up_ops']}/"
                     f"{c['graph_ops']} | {c['saved_bytes']} ({c['saved_bytes_not_lined_up']}) | "
                     f"{c['offloaded_bytes']} | {c['recomputed_ops']} | {p['kept_bytes']} | "
                     f"{p['swapped_bytes']} | {p['recomputed_ops']} | {p['lined_up_kept_bytes']} | "
                     f"{p['lined_up_swapped_bytes']} | {r['max_loss_rel_diff']:.1e} | "
                     f"{r['max_param_rel_diff']:.1e} | {r['max_buffer_rel_diff']:.1e} | "
                     f"{r['passed']} |")
    Path(a.out + ".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
