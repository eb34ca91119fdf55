"""What the in-place patch costs per forward op, as ratios measured in one run.

Interleaved in one process on one thread, min over many rounds of one training step each
(forward + backward, timed as this thread's CPU time: on one thread CPU autograd runs
backward on the calling thread, and CPU time is far less disturbed than wall time by the other
processes of a shared machine), on a tiny GPT at two sizes (short ops: a few ms per step; the previous
benchmark's size) and on a small Hugging Face Llama, all profiled with `--device fake:cpu`:

- eager; eager under identity `saved_tensors_hooks`; eager under a pass-through
  `TorchDispatchMode`; eager selective activation checkpointing (a save-all policy over each
  block): the reference costs;
- `patch` with a keep-all plan and with the 0.5 plan, on the first call at a shape (the full
  recorder: forced on every call here) and on later calls (steady state: pack hooks only; a
  keep-all plan's later calls run with no hooks at all, nothing to do, unless they measure
  what they hold: "measuring" is that case, `measure_held`, its pack hook noting each saved
  tensor's alias: the cost of the hook path when the plan acts on nothing).

Each variant's extra time per forward op is the median over rounds of (its step - that round's
eager step) / the profile's forward ops (the difference of the minima is in the JSON too); the
ratios compare the patch's extra time with the identity hooks' and with the pass-through
dispatch mode's. The order of the variants rotates by one each round, so each follows each
other equally often: a step's Python runs on caches the previous step left (a step after the
full recorder's, which touches far more memory, runs slower), and a fixed order would charge
that to whichever variant comes after the heaviest (1.8x against 1.4x for the keep-all
steady state over the identity hooks, measured both ways in one session).

**The 0.5 plan's work, apart from the runtime's bookkeeping.** A plan that recomputes and swaps
makes any runtime do real work on top of eager: run the recomputed ops again in backward, copy
swapped storages to the host and back. That is not overhead. It is measured in the same rounds
by a reference, "0.5 plan's work, bare": from one steady-state step of the patched model the
benchmark captures every aten call its chains replayed (function and the very argument values,
views re-derived included: by the op, or by `Tensor.as_strided` at their geometry) and every
storage it copied to the host; each round then executes exactly those calls in a plain loop
(`func(*args, **kwargs)` under `no_grad`, nothing else) and, per swapped storage, the copy into
a preallocated host buffer and the copy back into a freshly allocated tensor (the pool reuses
host buffers; memory freed in forward must be allocated again in backward). The bookkeeping is
the patch-0.5 steady extra time less that work, per forward op, and is compared with the
pass-through dispatch mode's extra time (the target). (The bare replay runs its ops back
to back on warm caches, so if anything it is faster than the same ops inside backward: the
bookkeeping is, if anything, overstated.)

**The same work in place: "0.5 plan's work, in place".** A second reference runs that work
where the patch runs it. The capture step also notes, for each call and copy, where it ran: the
index of the saved-tensor pack (host copy, in forward) or unpack (a chain's calls, the copy
back, in backward) of that step. The reference is a fresh eager model (same weights) whose
forward alone (not the loss: as `patch`) runs under identity `saved_tensors_hooks`: the pack
hook counts and, at a pack where the patch copied a storage to the host, copies that pack's
storage (`swap.storage_as_bytes`, as the patch) into a preallocated host buffer; the unpack hook
counts and, at an unpack where the patch fetched swapped storages and/or ran a chain, copies
those host buffers into freshly allocated tensors and runs exactly the captured calls (same
functions, same argument values, as_strided views included) under `no_grad`; both hooks return
the tensor as is. Lists are precomputed and indexed by the counter (a list lookup and a None
check per pack and per unpack). So it includes: the identity hooks' cost on every pack and
unpack, the copies and calls at the same points of the step (between the same autograd nodes,
with the caches as they are there). It does not include the patch's bookkeeping (checks per
pack, handles, its own dispatch of the chain's records, releasing). Differences the reference
keeps: its calls read the captured step's argument tensors (not this step's), its fetched
copy is dropped at once (autograd reads the original tensor), and eager keeps every saved
tensor (no freeing and reallocating the way the plan does). It is checked before timing: one
step records every pack's shape and storage size and every unpack's shape, which must equal
the patched step's, or the benchmark stops. "bookkeeping vs in-place work" is the patch-0.5
steady extra time less the in-place reference's extra time (both against the same round's
eager step), per forward op, with its ratio to the pass-through dispatch mode's.

    python benchmarks/inplace_overhead.py [--quick] [--case "short ops"] [--out DIR]
    # (--case: only the cases whose label holds it, printed, nothing written); writes benchmarks/results/inplace_overhead.json and inplace_overhead.md
"""
from __future__ import annotations

