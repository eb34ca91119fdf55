"""compile_planned against plain torch.compile and eager, per backend (issue 20, item 3; CPU).

For each model (tiny GPT with dropout, HF GPT-2 with dropout, HF Llama, the BatchNorm CNN;
`tests/workloads.py`), profiled with fake tensors and planned by slackswap at 0.5 of its
keep-all peak, trains 3 AdamW steps from the same weights and seeds four ways: eager,
`torch.compile` (inductor, `fallback_random`), `compile_planned` (inductor, `fallback_random`)
and `compile_planned` (aot_eager). It reports the largest relative difference (max |a-b| /
max |a| per tensor, the largest over tensors) of the first step's gradients and of the
parameters and buffers after 3 steps, for each pair. Writes
benchmarks/results/compiled_vs_compile.{json,md}.

    python benchmarks/compiled_vs_compile.py [--models tiny_gpt,gpt2,llama,cnn]
"""
from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

KINDS = ("eager", "torch.compile", "compile_planned", "compile_planned aot_eager")
PAIRS = (("eager", "torch.compile"), ("eager", "compile_planned"),
         ("torch.compile", "compile_planned"), ("eager", "compile_planned aot_eager"))


def _rel(a, b) -> float:
    a, b = a.detach().float(), b.detach().float()
    return ((a - b).abs().max() / a.abs().max().clamp_min(1e-12)).item()


def _largest(xs, ys) -> float:
    return max([_rel(x, y) for x, y in zip(xs, ys)] or [0.0])


def _train(kind, model, patched, work, steps=3):
    import torch
    from slackswap_cli.trace.joint import loss_from_output, split_inputs
    m = copy.deepcopy(model)
    opts = {"fallback_random": True}
    if kind == "torch.compile":
        f = torch.compile(m, backend="inductor", options=opts)
    elif kind == "compile_planned":
        f = patched.compile_planned(m, backend="inductor", options=opts)
    elif kind == "compile_planned aot_eager":
        f = patched.compile_planned(m, backend="aot_eager")
    else:
        f = m
    a, kw = split_inputs(work.inputs)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    grads = []
    for s in range(steps):
        torch.manual_seed(100 + s)
        loss_from_output(f(*a, **kw), work.inputs, work.loss_fn).backward()
        if s == 0:
            grads = [p.grad.clone() for p in m.parameters() if p.grad is not None]
        opt.step()
        opt.zero_grad()
    return {"grads": grads, "params": [p.detach().clone() for p in m.parameters()],
            "buffers": [b.detach().clone() for b in m.buffers()]}


def run(name: str, tmp: Path) -> list[dict]:
    from slackswap_cli.run.emit import apply_plan
    from slackswap_cli.trace import profile_workload
    from slackswap_cli.trace.workload import load_workload
    from workloads import HW, SOURCES, plan_at
    path = ROOT / "examples" / "tiny_gpt.py" if name == "tiny_gpt" else tmp / f"{name}.py"
    if name != "tiny_gpt":
        path.write_text(SOURCES[name])
    prof = profile_workload(str(path), device="fake", hardware=HW)
    plan = plan_at(prof, 0.5 * prof.summary["peak_activation_bytes"])
    mod_path = tmp / f"{name}_patched.py"
    mod_path.write_text(apply_plan(plan, prof))
    spec = importlib.util.spec_from_file_location(f"{name}_patched", mod_path)
    patched = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(patched)
    work = load_workload(str(path))
    got = {k: _train(k, work.model, patched, work) for k in KINDS}
    return [{"model": name, "a": a, "b": b,
             "grads_step1": _largest(got[a]["grads"], got[b]["grads"]),
             "params_step3": _largest(got[a]["params"], got[b]["params"]),
             "buffers_step3": _largest(got[a]["buffers"], got[b]["buffers"])}
            for a, b in PAIRS]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="tiny_gpt,gpt2,llama,cnn")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "compiled_vs_compile"))
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    rows = []
    for name in args.models.split(","):
        rows += run(name, tmp)
        for r in rows[-len(PAIRS):]:
            print(f"{r['model']:9} {r['a']:>14} vs {r['b']:<26} grads {r['grads_step1']:.1e} "
                  f"params {r['params_step3']:.1e} buffers {r['buffers_step3']:.1e}", flush=True)
    Path(args.out + ".json").write_text(json.dumps(rows, indent=1))
    lines = ["# compile_planned against torch.compile and eager (3 AdamW steps, CPU, budget 0.5)",
             "", "Largest relative difference (max |a-b| / max |a| per tensor). Inductor with "
             "`fallback_random`. `python benchmarks/compiled_vs_compile.py`.", "",
             "| model | a | b | gradients, step 1 | parameters, step 3 | buffers, step 3 |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['a']} | {r['b']} | {r['grads_step1']:.1e} | "
              f"{r['params_step3']:.1e} | {r['buffers_step3']:.1e} |" for r in rows]
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
