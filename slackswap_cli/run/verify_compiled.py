"""`slackswap verify patched.py --compile`: does the compiled graph carry the plan out?

Two copies of the workload from the same weights: one eager, one through the patched module's
`compile_planned` (backend inductor or aot_eager). `steps` AdamW steps from the same seed
compare losses and gradients (aot_eager runs the same aten ops: bitwise; inductor fuses and
reorders: within the fp32 tolerance, and runs with `fallback_random` so that dropout draws
eager's random numbers). The partition function's reports give what the
partitioned forward and backward graphs do:

- `compiled.saved_bytes`: activation bytes the forward graph returns for backward on the
  device (storages counted once; parameters and inputs are not activations);
- `compiled.offloaded_bytes`: bytes of the saved values offloaded to the host;
- `compiled.recomputed_ops`: forward ops of the plan's recompute chains that the backward
  graph re-runs (others it re-runs are `unplanned_recomputes`: views and cheap ops the
  partitioner recomputes on its own, or ops that did not line up);
- `compiled.lined_up_ops` of `compiled.graph_ops`: forward ops that lined up with the profile.

and the plan's `kept_bytes`, `swapped_bytes` and `recomputed_ops` beside them. Only what lines
up can carry the plan out, so the checks compare with the plan's bytes of the roots whose ops
lined up (`plan.lined_up_kept_bytes`, `plan.lined_up_swapped_bytes`): saved plus offloaded
within 2% of kept plus swapped; offloaded equal to swapped; recomputed ops within the chains.
"""
from __future__ import annotations

from ..errors import InputError

BYTES_TOLERANCE = 0.02


def verify_compiled(patched_path: str, model_path: str | None = None, *,
                    backend: str = "inductor", steps: int = 1, seed: int = 0) -> dict:
    """Compile the workload with its plan and compare it with eager and with the plan (see the
    module docstring); returns the report as plain values (`passed`, `reasons`)."""
    import torch

    from ..trace.workload import load_workload
    from .compiled import totals
    from .emit import load_patched
    from .verify import _tolerances
    mod = load_patched(patched_path)
    table = getattr(mod, "GRAPH_TABLE", None)
    if table is None:
        raise InputError(f"{patched_path} was written before `apply` wrote the graph table",
                         hint="run `slackswap apply` again to get a module with compile_planned")
    meta = mod.META
    if meta["device_type"] == "cuda" and not torch.cuda.is_available():
        raise InputError("the patched module was made for CUDA, but no GPU is visible",
                         hint="run verify on the machine the profile was made on")
    w = meta["workload"]
    dev = None if meta["device_type"] == "cpu" else meta["device_type"]
    models = []
    for _ in range(2):
        torch.manual_seed(seed)
        models.append(load_workload(model_path or w["path"], w["entry"], dict(w["args"]),
                                    device=dev))
    eager, work = models
    work.model.load_state_dict(eager.model.state_dict())
    # inductor draws dropout's random numbers its own way unless told to fall back to eager's
    extra = {"options": {"fallback_random": True}} if backend == "inductor" else {}
    compiled = mod.compile_planned(work.model, backend=backend, quiet=True, **extra)
    diffs = _compare(eager, work, compiled, steps, seed)
    got = totals(compiled._slackswap_partitions)
    plan = _plan_numbers(table, got["lined_up_rows"])
    loss_tol, grad_tol = (0.0, 0.0) if backend == "aot_eager" else \
        _tolerances(next(eager.model.parameters()).dtype)
    reasons = _reasons(got, plan, diffs, loss_tol, grad_tol)
    del got["lined_up_rows"]
    return {"backend": backend, "steps": steps, "compiled": got, "plan": plan, **diffs,
            "tolerances": {"loss": loss_tol, "grad": grad_tol, "bytes": BYTES_TOLERANCE},
            "passed": not reasons, "reasons": reasons}