import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

LLAMA = '''
import torch
from transformers import LlamaConfig, LlamaForCausalLM
def workload(batch=4, seq=64, hidden=128, layers=2):
    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=2 * hidden, vocab_size=256,
                      max_position_embeddings=seq, use_cache=False)
    ids = torch.randint(0, 256, (batch, seq))
    return LlamaForCausalLM(cfg), {"input_ids": ids, "labels": ids}
'''
CASES = [  # (label, workload, args, rounds)
    ("tiny GPT, short ops", "tiny_gpt", {"n_layer": 2, "d_model": 64, "seq": 64, "batch": 4,
                                          "dropout": 0.0}, 300),
    ("tiny GPT (previous size)", "tiny_gpt", {"n_layer": 4, "d_model": 256, "seq": 128,
                                               "batch": 8, "dropout": 0.0}, 16),
    ("HF Llama (small)", "llama", {}, 160),
]
WORK = "0.5 plan's work, bare"
IN_PLACE = "0.5 plan's work, in place"
VARIANTS = ["eager", "identity hooks", "pass-through dispatch mode", "SAC save-all",
            "patch keep-all, first call", "patch 0.5, first call",
            "patch keep-all, steady", "patch keep-all, steady, measuring", "patch 0.5, steady"]
MEASURING = "patch keep-all, steady, measuring"


def _blocks(model):
    inner = getattr(model, "model", model)
    return list(getattr(inner, "blocks", None) or getattr(inner, "layers"))


def _sac(model) -> None:
    """Wrap each block's forward in selective checkpointing that saves every op."""
    import functools

    from torch.utils.checkpoint import (
        CheckpointPolicy,
        checkpoint,
        create_selective_checkpoint_contexts,
    )

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE

    for block in _blocks(model):
        fwd = block.forward

        def wrapped(*a, _fwd=fwd, **kw):
            return checkpoint(_fwd, *a, use_reentrant=False, **kw,
                              context_fn=functools.partial(create_selective_checkpoint_contexts,
                                                           policy))
        block.forward = wrapped


