"""What a plan counts for a timm model with its own gradient checkpointing
(`model.set_grad_checkpointing(True)`), against what its eager step holds after forward.

Per model, with checkpointing off, then on: the profile's keep-all peak (the budget's base)
and saved bytes, the bytes the eager step holds after forward (every storage its forward's
ops made that is still alive: measured apart from slackswap's count), the plan at 0.5 (or
the planner's first feasible budget), and the patched run's bytes held after forward over
the budget, bitwise against eager, `recorded` per call.

    python benchmarks/own_checkpointing.py           # writes benchmarks/results/own_checkpointing.md

Ops priced as in the zoo (slackswap_testkit/small_costs.py); planner recompute-only (no
swaps: on a CPU a swap's host copy would count as held).
"""
from __future__ import annotations

import copy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MODELS = (("resnet10t", 64), ("vit_tiny_patch16_224", 32))
PLANNER = "recompute-only"


def _step(model, x):
    from slackswap_testkit.alive import AliveStorages
    mode = AliveStorages()
    with mode:
        out = model(x)
    held = mode.held(out, model, x)
    out.pow(2).mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return held, grads


def row(name: str, side: int, on: bool) -> dict:
    import timm
    import torch

    import slackswap_cli as slackswap
    from slackswap_cli.budget import first_feasible_budget
    from slackswap_cli.errors import InfeasibleError
    from slackswap_cli.hardware import load_hardware
    from slackswap_testkit.small_costs import small_model_costs
    torch.manual_seed(0)
    kw = {"img_size": side, "depth": 4} if name.startswith("vit") else {}
    model = timm.create_model(name, pretrained=False, num_classes=4, **kw)
    model.set_grad_checkpointing(on)
    x = torch.randn(2, 3, side, side)
    twin = copy.deepcopy(model)
    opts = dict(loss_fn=lambda o, i: o.pow(2).mean(), device="fake:cpu", planner=PLANNER)
    with small_model_costs():
        try:
            plan = slackswap.plan_model(model, (x,), budget=0.5, **opts)
        except InfeasibleError as exc:
            first = first_feasible_budget(exc.plan.profile, load_hardware(None), PLANNER)
            plan = slackswap.plan_model(model, (x,), budget=int(first), **opts)
    eager_held = _step(copy.deepcopy(model), x)[0]
    slackswap.patch(model, plan)
    state = model.forward.__slackswap__
    same, ratios, recorded = True, [], []
    for k in range(3):
        torch.manual_seed(k)
        _, want = _step(twin, x)
        torch.manual_seed(k)
        held, got = _step(model, x)
        same = same and all(torch.equal(a, b) for a, b in zip(want, got))
        ratios.append(held / state.last_report["budget_bytes"])
        recorded.append(state.last_report["recorded"])
    prof = plan.profile
    return {"model": name, "checkpointing": on, "keep_all": prof.keep_all_peak_bytes,
            "saved": prof.summary["saved_bytes"], "eager_held": eager_held,
            "budget": plan.plan.budget_bytes, "actions": plan.actions(),
            "held_over_budget": max(ratios), "bitwise": same, "recorded": recorded}


def main() -> int:
    import torch
    torch.set_num_threads(1)
    lines = ["| model | own checkpointing | keep-all peak | profile saved | eager holds after "
             "forward | budget | keep/swap/recompute | patched held / budget | bitwise | "
             "recorded |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, side in MODELS:
        for on in (False, True):
            r = row(name, side, on)
            a = r["actions"]
            lines.append(f"| {name} ({side}x{side}) | {'on' if on else 'off'} | {r['keep_all']} "
                         f"| {r['saved']} | {r['eager_held']} | {r['budget']} | "
                         f"{a['keep']}/{a['swap']}/{a['recompute']} | "
                         f"{r['held_over_budget']:.3f} | {r['bitwise']} | {r['recorded']} |")
            print(lines[-1], flush=True)
    out = ROOT / "benchmarks" / "results" / "own_checkpointing.md"
    out.write_text("# A model's own checkpointing, planned for what it holds\n\n"
                   "`python benchmarks/own_checkpointing.py` (planner recompute-only, ops "
                   "priced as in the zoo; bytes).\n\n" + "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
