"""What a zoo row's steady step costs against what any saved-tensor runtime would pay: the
patched step beside eager, eager under identity saved-tensor hooks (the hooks' own cost) and
eager under minimal swap hooks (the packs the template swaps copied to a fresh tensor in
forward and cloned back in backward, the rest as they are: the copies themselves, no
bookkeeping). Forward and backward, no optimizer, one thread; each variant's fastest of
interleaved rounds (thread CPU time), as ratios to eager.

    python benchmarks/steady_floor.py transformers seq2seq/t5
    python benchmarks/steady_floor.py timm mobilevitv2_050 --planner recompute-only

The model is built, planned (2 us kernels, as the zoo plans) and patched as the zoo does it
(benchmarks/zoo.py: budget 0.5 or the first feasible; recompute-only at its first feasible).
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def planned(library: str, name: str, planner: str):
    """(patched model, eager twin, inputs, loss_fn), steady after four calls."""
    import slackswap_cli as slackswap
    from benchmarks import zoo_models
    from benchmarks.zoo import _plan
    from slackswap_cli.budget import first_feasible_budget
    from slackswap_cli.hardware import load_hardware
    from slackswap_testkit.small_costs import small_model_costs
    model, inputs, loss_fn = zoo_models.build(library, name)
    twin = copy.deepcopy(model)
    with small_model_costs():
        plan, _, _ = _plan(model, inputs, loss_fn)
        if planner != "slackswap":
            first = first_feasible_budget(plan.profile, load_hardware(None), planner)
            plan = slackswap.plan_model(model, inputs, budget=int(first), device="fake:cpu",
                                        loss_fn=loss_fn, planner=planner)
    slackswap.patch(model, plan)
    return model, twin, inputs, loss_fn, plan


def minimal_swap_hooks(actions: list):
    """Pack and unpack hooks that copy the packs whose template action is not KEEP (by
    position) and hand the rest over as they are."""
    import torch

    from slackswap_cli.schema import Action
    at = [0]

    def pack(x):
        k = at[0]
        at[0] = k + 1
        if k < len(actions) and actions[k] is not Action.KEEP:
            host = torch.empty_like(x)
            host.copy_(x)
            return (host,)
        return x

    def unpack(p):
        return p[0].clone() if type(p) is tuple else p
    return pack, unpack, at


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("library")
    ap.add_argument("name")
    ap.add_argument("--planner", default="slackswap")
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    import torch

    from slackswap_cli.trace.joint import loss_from_output, split_inputs
    torch.set_num_threads(1)
    model, twin, inputs, loss_fn, plan = planned(args.library, args.name, args.planner)
    a, kw = split_inputs(inputs)

    def step(m, hooks=None):
        torch.manual_seed(0)
        t = time.thread_time()
        if hooks is None:
            out = m(*a, **kw)
        else:
            with torch.autograd.graph.saved_tensors_hooks(*hooks):
                out = m(*a, **kw)
        loss_from_output(out, inputs, loss_fn).backward()
        took = time.thread_time() - t
        m.zero_grad(set_to_none=True)
        return took
    for _ in range(4):
        step(model)
        step(twin)
    state = model.forward.__slackswap__
    if state.last_report["recorded"]:
        print(f"{args.name}: not steady after four calls", file=sys.stderr)
        return 1
    pack, unpack, at = minimal_swap_hooks([p.action for p in state.last_run.tpl.seq_quiet])

    def minimal():
        at[0] = 0
        return step(twin, (pack, unpack))
    variants = {"eager": lambda: step(twin),
                "identity hooks": lambda: step(twin, (lambda x: x, lambda x: x)),
                "minimal swap hooks": minimal, "patched": lambda: step(model)}
    best = dict.fromkeys(variants, float("inf"))
    for _ in range(args.rounds):
        for k, run in variants.items():
            best[k] = min(best[k], run())
    acts = plan.actions()
    print(f"{args.library}/{args.name} {args.planner} keep/swap/recompute "
          f"{acts['keep']}/{acts['swap']}/{acts['recompute']}: " + ", ".join(
              f"{k} {v / best['eager']:.2f}x" for k, v in best.items())
          + f" (eager {best['eager'] * 1e3:.2f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