def _variants(path: str, args: dict, mods: dict):
    """One model per variant (same weights) and the context its step runs under."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from slackswap_cli.trace.workload import load_workload

    class PassThrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, a=(), kw=None):
            return func(*a, **(kw or {}))

    def hooks():
        return torch.autograd.graph.saved_tensors_hooks(lambda x: x, lambda x: x)

    out = {}
    for name in VARIANTS:
        work = load_workload(path, args=args)
        ctx = contextlib.nullcontext
        if name == "identity hooks":
            ctx = hooks
        elif name == "pass-through dispatch mode":
            ctx = PassThrough
        elif name == "SAC save-all":
            _sac(work.model)
        elif name.startswith("patch"):
            mods["keep" if "keep-all" in name else "half"].patch(work.model)
            work.model.forward.__slackswap__.steady = "steady" in name
            work.model.forward.__slackswap__.measure_held = name == MEASURING
        out[name] = (work, ctx)
    return out


def _step(work, ctx) -> float:
    from slackswap_cli.trace.joint import loss_from_output, split_inputs
    a, kw = split_inputs(work.inputs)
    t0 = time.thread_time()
    with ctx():
        loss = loss_from_output(work.model(*a, **kw), work.inputs, work.loss_fn)
    loss.backward()
    dt = time.thread_time() - t0
    work.model.zero_grad(set_to_none=True)
    return dt


def _capture_work(work) -> dict:
    """One steady-state step of the patched `work.model`, watched: every aten call its chains
    replayed (function, the argument values it got) and every storage it copied to the host
    and back, each tagged with where it ran: the index of the saved-tensor pack (host copy) or
    unpack (chain call, copy back) of that step; and every pack's and unpack's shape, so the
    in-place reference can check that its eager step packs and unpacks the same tensors."""
    import slackswap_cli.run.eager.backward as rec_mod
    import slackswap_cli.run.swap as rt
    from slackswap_cli.run.eager.steady_call import SteadyCall
    strided = rec_mod._as_strided
    state = work.model.forward.__slackswap__
    tpl = next(t for t in state.templates.by_sig.values() if hasattr(t, "records"))
    cap = {"calls": [], "copies": [], "fetches": [], "packs": [], "unpacks": []}
    where = {}                     # id(handle) -> index in cap["copies"]

    class watched:                 # the op, telling what it is asked to run
        def __init__(self, func):
            self.func = func

        def __call__(self, *a, **kw):
            cap["calls"].append((len(cap["unpacks"]) - 1, self.func, a, kw))
            return self.func(*a, **kw)

        def __getattr__(self, name):
            return getattr(self.func, name)

    def offload(t, _orig=rt.offload):
        h = _orig(t)
        where[id(h)] = len(cap["copies"])
        cap["copies"].append((len(cap["packs"]) - 1, t))
        return h

    def prefetch(h, _orig=rt.prefetch):
        if h.device_copy is None:
            cap["fetches"].append((len(cap["unpacks"]) - 1, where[id(h)]))
        return _orig(h)

    def pack(self, x, _orig=SteadyCall.pack):
        cap["packs"].append((tuple(x.shape), x.untyped_storage().nbytes()))
        return _orig(self, x)

    def unpack(s, packed, _orig=rec_mod.unpack):
        i = len(cap["unpacks"])
        cap["unpacks"].append(None)        # (this unpack's index, while it runs)
        out = _orig(s, packed)
        cap["unpacks"][i] = tuple(out.shape)
        return out
    funcs = [rec.func for rec in tpl.records]
    for rec in tpl.records:
        rec.func = watched(rec.func)
    rt.offload, rt.prefetch = offload, prefetch
    SteadyCall.pack, rec_mod.unpack = pack, unpack
    rec_mod._as_strided = watched(strided)     # (views re-derived by their geometry)
    try:
        _step(work, contextlib.nullcontext)
    finally:
        rt.offload, rt.prefetch = offload.__defaults__[0], prefetch.__defaults__[0]
        SteadyCall.pack, rec_mod.unpack = pack.__defaults__[0], unpack.__defaults__[0]
        rec_mod._as_strided = strided
        for rec, func in zip(tpl.records, funcs):
            rec.func = func
    if any(u < 0 for u, *_ in cap["calls"] + cap["fetches"]):
        raise RuntimeError("a chain call or a copy back ran outside an unpack")
    return cap


def _hooked(model, pack, unpack, reset) -> None:
    """Run `model`'s forward (only: not the loss, as `patch`) under saved-tensor hooks."""
    import torch
    fwd = model.forward

    def forward(*a, **kw):
        reset()
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            return fwd(*a, **kw)
    model.forward = forward


