"""compile_planned against plain torch.compile and eager, per backend (CPU).

For each model (tiny GPT with dropout, HF GPT-2 with dropout, HF Llama, the BatchNorm CNN;
`tests/workloads.py`), profiled with fake tensors and planned by slackswap at 0.5 of its
keep-all peak, trains 3 AdamW steps from the same weights and seeds five ways: eager,
`torch.compile` (inductor, `fallback_random`), `compile_planned` (inductor, `fallback_random`),
`compile_planned` with the keep-all plan (budget 1.0: every saved root MUST_SAVE, nothing
recomputed or offloaded) and `compile_planned` (aot_eager). For each pair it reports the
largest difference of the first step's gradients and of the parameters and buffers after 3
steps, measured by `verify_compiled.scaled_diff` (max|a-b| relative to the tensor's own
max|a|, with a floor of 1e-3 of the largest tensor of its kind in the model), with the tensor
it comes from, and the plain max|a-b|/max|a| beside it. Writes
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

KINDS = ("eager", "torch.compile", "compile_planned", "compile_planned keep-all",
         "compile_planned aot_eager")
PAIRS = (("eager", "torch.compile"), ("eager", "compile_planned"),
         ("torch.compile", "compile_planned"), ("torch.compile", "compile_planned keep-all"),
         ("eager", "compile_planned aot_eager"))


def _plain(xs, ys) -> float:
    return max([((x - y).abs().max() / x.abs().max().clamp_min(1e-12)).item()
                for x, y in zip(xs, ys)] or [0.0])


def _measure(a: dict, b: dict, kind: str) -> dict:
    from slackswap_cli.run.verify.compiled import scaled_diff
    value, at = scaled_diff(a[kind], b[kind])
    return {"scaled": value, "at": None if at is None or not value else a[kind + "_names"][at],
            "plain": _plain(a[kind], b[kind])}


def _train(kind, model, patched, work, steps=3):
    import torch

    from slackswap_cli.trace.joint import loss_from_output, split_inputs
    m = copy.deepcopy(model)
    opts = {"fallback_random": True}
    if kind == "torch.compile":
        f = torch.compile(m, backend="inductor", options=opts)
    elif kind in ("compile_planned", "compile_planned keep-all"):
        f = patched[kind].compile_planned(m, backend="inductor", options=opts, quiet=True)
    elif kind == "compile_planned aot_eager":
        f = patched["compile_planned"].compile_planned(m, backend="aot_eager", quiet=True)
    else:
        f = m
    a, kw = split_inputs(work.inputs)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    grads = []
    for s in range(steps):
        torch.manual_seed(100 + s)
        loss_from_output(f(*a, **kw), work.inputs, work.loss_fn).backward()
        if s == 0:
            grads = [(n, p.grad.clone()) for n, p in m.named_parameters() if p.grad is not None]
        opt.step()
        opt.zero_grad()
    params, buffers = list(m.named_parameters()), list(m.named_buffers())
    return {"grads": [g for _, g in grads], "grads_names": [n for n, _ in grads],
            "params": [p.detach().clone() for _, p in params],
            "params_names": [n for n, _ in params],
            "buffers": [b.detach().clone() for _, b in buffers if b.is_floating_point()],
            "buffers_names": [n for n, b in buffers if b.is_floating_point()]}


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(name: str, tmp: Path) -> list[dict]:
    from workloads import HW, SOURCES, plan_at

    from slackswap_cli.run.emit import apply_plan
    from slackswap_cli.trace import profile_workload
    from slackswap_cli.trace.workload import load_workload
    path = ROOT / "examples" / "tiny_gpt.py" if name == "tiny_gpt" else tmp / f"{name}.py"
    if name != "tiny_gpt":
        path.write_text(SOURCES[name])
    prof = profile_workload(str(path), device="fake", hardware=HW)
    patched = {}
    for kind, frac in (("compile_planned", 0.5), ("compile_planned keep-all", 1.0)):
        plan = plan_at(prof, frac * prof.summary["peak_activation_bytes"])
        mod_path = tmp / f"{name}_{frac}_patched.py"
        mod_path.write_text(apply_plan(plan, prof))
        patched[kind] = _load(mod_path, f"{name}_{int(frac * 10)}_patched")
    work = load_workload(str(path))
    got = {k: _train(k, work.model, patched, work) for k in KINDS}
    return [{"model": name, "a": a, "b": b,
             **{f"{kind}": _measure(got[a], got[b], kind)
                for kind in ("grads", "params", "buffers")}}
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
            print(f"{r['model']:9} {r['a']:>14} vs {r['b']:<26} " + " ".join(
                f"{k} {r[k]['scaled']:.1e} ({r[k]['at']}; plain {r[k]['plain']:.1e})"
                for k in ("grads", "params", "buffers")), flush=True)
    Path(args.out + ".json").write_text(json.dumps(rows, indent=1))
    lines = ["# compile_planned against torch.compile and eager (3 AdamW steps, CPU, budget 0.5)",
             "", "Largest difference per tensor, max|a-b| / max(max|a|, 1e-3 x the largest "
             "max|a| of its kind in the model) (`verify_compiled.scaled_diff`), the tensor it "
             "comes from, and the plain max|a-b| / max|a| in brackets. Inductor with "
             "`fallback_random`; `keep-all`: the plan at budget 1.0 (only MUST_SAVE tags). "
             "`python benchmarks/compiled_vs_compile.py`.", "",
             "| model | a | b | gradients, step 1 | parameters, step 3 | buffers, step 3 |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['a']} | {r['b']} | " + " | ".join(
        f"{r[k]['scaled']:.1e} {r[k]['at'] or ''} ({r[k]['plain']:.1e})"
        for k in ("grads", "params", "buffers")) + " |" for r in rows]
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
