"""How well the simulator's memory predictions hold on real executions.

For each model (small configurations of the shipped examples: our tiny GPT, Hugging Face GPT-2,
BERT and Llama, and a BatchNorm CNN) and each budget, this profiles the step with fake tensors
on the `a100-pcie4` roofline, plans it with `slackswap`, applies the plan, and runs
`verify` (CPU here, CUDA where present), which measures activation memory op by op
(`run/verify/memtrace.py`) and aligns it with the simulator's timeline. Per row:

- `predicted_peak_bytes`: the plan's own prediction (its hardware, copies taking PCIe time);
- `predicted_device_peak_bytes`: the same decisions re-simulated with copies as this device
  makes them (CPU: synchronous), the like-for-like prediction for the run;
- `measured_peak_bytes`: the patched step's measured activation peak, and their ratio;
- `worst_divergence`: the op where the run held the most more than predicted, and the live
  tensors there that the profile says were already dead;
- the eager step's measured peak against the profile's keep-all peak;
- on CUDA: measured vs predicted step time.

Writes `<out>/fidelity.json` and `<out>/fidelity.md`.

`--step-time` measures instead how well the simulator predicts the step time
`patch(model)` costs over eager on this CPU: the tiny GPT and Llama of
`benchmarks/cpu_timing.py` (larger than the ones above, so ops outweigh Python), profiled with
`--device cpu` (each op timed here) on a hardware file of this CPU whose host link is at its
minimum, so the plans only keep and recompute; at each budget the predicted slowdown (the
plan's simulated step over the keep-all step) against the measured one (patched step over
eager step: thread CPU time, one thread, paired interleaved rounds, order rotated; median and
quartiles of the per-round ratio). It writes its rows under `step_time` in fidelity.json and
its own section of fidelity.md, and leaves the memory rows as they are (a run without the flag
keeps the step-time rows it finds).

    python benchmarks/fidelity.py [--models tiny-gpt,gpt2,...] [--budgets 0.3,0.5,0.7]
    python benchmarks/fidelity.py --step-time [--models tiny-gpt,llama] [--rounds 30] [--quick]
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
if str(ROOT / "benchmarks") not in sys.path:
    sys.path.insert(0, str(ROOT / "benchmarks"))

import orjson  # noqa: E402

from slackswap_cli.hardware import PRESETS  # noqa: E402
from slackswap_cli.planners import make_plan  # noqa: E402
from slackswap_cli.run.emit import apply_plan  # noqa: E402
from slackswap_cli.schema import dumps, write_atomic  # noqa: E402

EX = ROOT / "examples"
# small configurations: each runs a step on a CPU in well under a second
MODELS = {
    "tiny-gpt": (EX / "tiny_gpt.py", {}),
    "gpt2": (EX / "gpt2_xl.py", dict(n_layer=2, n_embd=64, n_head=4, seq=32, batch=2, vocab=256,
                                      dtype="float32")),
    "bert": (EX / "bert_large.py", dict(n_layer=2, hidden=64, n_head=4, seq=32, batch=2,
                                        vocab=256, dtype="float32")),
    "llama": (EX / "llama_7b.py", dict(n_layer=2, hidden=64, n_head=4, intermediate=128,
                                       vocab=256, seq=32, batch=2, dtype="float32")),
    "bn-cnn": (EX / "resnet50.py", dict(depths=(1, 1), widths=(32, 64), embedding=16, image=32,
                                        batch=4, classes=10, dtype="float32")),
}
BUDGETS = (0.3, 0.5, 0.7)
HW = PRESETS["a100-pcie4"]


def run_one(name: str, fraction: float, prof, tmp: Path, device: str) -> dict:
    from slackswap_cli.run.verify.verify import verify
    path, _ = MODELS[name]
    peak = prof.summary["peak_activation_bytes"]
    budget = int(peak * fraction)
    plan = make_plan("slackswap", prof, HW, budget, fraction)
    prof_path = tmp / f"{name}.profile.json"
    plan = dataclasses.replace(plan, profile_path=str(prof_path), model_path=str(path))
    patched = tmp / f"{name}_{fraction}.py"
    patched.write_text(apply_plan(plan, prof))
    t0 = time.perf_counter()
    r = verify(str(patched), steps=3, check_trace=False, plan=plan)
    row = {
        "model": name, "budget_fraction": fraction, "budget_bytes": budget,
        "feasible": plan.feasible, "keep_all_peak_bytes": peak,
        "predicted_peak_bytes": r.predicted_peak_bytes,
        "predicted_device_peak_bytes": r.predicted_device_peak_bytes,
        "measured_peak_bytes": r.measured_peak_bytes,
        "measured_over_predicted": r.measured_peak_bytes / r.predicted_device_peak_bytes
        if r.predicted_device_peak_bytes else None,
        "measured_over_budget": r.measured_peak_bytes / budget if budget else None,
        "measured_peak_at": r.measured_peak_at,
        "timeline_matched": r.timeline_matched, "timeline_tasks": r.timeline_tasks,
        "max_abs_divergence_bytes": max((abs(x["measured_bytes"] - x["predicted_device_bytes"])
                                         for x in r.timeline
                                         if x["predicted_device_bytes"] is not None), default=0),
        "worst_divergence": r.worst_divergence,
        "eager_measured_peak_bytes": r.measured_original_peak_bytes,
        "eager_predicted_peak_bytes": r.predicted_original_peak_bytes,
        "verify_passed": r.passed, "reasons": r.reasons,
        "kept": r.kept, "swapped": r.swapped, "recomputed": r.recomputed,
        "recompute_ops_predicted": r.predicted_recompute_ops,
        "recompute_ops_measured": r.measured_recompute_ops,
        "extra_step_ms": r.extra_step_ms, "predicted_recompute_us": r.predicted_recompute_us,
        "verify_s": time.perf_counter() - t0,
    }
    if device == "cuda":
        row["measured_step_ms"] = r.patched_step_ms
        row["predicted_step_us"] = r.predicted_step_us
        row["cuda_max_allocated_bytes"] = r.patched_peak_bytes
    return row


def table(rows: list[dict]) -> str:
    lines = ["| model | budget | feasible | predicted (plan) | "
             "predicted (device copies) | measured | measured / predicted | measured / budget | "
             "worst excess at | ops re-run: predicted / measured | eager measured / keep-all |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['budget_fraction']} | "
                         f"error: {r['error'][:80]} | | | | | | | | |")
            continue
        w = r["worst_divergence"] or {}
        excess = w.get("excess_bytes", 0)
        where = (f"{excess / 1024:+.1f} KiB at op {w.get('op')} ({w.get('name')}"
                 f"{', recompute' if w.get('recompute') else ''})" if excess > 0 else "none")
        eager = (f"{r['eager_measured_peak_bytes'] / r['eager_predicted_peak_bytes']:.3f}"
                 if r["eager_predicted_peak_bytes"] else "-")
        lines.append(
            f"| {r['model']} | {r['budget_fraction']} | "
            f"{'yes' if r['feasible'] else 'no'} | "
            f"{r['predicted_peak_bytes'] / 1024:.1f} KiB | "
            f"{r['predicted_device_peak_bytes'] / 1024:.1f} KiB | "
            f"{r['measured_peak_bytes'] / 1024:.1f} KiB | {r['measured_over_predicted']:.3f} | "
            f"{r['measured_over_budget']:.3f} | {where} | "
            f"{r['recompute_ops_predicted']} / {r['recompute_ops_measured']} | {eager} |")
    return "\n".join(lines)


def step_time(models: list[str], budgets, rounds: int, calls: int, quick: bool,
              out: Path) -> dict:
    """Predicted vs measured slowdown of `patch(model)` over eager on this CPU (see the module
    docstring, `--step-time`)."""
    import copy

    import cpu_timing as ct
    import torch

    from slackswap_cli.trace.workload import load_workload
    ct.one_thread()
    hw = ct.cpu_hardware()
    configs = ct.QUICK if quick else ct.MODELS
    res = {"torch": torch.__version__, "quick": quick, "rounds": rounds, "calls": calls,
           "hardware": hw.to_dict(), "planner": "slackswap", "models": []}
    with tempfile.TemporaryDirectory() as d:
        for name in models:
            path, args = configs[name]
            t0 = time.perf_counter()
            prof, plans = ct.profile_and_plan(path, args, hw, budgets)
            work = load_workload(str(path), args=dict(args))
            eager = copy.deepcopy(work.model)
            again = copy.deepcopy(work.model)      # the A/A control: eager against eager
            steps = {"eager": ct.stepper(eager, eager, work),
                     "eager again": ct.stepper(again, again, work)}
            for b in budgets:
                mod = ct.load_patched(plans[b], prof, Path(d) / f"{name}_{b}.py",
                                      f"st_{name.replace('-', '_')}_{int(b * 100)}")
                model = mod.patch(copy.deepcopy(work.model))
                steps[f"patch {b}"] = ct.stepper(model, model, work)
            times = ct.paired(steps, rounds, calls=calls)
            # the reference: both eager copies of each round (halves the reference's noise)
            both = [(x + y) / 2 for x, y in zip(times["eager"], times["eager again"])]
            rows = []
            for b in budgets:
                p, mine = plans[b], times[f"patch {b}"]
                extra = sorted((x - y) / calls for x, y in zip(mine, both))
                rows.append({
                    "budget_fraction": b, "budget_bytes": p.budget_bytes,
                    "feasible": p.feasible,
                    "recomputed": sum(d.action == "recompute" for d in p.decisions),
                    "swapped": sum(d.action == "swap" for d in p.decisions),
                    "predicted_slowdown": p.predicted.step_us / p.predicted.ideal_us,
                    "measured_slowdown": ct.ratio_stats(mine, times["eager"]),
                    "measured_slowdown_both": ct.ratio_stats(mine, both),
                    "predicted_extra_ms": (p.predicted.step_us - p.predicted.ideal_us) / 1e3,
                    "measured_extra_ms": 1e3 * extra[len(extra) // 2],
                    "unexplained_us_per_forward_op": (1e3 * extra[len(extra) // 2]
                                                      - (p.predicted.step_us
                                                         - p.predicted.ideal_us) / 1e3)
                    * 1e3 / prof.n_forward,
                })
                if rows[-1]["swapped"]:
                    # a swap over a 1e3 B/s link: keep the profile that led there
                    saved = Path(out) / f"fidelity_step_time_{name}.profile.json"
                    write_atomic(saved, dumps(prof.to_dict()))
                    rows[-1]["profile_saved_to"] = str(saved.relative_to(ROOT)) \
                        if saved.is_relative_to(ROOT) else str(saved)
            res["models"].append({
                "model": name, "args": args, "n_ops": prof.summary["n_ops"],
                "n_forward_ops": prof.n_forward,
                "keep_all_peak_bytes": prof.summary["peak_activation_bytes"],
                "profile_op_sum_ms": prof.summary["op_sum_us"] / 1e3,
                "profile_step_ms": prof.summary["measured_step_us"] / 1e3,
                "eager_step_ms": 1e3 * sorted(times["eager"])[rounds // 2] / calls,
                "a_a": ct.ratio_stats(times["eager again"], times["eager"]),
                "times_s": times,
                "seconds": round(time.perf_counter() - t0, 1), "rows": rows})
            m = res["models"][-1]
            print(f"{name}: eager {m['eager_step_ms']:.1f} ms (profile: ops "
                  f"{m['profile_op_sum_ms']:.1f} ms, step {m['profile_step_ms']:.1f} ms)",
                  flush=True)
            for r in rows:
                print(f"  {r['budget_fraction']}: predicted {r['predicted_slowdown']:.3f}, "
                      f"measured {ct.fmt_ratio(r['measured_slowdown'])} (over both eager "
                      f"copies {ct.fmt_ratio(r['measured_slowdown_both'])}); extra ms predicted "
                      f"{r['predicted_extra_ms']:.1f}, measured {r['measured_extra_ms']:.1f}",
                      flush=True)
    return res


def step_time_md(res: dict) -> str:
    import cpu_timing as ct
    lines = ["", "## Step time: predicted vs measured slowdown of `patch(model)` over eager", "",
             "`python benchmarks/fidelity.py --step-time" + (" --quick" if res["quick"] else "")
             + f"` (torch {res['torch']}): `--device cpu` profiles (each op timed on this CPU) "
             f"on a hardware file of this CPU ({res['hardware']['name']}) whose host link is "
             "at its minimum, so the plans keep and recompute only; slackswap's plans. "
             f"Thread CPU time of {res.get('calls', 1)} training step(s) per variant a round, "
             f"one thread, {res['rounds']} paired interleaved rounds (order rotated): median "
             "[quartiles] of the per-round ratio patched / eager, over the first eager copy "
             "and over the mean of both eager copies of the round (the A/A control below). "
             "Predicted: the plan's simulated step over the keep-all step. Extra ms: the step "
             "time the plan adds, predicted (the simulated recompute) and measured (median of "
             "patched - eager per step and round, both eager copies).", "",
             "Unexplained: measured minus predicted extra time per forward op.", "",
             "| model | budget | recomputed roots | predicted | measured | over both eager "
             "copies | predicted - measured (points) | extra ms: predicted / measured | "
             "unexplained us / forward op |", "|---|---|---|---|---|---|---|---|---|"]
    for m in res["models"]:
        for r in m["rows"]:
            ref = r.get("measured_slowdown_both", r["measured_slowdown"])
            both = ct.fmt_ratio(ref) if "measured_slowdown_both" in r else "-"
            gap = 100 * (r["predicted_slowdown"] - ref["median"])
            lines.append(f"| {m['model']} | {r['budget_fraction']} | {r['recomputed']} | "
                         f"{r['predicted_slowdown']:.3f} | {ct.fmt_ratio(r['measured_slowdown'])}"
                         f" | {both} | {gap:+.1f} | {r['predicted_extra_ms']:.1f} / "
                         f"{r['measured_extra_ms']:.1f} | "
                         f"{r['unexplained_us_per_forward_op']:.1f} |"
                         + (f" (swaps {r['swapped']}: {r['profile_saved_to']})"
                            if r.get("swapped") else ""))
    lines += ["", "A/A (eager against a second eager copy, the same rounds): " + "; ".join(
        f"{m['model']} {ct.fmt_ratio(m['a_a'])}" for m in res["models"] if "a_a" in m)
        + ": the spread two identical steps show on this machine."]
    lines += ["", "Models: " + "; ".join(
        f"{m['model']} {m['args']} ({m['n_ops']} ops; eager step {m['eager_step_ms']:.1f} ms "
        f"measured here, the profile's op times sum to {m['profile_op_sum_ms']:.1f} ms)"
        for m in res["models"]) + "."]
    return "\n".join(lines) + "\n"


def _previous(out: Path) -> dict:
    try:
        return orjson.loads((out / "fidelity.json").read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return {}


def _memory_md(md: str) -> str:
    """The memory part of a fidelity.md (all of it before the step-time section)."""
    return md.split("\n## Step time:")[0].rstrip("\n") + "\n"


def main_step_time(a) -> int:
    import cpu_timing as ct
    models = a.models.split(",") if a.models else list(ct.MODELS)
    budgets = (0.5,) if a.quick else tuple(float(x) for x in a.budgets.split(","))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    res = step_time(models, budgets, 3 if a.quick else a.rounds, 1 if a.quick else a.calls,
                    a.quick, out)
    data = {**_previous(out), "step_time": res}
    write_atomic(out / "fidelity.json", orjson.dumps(data, option=orjson.OPT_INDENT_2))
    try:
        md = _memory_md((out / "fidelity.md").read_text())
    except OSError:
        md = ""
    write_atomic(out / "fidelity.md", (md + step_time_md(res)).encode())
    print(step_time_md(res))
    print(f"wrote {out / 'fidelity.json'} and {out / 'fidelity.md'}")
    return 0


def main(argv=None) -> int:
    import torch

    from slackswap_cli.trace import profile_workload
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=None,
                    help=f"default: {','.join(MODELS)}; with --step-time: tiny-gpt,llama")
    ap.add_argument("--budgets", default=",".join(str(b) for b in BUDGETS))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--step-time", action="store_true",
                    help="predicted vs measured slowdown of patch(model) over eager on this CPU")
    ap.add_argument("--rounds", type=int, default=30, help="--step-time: paired rounds")
    ap.add_argument("--calls", type=int, default=2,
                    help="--step-time: training steps per variant a round")
    ap.add_argument("--quick", action="store_true",
                    help="--step-time: small models, budget 0.5, 3 rounds (a smoke run)")
    a = ap.parse_args(argv)
    if a.step_time:
        return main_step_time(a)
    a.models = a.models or ",".join(MODELS)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for name in a.models.split(","):
            path, args = MODELS[name]
            prof = profile_workload(str(path), args=dict(args), device="fake", hardware=HW)
            write_atomic(tmp / f"{name}.profile.json", dumps(prof.to_dict()))
            for b in (float(x) for x in a.budgets.split(",")):
                try:
                    row = run_one(name, b, prof, tmp, device)
                except Exception as exc:
                    row = {"model": name, "budget_fraction": b,
                           "error": f"{type(exc).__name__}: {exc}"}
                rows.append(row)
                print(table([row]).splitlines()[-1], flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"device": device, "torch": torch.__version__, "hardware": HW.name,
            "planner": "slackswap", "profile": "--device fake (a100-pcie4 roofline)"}
    kept = {k: v for k, v in _previous(out).items() if k == "step_time"}
    write_atomic(out / "fidelity.json", orjson.dumps({"meta": meta, "rows": rows, **kept},
                                                     option=orjson.OPT_INDENT_2))
    md = (f"# Memory fidelity: simulator vs measured ({device}, torch {torch.__version__})\n\n"
          "Activation memory = live activation storages (views once; parameters, inputs, "
          "buffers, gradients out), measured op by op with `slackswap_cli/run/verify/memtrace.py`. "
          "`predicted (device copies)` re-simulates the plan with copies as this device makes "
          "them (CPU: synchronous), the like-for-like figure; `predicted (plan)` is the plan's "
          "own (copies over a100-pcie4 PCIe). `ops re-run`: "
          "recompute tasks in the simulator's schedule vs recompute calls the patched module "
          "made.\n\n" + table(rows) + "\n")
    if kept:
        md += step_time_md(kept["step_time"])
    write_atomic(out / "fidelity.md", md.encode())
    print(f"wrote {out / 'fidelity.json'} and {out / 'fidelity.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