def _in_place(path: str, args: dict, cap: dict):
    """The in-place reference: a fresh eager model (same weights) whose forward runs under
    identity saved-tensor hooks that, at the very pack (host copy) and unpack (copy back,
    chain's calls) indices where the patched steady step did them, execute exactly the
    captured host copies and aten calls; lists precomputed, indexed by a counter. Checked
    first: one step records its packs' and unpacks' shapes, which must be the patched step's."""
    import torch

    from slackswap_cli.run.swap import storage_as_bytes
    from slackswap_cli.trace.workload import load_workload
    work = load_workload(path, args=args)
    seen = {"packs": [], "unpacks": []}

    def see_pack(x):
        seen["packs"].append((tuple(x.shape), x.untyped_storage().nbytes()))
        return x

    def see_unpack(x):
        seen["unpacks"].append(tuple(x.shape))
        return x
    fwd = work.model.forward
    _hooked(work.model, see_pack, see_unpack, lambda: [v.clear() for v in seen.values()])
    _step(work, contextlib.nullcontext)
    work.model.forward = fwd
    if seen["packs"] != cap["packs"] or seen["unpacks"] != cap["unpacks"]:
        raise RuntimeError(f"in-place reference: eager packs/unpacks ({len(seen['packs'])}/"
                           f"{len(seen['unpacks'])}) differ from the patched step's "
                           f"({len(cap['packs'])}/{len(cap['unpacks'])})")
    hosts = [torch.empty_like(t) for _, t in cap["copies"]]
    on_pack = [None] * len(cap["packs"])
    for (i, _), host in zip(cap["copies"], hosts):
        on_pack[i] = host
    fetch = [[] for _ in cap["unpacks"]]
    run = [[] for _ in cap["unpacks"]]
    for u, c in cap["fetches"]:
        fetch[u].append(hosts[c])
    for u, func, a, kw in cap["calls"]:
        run[u].append((func, a, kw))
    on_unpack = [(tuple(f), tuple(r)) if f or r else None for f, r in zip(fetch, run)]
    n = [0, 0]

    def pack(x):
        i = n[0]
        n[0] = i + 1
        host = on_pack[i]
        if host is not None:
            host.copy_(storage_as_bytes(x))
        return x

    def unpack(x):
        u = n[1]
        n[1] = u + 1
        todo = on_unpack[u]
        if todo is not None:
            for host in todo[0]:
                torch.empty_like(host).copy_(host)
            if todo[1]:
                with torch.no_grad():
                    for func, a, kw in todo[1]:
                        func(*a, **kw)
        return x

    def reset():
        n[0] = n[1] = 0
    _hooked(work.model, pack, unpack, reset)
    return work


def _work_step(calls: list, copies: list, hosts: list) -> float:
    """The plan's work alone: the replayed calls in a plain loop, each swapped storage copied
    into its (preallocated) host buffer and back into a new tensor."""
    import torch
    t0 = time.thread_time()
    with torch.no_grad():
        for func, a, kw in calls:
            func(*a, **kw)
        for src, host in zip(copies, hosts):
            host.copy_(src)
            torch.empty_like(host).copy_(host)
    return time.thread_time() - t0


