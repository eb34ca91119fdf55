"""What plain `patch(model)` holds through backward on swap-heavy plans, against the
simulator's prediction: each swapped tensor's copy back issued where the plan's schedule
issued it (`chains.copy_back_pins`, the runtime's rule) and, for comparison, unpinned (the
runtime's rule before: every swapped tensor fetched as backward begins).

The tiny GPT of examples/tiny_gpt.py (dropout off), profiled fake:cpu and planned by slackswap
at the fitted op costs (KiB-sized ops at ~10 us a kernel: the plans swap what they do not
keep, and recompute little), patched in place, one training step measured op by op with
`run/verify/memtrace.py` (activation storages; the swap engine's host buffers and the parameters'
gradients left out), after a first call that records the plan. Per budget: the plan's
keep/swap/recompute counts, its predicted peak, and the measured forward and backward peaks
of each variant; the eager step's for scale.

    python benchmarks/copy_back_hold.py [--budgets 0.35,0.5,0.7]

Writes benchmarks/results/copy_back_hold.{json,md}.
"""
from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

OUT = ROOT / "benchmarks" / "results"


def _tiny_gpt():
    spec = importlib.util.spec_from_file_location("tiny_gpt", ROOT / "examples" / "tiny_gpt.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.workload(dropout=0.0)


def row(budget: float) -> dict:
    import slackswap_cli as slackswap
    from slackswap_cli.chains import runtime_table
    from slackswap_cli.run.api import Plan
    from slackswap_cli.run.verify.memtrace import step_peaks
    from slackswap_cli.trace.aten import is_inplace_target
    model, inputs = _tiny_gpt()
    eager = copy.deepcopy(model)
    plan = slackswap.plan_model(model, inputs, budget=budget, device="fake:cpu")
    unpinned = Plan(plan.profile, plan.plan, plan.meta,
                    runtime_table(plan.profile, plan.decisions, is_inplace_target),
                    plan.graph_table)
    out = {"budget": budget, "budget_bytes": plan.budget_bytes, **plan.actions(),
           "predicted_peak_bytes": plan.predicted.peak_bytes,
           "eager": dict(zip(("forward_peak", "backward_peak"), step_peaks(eager, inputs)))}
    for name, p in (("pinned", plan), ("unpinned", unpinned)):
        m = copy.deepcopy(eager)
        slackswap.patch(m, p)
        step_peaks(m, inputs)                    # the recording call
        out[name] = dict(zip(("forward_peak", "backward_peak"), step_peaks(m, inputs)))
    return out


def markdown(rows: list[dict]) -> str:
    lines = ["# Plain `patch`: bytes held through backward on swap-heavy plans", "",
             "`python benchmarks/copy_back_hold.py`: the tiny GPT of examples/tiny_gpt.py "
             "(dropout off), fake:cpu profile, fitted op costs, slackswap's plan, patched in "
             "place; activation bytes measured op by op (run/verify/memtrace.py) in the second patched "
             "step. pinned: copy backs issued where the plan's schedule issued them (the "
             "runtime's rule, chains.copy_back_pins); unpinned: every swapped tensor fetched as "
             "backward begins (the rule before).", "",
             "| budget | keep/swap/recompute | predicted peak | pinned fwd / bwd peak | "
             "unpinned fwd / bwd peak | eager fwd / bwd peak |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['budget']} ({r['budget_bytes']} B) | {r['keep']}/{r['swap']}/"
            f"{r['recompute']} | {r['predicted_peak_bytes']} | {r['pinned']['forward_peak']} "
            f"/ {r['pinned']['backward_peak']} | {r['unpinned']['forward_peak']} / "
            f"{r['unpinned']['backward_peak']} | {r['eager']['forward_peak']} / "
            f"{r['eager']['backward_peak']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budgets", default="0.35,0.5,0.7")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    import torch
    torch.set_num_threads(1)
    rows = [row(float(b)) for b in args.budgets.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "copy_back_hold.json").write_text(json.dumps(
        {"torch": torch.__version__, "rows": rows}, indent=1) + "\n")
    (out / "copy_back_hold.md").write_text(markdown(rows))
    print(markdown(rows))


if __name__ == "__main__":
    main()
