"""Training runs under the emulated asynchronous device (`emulated_device.py`), each checked
bitwise against eager: the tests (tests/test_emulated_device.py) and the mutation check
(benchmarks/sync_mutants.py) share them.

Each case trains `STEPS` AdamW steps of a small model eagerly and the same steps carried out by
a plan that swaps (priced with 2 us kernels, `small_costs.py`, so that it recomputes too), the
latter with every swap on `swap.StreamEngine` over the emulated device, and returns a dict:
`bitwise` (losses and parameters equal), `swaps` (copies made), `stats` (the emulator's),
`error` (what a run raised, as text; then `bitwise` is False).
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from .emulated_device import emulated_device, emulated_stats
from .small_costs import small_model_costs

ROOT = Path(__file__).resolve().parents[1]
TINY_GPT = ROOT / "examples" / "tiny_gpt.py"
STEPS = 3
SMALL = {"n_layer": 1, "d_model": 32, "n_head": 2, "seq": 16}   # the tiny GPT made smaller
_PLANS: dict = {}


def planned(path: Path, frac: float, args: dict | None = None):
    """(profile, plan, patched module) of the workload at `path` at `frac` of its peak (a fake
    profile for the CPU, 2 us kernels), made once per process."""
    key = (str(path), frac, tuple(sorted((args or {}).items())))
    if key not in _PLANS:
        from slackswap_cli.hardware import PRESETS
        from slackswap_cli.planners import make_plan
        from slackswap_cli.run.emit import apply_plan, load_patched
        from slackswap_cli.trace import profile_workload
        hw = PRESETS["a100-pcie4"]
        with small_model_costs():
            prof = profile_workload(str(path), device="fake:cpu", hardware=hw, args=args)
            plan = make_plan("slackswap", prof, hw,
                             int(prof.summary["peak_activation_bytes"] * frac), frac)
        out = Path(tempfile.mkdtemp(prefix="slackswap-emulated-")) / "patched.py"
        out.write_text(apply_plan(plan, prof, args=args))
        _PLANS[key] = (prof, plan, load_patched(str(out)))
    return _PLANS[key]


def _steps(model, params, inputs, twice: bool = False):
    """STEPS AdamW steps from seed 1 (`twice`: a second backward through the retained
    graph, the loss halved); (losses, parameters after)."""
    opt = torch.optim.AdamW(params, lr=1e-2)
    torch.manual_seed(1)
    losses = []
    for _ in range(STEPS):
        loss = model(*inputs)
        loss.backward(retain_graph=twice)
        if twice:
            (0.5 * loss).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach().clone())
        del loss
    return losses, [p.detach().clone() for p in params]


def _same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def run_case(kind: str, path: Path = TINY_GPT, frac: float = 0.4, args: dict | None = SMALL,
             lag: int | None = None) -> dict:
    """One case: `kind` "patch" (in-place `patch`), "written" (the written-out step module,
    `step_module`), "twice" (in-place, a second backward through a retained graph) or
    "two-streams" (`run_two_streams`)."""
    from slackswap_cli.trace.workload import load_workload
    if kind == "two-streams":
        return run_two_streams(path, frac, args, lag)
    _prof, plan, mod = planned(path, frac, args)
    eager, work = load_workload(str(path), args=args), load_workload(str(path), args=args)
    work.model.load_state_dict(eager.model.state_dict())
    inputs = tuple(eager.inputs)
    twice = kind == "twice"
    want = _steps(eager.model, list(eager.model.parameters()), inputs, twice)
    acts = [d.action for d in plan.decisions]
    out = {"case": f"{kind}:{path.stem}@{frac}" + (f" lag {lag}" if lag is not None else ""),
           "swaps": acts.count("swap"), "recomputes": acts.count("recompute")}
    model = (mod.step_module(work.model, check_trace=False) if kind == "written"
             else mod.patch(work.model))
    try:
        with emulated_device(lag=lag) as dev:
            got = _steps(model, list(work.model.parameters()), tuple(work.inputs), twice)
    except Exception as exc:       # a corrupted value may make a kernel raise: a failure too
        out.update(bitwise=False, error=f"{type(exc).__name__}: {exc}"[:300], stats=None)
        return out
    out.update(bitwise=_same(want[0], got[0]) and _same(want[1], got[1]), error=None,
               stats=emulated_stats(dev))
    return out


def run_two_streams(path: Path = TINY_GPT, frac: float = 0.4, args: dict | None = SMALL,
                    lag: int | None = None) -> dict:
    """Two patched copies of one model trained in turns, each on a compute stream of its own
    with nothing ordering the two (independent models on one device), so that the host
    buffers one model's backward gives back are handed to the other's forward: only the
    pool's event check orders the reuse. Each against eager, bitwise."""
    from slackswap_cli.trace.workload import load_workload
    _prof, _plan, mod = planned(path, frac, args)
    eager = load_workload(str(path), args=args)
    works = [load_workload(str(path), args=args) for _ in range(2)]
    for w in works:
        w.model.load_state_dict(eager.model.state_dict())
    inputs = tuple(eager.inputs)
    want = _steps(eager.model, list(eager.model.parameters()), inputs)
    models = [mod.patch(w.model) for w in works]
    out = {"case": f"two-streams:{path.stem}@{frac}" + (f" lag {lag}" if lag is not None else "")}
    try:
        with emulated_device(lag=lag) as dev:
            streams = [dev.compute_stream(f"compute {i}") for i in range(2)]
            got = _turns(models, works, streams, dev)
    except Exception as exc:
        out.update(bitwise=False, error=f"{type(exc).__name__}: {exc}"[:300], stats=None)
        return out
    out.update(bitwise=all(_same(want[0], g[0]) and _same(want[1], g[1]) for g in got),
               error=None, stats=emulated_stats(dev))
    return out


def _turns(models, works, streams, dev) -> list:
    """STEPS AdamW steps of each model, in turns, each on its stream; per model (losses,
    parameters after)."""
    params = [list(w.model.parameters()) for w in works]
    opts = [torch.optim.AdamW(p, lr=1e-2) for p in params]
    losses: list[list] = [[], []]
    torch.manual_seed(1)
    rng = torch.get_rng_state()
    states = [rng, rng]                 # each model draws as eager did (dropout)
    for _ in range(STEPS):
        for i, (model, w) in enumerate(zip(models, works)):
            torch.set_rng_state(states[i])
            with dev.stream(streams[i]):
                loss = model(*w.inputs)
                loss.backward()
            opts[i].step()
            opts[i].zero_grad(set_to_none=True)
            losses[i].append(loss.detach().clone())
            states[i] = torch.get_rng_state()
            del loss
    return [(losses[i], [p.detach().clone() for p in params[i]]) for i in range(2)]


#: the fixed cases of the mutation check and of the default test suite
QUICK = (("patch", TINY_GPT, 0.4, SMALL), ("written", TINY_GPT, 0.4, SMALL),
         ("twice", TINY_GPT, 0.4, {**SMALL, "dropout": 0.0}),
         ("two-streams", TINY_GPT, 0.4, SMALL))