def run_case(label: str, path: str, args: dict, rounds: int) -> dict:
    import torch

    from slackswap_cli.hardware import PRESETS
    from slackswap_cli.planners import make_plan
    from slackswap_cli.run.emit import apply_plan, load_patched
    from slackswap_cli.trace import profile_workload
    hw = PRESETS["a100-pcie4"]
    prof = profile_workload(path, device="fake:cpu", hardware=hw, args=args)
    peak = prof.keep_all_peak_bytes
    mods, planned = {}, {}
    with tempfile.TemporaryDirectory() as d:
        for key, frac in (("keep", 1.0), ("half", 0.5)):
            plan = make_plan("slackswap", prof, hw, int(peak * frac), frac)
            planned[key] = {a: sum(1 for x in plan.decisions if x.action == a)
                            for a in ("keep", "swap", "recompute")}
            f = Path(d) / f"patched_{key}.py"
            f.write_text(apply_plan(plan, prof, args=args))
            mods[key] = load_patched(str(f))
        models = _variants(path, args, mods)
        for name in VARIANTS:                  # warm-up (and each patch's first call; a
            for _ in range(3):                 # model planned again along its branches
                _step(*models[name])           # records once more before its template)
        cap = _capture_work(models["patch 0.5, steady"][0])
        calls = [(f, a, kw) for _, f, a, kw in cap["calls"]]
        copies = [t for _, t in cap["copies"]]
        hosts = [torch.empty_like(t) for t in copies]
        models[IN_PLACE] = (_in_place(path, args, cap), contextlib.nullcontext)
        for _ in range(2):
            _step(*models[IN_PLACE])
        times = {name: [] for name in [*VARIANTS, IN_PLACE, WORK]}
        names = [*VARIANTS, IN_PLACE]
        for r in range(rounds):      # (order rotated: each variant follows each other alike)
            k = r % len(names)
            for name in names[k:] + names[:k]:
                times[name].append(_step(*models[name]))
            times[WORK].append(_work_step(calls, copies, hosts))
    n = prof.n_forward
    work_us = statistics.median(times.pop(WORK)) * 1e6 / n
    best = {k: min(v) for k, v in times.items()}
    # paired: each round's step less that round's eager step, median over rounds (robust to
    # the slow swings of a loaded machine); and the difference of the minima
    extra = {k: statistics.median(t - e for t, e in zip(v, times["eager"])) * 1e6 / n
             for k, v in times.items()}
    extra_min = {k: (v - best["eager"]) * 1e6 / n for k, v in best.items()}
    # the spread of the paired differences (first and third quartile over rounds)
    spread = {k: [q * 1e6 / n for q in statistics.quantiles(
        [t - e for t, e in zip(v, times["eager"])], n=4)[::2]] for k, v in times.items()}
    ratio = {k: {"vs identity hooks": extra[k] / extra["identity hooks"],
                 "vs pass-through dispatch mode": extra[k] / extra["pass-through dispatch mode"]}
             for k in VARIANTS if k.startswith("patch")}
    half = extra["patch 0.5, steady"]
    split = {"extra_us_per_forward_op": half, "work_us_per_forward_op": work_us,
             "bookkeeping_us_per_forward_op": half - work_us,
             "bookkeeping_vs_dispatch_mode": (half - work_us)
             / extra["pass-through dispatch mode"],
             "in_place_work_us_per_forward_op": extra[IN_PLACE],
             "bookkeeping_vs_in_place_us_per_forward_op": half - extra[IN_PLACE],
             "bookkeeping_vs_in_place_vs_dispatch_mode": (half - extra[IN_PLACE])
             / extra["pass-through dispatch mode"],
             "replayed_calls": len(calls), "unpacks": len(cap["unpacks"]),
             "unpacks_doing_work": len({u for u, *_ in cap["calls"] + cap["fetches"]}), "swapped_storages": len(copies),
             "swapped_bytes": sum(t.untyped_storage().nbytes() for t in copies)}
    return {"case": label, "args": args, "forward_ops": n, "rounds": rounds,
            "plans": planned, "plan_0.5_steady": split, "step_ms": {k: v * 1e3 for k, v in best.items()},
            "extra_us_per_forward_op": extra, "extra_us_per_forward_op_quartiles": spread,
            "extra_us_per_forward_op_of_minima": extra_min,
            "patch_ratios": ratio}


