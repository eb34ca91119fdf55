"""Does plain `plan_model` + `patch` meet its budget when the step is measured? Before: the
plan as the simulator judges it (`measure=False`); after: `plan_model`'s default on a real
trace, which runs the plan once on the model and plans again below the budget by what eager
held beyond the simulator where the measured step does not fit (run/verify/excess.py).

Models: the tiny GPT of examples/tiny_gpt.py (dropout off; the plans swap what they do not
keep at the fitted op costs), and three of the zoo's (benchmarks/zoo_models.py: dropout on):
Hugging Face Llama (causal-lm/llama) and two timm models (deit_tiny_patch16_224,
resnetv2_18). Each is profiled on the CPU (`device="cpu"`, op times measured here) at each
budget and planned by slackswap. Per plan: keep/swap/recompute counts, its predicted peak,
and the forward and backward activation peaks of its second patched step on a deep copy of
the model, measured op by op here (run/verify/memtrace.py: activation storages; gradients and the
swap engine's host buffers left out), apart from plan_model's own measurement; with the
after-plan, what plan_model measured (its first plan's measured peak, rounds) and the CPU
seconds each plan_model call took.

    python benchmarks/measured_budget.py [--models tiny-gpt,llama,...] [--budgets 0.4,0.5]

Writes benchmarks/results/measured_budget.{json,md}.
"""
from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

OUT = ROOT / "benchmarks" / "results"
MODELS = {"tiny-gpt": None, "llama": ("transformers", "causal-lm/llama"),
          "deit": ("timm", "deit_tiny_patch16_224"), "resnetv2": ("timm", "resnetv2_18")}
# the floors: Llama 0.36, resnetv2_18 0.47 of the keep-all peak
BUDGETS = {"tiny-gpt": "0.35,0.5", "llama": "0.4,0.5", "deit": "0.4,0.5", "resnetv2": "0.5,0.6"}


def _build(name: str):
    """(model, inputs, loss_fn)."""
    if MODELS[name] is None:
        spec = importlib.util.spec_from_file_location("tiny_gpt", ROOT / "examples" /
                                                      "tiny_gpt.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        model, inputs = mod.workload(dropout=0.0)
        return model, inputs, None
    import zoo_models
    return zoo_models.build(*MODELS[name])


def peaks(model, inputs, loss_fn) -> tuple[int, int]:
    """(forward, backward) activation peaks of one training step (run/verify/memtrace.py), the
    parameters' gradients and the swap engine's host buffers left out."""
    from slackswap_cli.run import swap
    from slackswap_cli.run.verify.memtrace import SKIP, MemTracker, caller_line
    from slackswap_cli.trace.joint import loss_from_output, split_inputs
    tracker = MemTracker(caller_line({swap.HostPool.get.__code__: SKIP}, outside=None))
    a, kw = split_inputs(inputs)
    with tracker:
        loss = loss_from_output(model(*a, **kw), inputs, loss_fn)
        n_forward = len(tracker.samples)
        loss.backward()
        del loss
    tracker.finish()
    tracker.exclude([p.grad for p in model.parameters() if p.grad is not None])
    model.zero_grad(set_to_none=True)
    timeline = tracker.timeline()
    return max(timeline[:n_forward]), max(timeline[n_forward:])


def _run(model, plan, inputs, loss_fn) -> dict:
    import torch

    import slackswap_cli as slackswap
    m = copy.deepcopy(model)
    slackswap.patch(m, plan)
    torch.manual_seed(1)
    peaks(m, inputs, loss_fn)                       # the recording call
    torch.manual_seed(1)
    fwd, bwd = peaks(m, inputs, loss_fn)
    return {**plan.actions(), "predicted_peak_bytes": plan.predicted.peak_bytes,
            "forward_peak": fwd, "backward_peak": bwd}


def row(name: str, budget: float, device: str) -> dict:
    import slackswap_cli as slackswap
    model, inputs, loss_fn = _build(name)
    out = {"model": name, "budget": budget}
    for label, measure in (("before", False), ("after", None)):
        t = time.process_time()
        plan = slackswap.plan_model(model, inputs, budget=budget, device=device,
                                    loss_fn=loss_fn, measure=measure)
        seconds = time.process_time() - t
        out["budget_bytes"] = plan.budget_bytes
        out[label] = {**_run(model, plan, inputs, loss_fn), "plan_cpu_s": round(seconds, 2)}
        if plan.measured is not None:
            m = plan.measured
            out[label].update(first_measured=m.first_measured, planned_at=m.planned_at,
                              rounds=m.rounds, measured_by_plan_model=m.measured,
                              measuring_s=round(m.seconds, 2))
    return out


def _fits(r: dict, side: str) -> str:
    peak = max(r[side]["forward_peak"], r[side]["backward_peak"])
    return f"{peak / r['budget_bytes']:.3f}"


def markdown(rows: list[dict], device: str) -> str:
    lines = ["# plan_model's budget, measured: before and after its measuring step", "",
             "`python benchmarks/measured_budget.py`: each model profiled on the CPU "
             f"(`device={device!r}`), planned by slackswap; before: `measure=False`; after: "
             "plan_model's default (the plan run once on the model, planned again below the "
             "budget by the measured excess where the step does not fit). Peaks: activation "
             "bytes of the second patched step of a deep copy, measured op by op "
             "(run/verify/memtrace.py), apart from plan_model's own measurement. peak / budget: the "
             "larger of the forward and backward peaks over the budget. first measured: what "
             "plan_model measured of its first plan; rounds: plans it measured; measuring s: "
             "its wall seconds measuring and planning again (each round two patched steps, "
             "the first recording).", "",
             "| model | budget | before: k/s/r | predicted | fwd / bwd peak | peak / budget "
             "| after: k/s/r | predicted | fwd / bwd peak | peak / budget | first measured "
             "| planned at | rounds | measuring s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b, a = r["before"], r["after"]
        lines.append(
            f"| {r['model']} | {r['budget']} ({r['budget_bytes']} B) | {b['keep']}/{b['swap']}/"
            f"{b['recompute']} | {b['predicted_peak_bytes']} | {b['forward_peak']} / "
            f"{b['backward_peak']} | {_fits(r, 'before')} | "
            f"{a['keep']}/{a['swap']}/{a['recompute']} | {a['predicted_peak_bytes']} | "
            f"{a['forward_peak']} / {a['backward_peak']} | {_fits(r, 'after')} | "
            f"{a.get('first_measured', '-')} | {a.get('planned_at', '-')} | "
            f"{a.get('rounds', '-')} | {a.get('measuring_s', '-')} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--budgets", default=None, help="default: BUDGETS, per model")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    import torch
    torch.set_num_threads(1)
    rows = []
    for name in args.models.split(","):
        for b in (args.budgets or BUDGETS[name]).split(","):
            rows.append(row(name, float(b), args.device))
            print(json.dumps(rows[-1]), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "measured_budget.json").write_text(json.dumps(
        {"torch": torch.__version__, "device": args.device, "rows": rows}, indent=1) + "\n")
    (out / "measured_budget.md").write_text(markdown(rows, args.device))
    print(markdown(rows, args.device))


if __name__ == "__main__":
    main()