def _compare(eager, work, compiled, steps: int, seed: int) -> dict:
    """`steps` AdamW steps of both from the same seed: the largest relative differences."""
    import torch

    from ..trace.joint import loss_from_output, split_inputs
    from .verify import _rel
    runs = [(eager, eager.model), (work, compiled)]
    opts = [torch.optim.AdamW(w.model.parameters(), lr=1e-2) for w, _ in runs]
    out = {"max_loss_rel_diff": 0.0, "max_grad_rel_diff": 0.0, "max_param_rel_diff": 0.0,
           "max_buffer_rel_diff": 0.0}
    for k in range(steps):
        losses, grads = [], []
        for (w, model), opt in zip(runs, opts):
            w.model.train()
            torch.manual_seed(seed + 1 + k)
            a, kw = split_inputs(w.inputs)
            loss = loss_from_output(model(*a, **kw), w.inputs, w.loss_fn)
            loss.backward()
            losses.append(loss.detach())
            grads.append([p.grad for p in w.model.parameters()])
            opt.step()
            opt.zero_grad(set_to_none=True)
        out["max_loss_rel_diff"] = max(out["max_loss_rel_diff"], _rel(*losses))
        out["max_grad_rel_diff"] = max([out["max_grad_rel_diff"],
                                        *(_rel(g, h) for g, h in zip(*grads))])
    pairs = {"max_param_rel_diff": (eager.model.parameters(), work.model.parameters()),
             "max_buffer_rel_diff": (eager.model.buffers(), work.model.buffers())}
    for key, (a, b) in pairs.items():
        out[key] = max([0.0, *(_rel(x, y) for x, y in zip(a, b) if x.is_floating_point())])
    return out


def _plan_numbers(table: dict, rows: list[int]) -> dict:
    """The plan's three numbers, in all and for the roots whose ops lined up."""
    ops, size = table["ops"], {int(k): v for k, v in table["root_bytes"].items()}
    kept: set[int] = set()
    swapped: set[int] = set()
    for r in rows:
        for tag, root in zip(ops[r][4], ops[r][6]):
            if root is not None and root in size:
                (swapped if tag == "offload" else kept if tag == "save" else set()).add(root)
    return {"kept_bytes": table["kept_bytes"], "swapped_bytes": table["swapped_bytes"],
            "recomputed_ops": len(table["recompute_ops"]),
            "lined_up_kept_bytes": sum(size[r] for r in kept),
            "lined_up_swapped_bytes": sum(size[r] for r in swapped)}


def _reasons(got: dict, plan: dict, diffs: dict, loss_tol: float, grad_tol: float) -> list[str]:
    reasons = []
    if got["graphs"] == 0:
        return ["torch.compile captured no graph with a backward: nothing was partitioned"]
    want = plan["lined_up_kept_bytes"] + plan["lined_up_swapped_bytes"]
    have = got["saved_bytes"] - got["saved_bytes_not_lined_up"] + got["offloaded_bytes"]
    if abs(have - want) > BYTES_TOLERANCE * max(want, 1):
        reasons.append(f"the compiled graphs hold {have} bytes for backward (saved plus "
                       f"offloaded, of what lined up), the plan {want} (kept plus swapped)")
    if got["offloaded_bytes"] != plan["lined_up_swapped_bytes"]:
        reasons.append(f"the compiled graphs offload {got['offloaded_bytes']} bytes, the plan "
                       f"swaps {plan['lined_up_swapped_bytes']} (of what lined up)")
    if got["off_plan_recomputes"]:
        reasons.append(f"the backward graphs re-run ops outside the plan's recompute chains: "
                       f"{', '.join(got['off_plan_recomputes'][:8])}")
    if diffs["max_loss_rel_diff"] > loss_tol or diffs["max_grad_rel_diff"] > grad_tol \
            or diffs["max_param_rel_diff"] > grad_tol or diffs["max_buffer_rel_diff"] > grad_tol:
        reasons.append(f"compiled differs from eager: loss by {diffs['max_loss_rel_diff']:.2e}, "
                       f"gradients by {diffs['max_grad_rel_diff']:.2e}, parameters by "
                       f"{diffs['max_param_rel_diff']:.2e}, buffers by "
                       f"{diffs['max_buffer_rel_diff']:.2e} (relative)")
    return reasons