def table(results: list[dict]) -> str:
    lines = ["| variant | " + " | ".join(f"{r['case']} ({r['forward_ops']} fwd ops, eager "
                                           f"{r['step_ms']['eager']:.1f} ms)" for r in results)
             + " |", "|---" * (1 + len(results)) + "|"]
    for name in VARIANTS[1:]:
        cells = []
        for r in results:
            cell = f"{r['extra_us_per_forward_op'][name]:+.1f} us/op"
            q = r["patch_ratios"].get(name)
            if q:
                cell += (f" ({q['vs identity hooks']:.1f}x hooks, "
                         f"{q['vs pass-through dispatch mode']:.2f}x dispatch mode)")
            cells.append(cell)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    rows = [("0.5 plan's work, bare (replayed ops, host copies)",
             lambda h: f"{h['work_us_per_forward_op']:+.1f} us/op ({h['replayed_calls']} "
                       f"calls, {h['swapped_storages']} copies)"),
            ("patch 0.5, steady: bookkeeping (steady less the work)",
             lambda h: f"{h['bookkeeping_us_per_forward_op']:+.1f} us/op "
                       f"({h['bookkeeping_vs_dispatch_mode']:.2f}x dispatch mode)"),
            ("0.5 plan's work, in place (eager + identity hooks running the same calls and "
             "copies at the same packs/unpacks)",
             lambda h: f"{h['in_place_work_us_per_forward_op']:+.1f} us/op (at "
                       f"{h['unpacks_doing_work']} of {h['unpacks']} unpacks)"),
            ("patch 0.5, steady: bookkeeping vs in-place work (steady less the in-place work)",
             lambda h: f"{h['bookkeeping_vs_in_place_us_per_forward_op']:+.1f} us/op "
                       f"({h['bookkeeping_vs_in_place_vs_dispatch_mode']:.2f}x dispatch mode)")]
    for name, cell in rows:
        lines.append(f"| {name} | " + " | ".join(cell(r["plan_0.5_steady"]) for r in results)
                     + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    import os

    import torch
    torch.set_num_threads(1)
    import argparse
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="an eighth of the rounds (at least 3)")
    ap.add_argument("--case", default=None,
                    help="only the cases whose label holds this; printed, nothing written")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"),
                    help="folder for inplace_overhead.json and .md")
    opts = ap.parse_args()
    quick, only = opts.quick, opts.case
    load = os.getloadavg()
    results = []
    with tempfile.TemporaryDirectory() as d:
        llama = Path(d) / "llama_small.py"
        llama.write_text(LLAMA)
        paths = {"tiny_gpt": str(ROOT / "examples" / "tiny_gpt.py"), "llama": str(llama)}
        for label, name, args, rounds in CASES:
            if only is not None and only not in label:
                continue
            results.append(run_case(label, paths[name], args, max(3, rounds // 8) if quick
                                    else rounds))
            print(f"{label}: done", file=sys.stderr)
    load = (*load, *os.getloadavg())
    out = {"torch": torch.__version__, "threads": 1, "quick": quick,
           "timing": "median over interleaved rounds (order rotated by one each round) of "
                     "(the step's thread CPU time less that round's eager step); minima in "
                     "step_ms",
           "load_average_1_5_15_min_at_start_and_end": load, "results": results}
    md = table(results)
    head = ("Extra time per forward op over eager (median over interleaved rounds of the "
            "step's thread CPU time less that round's eager step, one thread); patch ratios "
            "against identity saved-tensor hooks and a pass-through dispatch mode. The last "
            "four rows split the 0.5 plan's steady-state extra time into the plan's own work "
            "and the runtime's bookkeeping (the rest), twice: with the work executed bare (its "
            "replayed ops and host copies in a plain warm loop) and in place (an eager step "
            "under identity saved-tensor hooks that run the very same captured calls and "
            "copies at the same pack/unpack indices as the patch: identity-hook cost, cache "
            "and position effects included, the patch's bookkeeping not). "
            f"Load average (1, 5, 15 min) at start {load[0]:.2f} {load[1]:.2f} "
            f"{load[2]:.2f}, at end {load[3]:.2f} {load[4]:.2f} {load[5]:.2f}"
            f"{'; --quick' if quick else ''}.\n\n")
    print(head + md)
    if only is None:
        Path(opts.out).mkdir(parents=True, exist_ok=True)
        dest = Path(opts.out) / "inplace_overhead.json"
        dest.write_text(json.dumps(out, indent=1) + "\n")
        dest.with_suffix(".md").write_text(head + md)
        print(f"wrote {dest} and {dest.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
