"""What `slackswap_cli.check` costs, as a ratio to one eager training step of the whole batch.

For each model, planned with `plan_model(..., budget=0.5, device="fake:cpu")`, rounds of three
variants, interleaved (the order rotates by one each round, so each follows each other
equally often), each timed as this thread's CPU time on one thread (on one thread CPU
autograd runs backward on the calling thread, and CPU time is far less disturbed than wall
time by the other processes of a shared machine):

- eager: one forward + backward of the whole batch (`.backward()`, grads zeroed after);
- check, default slice: `check(model, plan, inputs)`, the first batch x 0.5 samples;
- check, whole batch: `check(..., samples=None)`;
- patched first call: `patch(model, plan)`, one step, `unpatch`: what the first training call
  of a patched model costs anyway (the recorder; for a library that branches otherwise under
  fake tensors, Hugging Face models, a trace along eager's branches and a re-plan), for scale.

The figure is the minimum over rounds of each, and the ratio min(variant) / min(eager). A check
is one eager step and one first patched call (the recorder: the patch's costliest call) on its
samples, plus the comparison; it runs once per training run.

    python benchmarks/check_cost.py [--rounds N]
    # writes benchmarks/results/check_cost.json and check_cost.md
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

LLAMA = '''
import torch
from transformers import LlamaConfig, LlamaForCausalLM
def workload(batch=8, seq=64, hidden=128, layers=2):
    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=2 * hidden, vocab_size=256,
                      max_position_embeddings=seq, use_cache=False, attention_dropout=0.1)
    ids = torch.randint(0, 256, (batch, seq))
    return LlamaForCausalLM(cfg), {"input_ids": ids, "labels": ids}
'''
CNN = '''
import torch
from torch import nn
class Net(nn.Module):
    def __init__(self, width, blocks):
        super().__init__()
        layers, c = [], 3
        for _ in range(blocks):
            layers += [nn.Conv2d(c, width, 3, padding=1), nn.BatchNorm2d(width), nn.GELU()]
            c = width
        self.body = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                  nn.Linear(width, 10))
    def forward(self, x, y):
        return nn.functional.cross_entropy(self.body(x), y)
def workload(batch=16, width=16, blocks=4, size=32):
    torch.manual_seed(0)
    return Net(width, blocks), (torch.randn(batch, 3, size, size), torch.randint(0, 10, (batch,)))
'''
CASES = [  # (label, workload source or path, args)
    ("tiny GPT (4 layers, d 128, seq 64, batch 16)", ROOT / "examples" / "tiny_gpt.py",
     {"n_layer": 4, "d_model": 128, "seq": 64, "batch": 16}),
    ("HF Llama (2 layers, hidden 128, seq 64, batch 8)", LLAMA, {}),
    ("CNN (4 conv-BatchNorm-GELU blocks, 32x32, batch 16)", CNN, {}),
]
VARIANTS = ["eager step, whole batch", "check, default slice", "check, whole batch",
            "patched first call, whole batch"]


def _load(source, args: dict, tmp: Path):
    from slackswap_cli.trace.workload import load_workload
    path = source
    if isinstance(source, str):
        path = tmp / f"w{abs(hash(source))}.py"
        path.write_text(source)
    return load_workload(str(path), args=args)


def _eager_step(work) -> None:
    from slackswap_cli.trace.joint import loss_from_output, split_inputs
    a, kw = split_inputs(work.inputs)
    loss_from_output(work.model(*a, **kw), work.inputs, work.loss_fn).backward()
    work.model.zero_grad(set_to_none=True)


def _first_call(work, plan) -> None:
    import slackswap_cli as slackswap
    slackswap.patch(work.model, plan)
    try:
        _eager_step(work)
    finally:
        slackswap.unpatch(work.model)


def _case(label: str, source, args: dict, rounds: int, tmp: Path) -> dict:
    import torch

    import slackswap_cli as slackswap
    work = _load(source, args, tmp)
    work.model.train()
    plan = slackswap.plan_model(work.model, work.inputs, budget=0.5, device="fake:cpu",
                                loss_fn=work.loss_fn)
    reports = {}
    runs = {
        VARIANTS[0]: lambda: _eager_step(work),
        VARIANTS[1]: lambda: reports.__setitem__(VARIANTS[1], slackswap.check(
            work.model, plan, work.inputs)),
        VARIANTS[2]: lambda: reports.__setitem__(VARIANTS[2], slackswap.check(
            work.model, plan, work.inputs, samples=None)),
        VARIANTS[3]: lambda: _first_call(work, plan),
    }
    for run in runs.values():      # warm-up
        run()
    times = {v: [] for v in VARIANTS}
    for r in range(rounds):
        order = VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]
        for v in order:
            torch.manual_seed(r)
            t0 = time.thread_time()
            runs[v]()
            times[v].append((time.thread_time() - t0) * 1e3)
    eager = min(times[VARIANTS[0]])
    out = {"label": label, "plan": plan.actions(), "eager_ms": round(eager, 2),
           "times_ms": {v: [round(t, 2) for t in ts] for v, ts in times.items()}}
    for v in VARIANTS[1:]:
        out[v] = {"min_ms": round(min(times[v]), 2), "ratio": round(min(times[v]) / eager, 2)}
        rep = reports.get(v)
        if rep is not None:
            out[v].update(samples=rep.samples, batch=rep.batch, ops_rerun=rep.ops_rerun,
                          roots_swapped=rep.roots_swapped, lined_up=round(rep.lined_up, 3))
    print(f"{label}: eager {eager:.1f} ms; " + "; ".join(
        f"{v} {out[v]['min_ms']:.1f} ms ({out[v]['ratio']:.2f}x)" for v in VARIANTS[1:]),
        flush=True)
    return out


def _markdown(results: list[dict], rounds: int, load: tuple) -> str:
    lines = [
        "What `slackswap_cli.check` costs against one eager training step of the whole batch "
        f"(forward + backward): minimum over {rounds} interleaved rounds of this thread's CPU "
        "time, one thread, plans at budget 0.5 from a `fake:cpu` profile "
        f"(`python benchmarks/check_cost.py --rounds {rounds}`). The default slice is the "
        "batch x the budget fraction (every model takes its labels as an input, so a slice cuts "
        f"them too). Load average at start "
        f"{load[0]}, at end {load[1]}.", "",
        "| model | plan (keep/swap/recompute) | eager step | check, default slice | "
        "check, whole batch | patched first call (for scale) |", "|---|---|---|---|---|---|"]
    for r in results:
        p = r["plan"]
        cells = []
        for v in VARIANTS[1:]:
            c = r[v]
            if "samples" not in c:
                cells.append(f"{c['min_ms']:.1f} ms = {c['ratio']:.2f}x")
                continue
            cells.append(f"{c['min_ms']:.1f} ms = **{c['ratio']:.2f}x** ({c['samples']} of "
                         f"{c['batch']} samples; {c['ops_rerun']} ops re-run, "
                         f"{c['roots_swapped']} swapped)")
        lines.append(f"| {r['label']} | {p.get('keep', 0)}/{p.get('swap', 0)}/"
                     f"{p.get('recompute', 0)} | {r['eager_ms']:.1f} ms | " + " | ".join(cells)
                     + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    import torch
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=9)
    opts = ap.parse_args()
    torch.set_num_threads(1)
    start = " ".join(f"{x:.2f}" for x in os.getloadavg())
    with tempfile.TemporaryDirectory() as tmp:
        results = [_case(label, src, args, opts.rounds, Path(tmp)) for label, src, args in CASES]
    end = " ".join(f"{x:.2f}" for x in os.getloadavg())
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "check_cost.json").write_text(json.dumps(
        {"rounds": opts.rounds, "torch": torch.__version__, "load_start": start,
         "load_end": end, "cases": results}, indent=1) + "\n")
    (out / "check_cost.md").write_text(_markdown(results, opts.rounds, (start, end)))
    print(f"wrote {out / 'check_cost.json'} and {out / 'check_cost.md'}")


if __name__ == "__main__":
    main()
