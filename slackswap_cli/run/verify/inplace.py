"""`verify`'s check of the model patched in place (`patch(model)`, what training runs): fresh
eager and patched models stepped side by side, their differences, how much of the profile lined
up, ops re-run and the bytes held for backward after forward.
"""
from __future__ import annotations

import torch

from ...schema import Action
from ...trace.joint import autocast_region, loss_from_output, split_inputs
from ...trace.workload import load_workload
from .steps import device_type, rel_diff


def check_in_place(mod, path, entry, args, dev, seed: int, steps: int, loss_tol: float,
                    grad_tol: float, autocast: str | None = None) -> dict:
    """`steps` SGD steps of a fresh eager model and of a fresh one patched in place, from the
    same seed: the largest loss and gradient differences, how much of the profile lined up,
    ops re-run and bytes held for backward after forward (CPU: storages, as `held_device_bytes`)."""
    models = []
    for _ in range(2):
        torch.manual_seed(seed)
        models.append(load_workload(path, entry, args, device=dev))
    eager, work = models
    work.model.load_state_dict(eager.model.state_dict())
    mod.patch(work.model)
    work.model.forward.__slackswap__.measure_held = True     # (later calls too)
    opts = [torch.optim.SGD(w.model.parameters(), lr=1e-3) for w in models]
    max_loss = max_grad = 0.0
    held = 0
    calls = []         # per patched call: `CallState.report` and what it held after forward
    for k in range(steps):
        losses, grads = [], []
        for w, opt in zip(models, opts):
            w.model.train()
            opt.zero_grad(set_to_none=True)
            torch.manual_seed(seed + 1 + k)
            a, kw = split_inputs(w.inputs)
            with autocast_region(autocast, device_type(w.model)):   # as the profile traced
                loss = loss_from_output(w.model(*a, **kw), w.inputs, w.loss_fn)
            if w is work:      # what the step holds for backward, measured before it runs
                held = work.model.forward.__slackswap__.last_run.held_device_bytes()
                calls.append({**work.model.forward.__slackswap__.last_report,
                              "held_device_bytes": held})
            loss.backward()
            losses.append(loss.detach())
            grads.append({n: p.grad for n, p in w.model.named_parameters()})
            with torch.no_grad():
                opt.step()
        max_loss = max(max_loss, rel_diff(*losses))
        max_grad = max([max_grad, *(rel_diff(g, grads[1][n]) for n, g in grads[0].items())])
    run = work.model.forward.__slackswap__.last_run
    reasons = []
    if max_loss > loss_tol or max_grad > grad_tol:
        reasons.append(f"the model patched in place differs from eager: loss by {max_loss:.2e}, "
                       f"gradients by {max_grad:.2e} (relative)")
    action = run.table.action
    return {"max_loss_rel_diff": max_loss, "max_grad_rel_diff": max_grad,
            "ops_lined_up": calls[-1]["lined_up"], "profile_forward_ops": calls[-1]["expected"],
            "guard_swaps": calls[-1]["guard_swaps"],
            "guard_swapped_bytes": calls[-1]["guard_swapped_bytes"], "calls": calls,
            "ops_rerun": run.rerun_ops, "roots_swapped": len(run.metas),
            "held_bytes_after_forward": held,
            "planned_recomputes": sum(1 for a in action.values() if a == Action.RECOMPUTE),
            "recomputes_kept": sum(1 for r, a in action.items()
                                   if a == Action.RECOMPUTE and run.usable.get(r) is False),
            "planned_swaps": sum(1 for a in action.values() if a == Action.SWAP),
            "reasons": reasons}
