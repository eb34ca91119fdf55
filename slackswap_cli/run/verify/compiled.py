"""`slackswap verify patched.py --compile`: does the compiled graph carry the plan out?

Copies of the workload from the same weights: one eager, one through the patched module's
`compile_planned` (backend inductor or aot_eager) and, with inductor, one through plain
`torch.compile` with the same options. `steps` AdamW steps from the same seed compare losses,
gradients, parameters and buffers: aot_eager runs the same aten ops as eager: bitwise against
eager. Inductor fuses and reorders, and so does plain torch.compile (both with `fallback_random`
so that dropout draws eager's random numbers): per kind (loss, step-1 gradients, parameters and
buffers after the last step) compile_planned passes when bitwise equal to plain torch.compile
or no further from eager than RATIO_TO_REFERENCE times plain torch.compile's own distance plus
the fp32 tolerance (`_value_reasons`; BERT's attention key biases, whose true gradient is 0,
get rounding-level gradients that AdamW turns into lr-sized steps: torch.compile's parameters
differ from eager by ~1e-3 there). The distances: against torch.compile at the top level,
against eager under `vs_eager`, torch.compile's own under `reference_vs_eager`. Tensors are
compared by `scaled_diff`: max|a-b| relative to the tensor's own max|a|, with a floor of 1e-3
of the largest tensor of its kind (a gradient that is zero up to rounding, a convolution's bias
before BatchNorm, would otherwise read as a difference of 18x).

The graphs judged are those of the step it ran, each once (`compiled.graph_sets`, set 0): a
recompile (a guard failure, another input shape; HF ViT recompiles at the second step) is its
own set under `recompiles`, never summed in; one that recompiles every graph of the step is
checked against the plan as the step is. The partition function's reports give what the
partitioned forward and backward graphs do:

- `compiled.saved_bytes`: activation bytes the forward graph returns for backward on the
  device (storages counted once; parameters and inputs are not activations);
- `compiled.offloaded_bytes`: bytes of the saved values offloaded to the host;
- `compiled.recomputed_ops`: forward ops of the plan's recompute chains that the backward
  graph re-runs; `compiled.rederived_views`: views it re-derives from a saved, offloaded or
  recomputed value (no FLOPs, no memory of their own: not recomputed ops), and
  `compiled.remade_constants` ops with no tensor input (a `scalar_tensor`) it re-makes;
  `compiled.off_plan_recomputes`: lined-up compute ops outside the chains it re-runs (none
  when the graph carries the plan out); `compiled.unplanned_recomputes`: compute ops that did
  not line up and that it re-runs;
- `compiled.lined_up_ops` of `compiled.graph_ops`: forward ops that lined up with the profile.

and the plan's `kept_bytes`, `swapped_bytes` and `recomputed_ops` beside them. The checks are
against the whole plan, counted as the graphs hold it (`plan.kept_bytes_in_graph`,
`plan.swapped_bytes_in_graph`): a dropout the profile traced as the CPU runs it (inside
`scaled_dot_product_attention`: float noise) is one `native_dropout` in the graph, whose mask is
bool (`plan.resized_roots`: how many roots are held in another size); a root whose op the
partitioner's CSE merged into an identical earlier one (Llama's second causal mask) is not held
twice (`plan.merged_roots`: their ops). Saved plus offloaded within 2% of kept plus swapped;
offloaded equal to swapped; no recomputed compute op outside the chains. With inductor, whose
decompositions (layer norm, batch norm, log-softmax backward, the loss) save other values
than the profile's ops, every byte saved on the device for backward (lined up or not: the
decompositions' own values included) is checked against the plan's kept bytes (at most, +2%),
and offloaded against the swapped bytes backward reads (`plan.swapped_bytes_read`; a swapped
root whose decomposed reader saves a value of its own instead, layer norm's normalized input,
has that value offloaded in its place: `compiled.substituted_swaps`; a copy inductor drops,
a KV cache's `cat` of one tensor, has the value it copies carry its decision:
`compiled.stood_in_copies`); `notes` say what was decomposed.
`plan.lined_up_kept_bytes`/`lined_up_swapped_bytes`: the plan's bytes of the roots whose ops
lined up.
"""
from __future__ import annotations

import torch

from ...errors import InputError
from ...trace.joint import loss_from_output, split_inputs
from ...trace.workload import load_workload
from ..compiled.report import graph_sets, totals
from ..compiled.tags import ACTION_TAG
from ..emit import load_patched
from .steps import rel_diff, tolerances

BYTES_TOLERANCE = 0.02


def verify_compiled(patched_path: str, model_path: str | None = None, *,
                    backend: str = "inductor", steps: int = 1, seed: int = 0,
                    also_at: dict | None = None) -> dict:
    """Compile the workload with its plan and compare it with eager and with the plan (see the
    module docstring); returns the report as plain values (`passed`, `reasons`). `also_at`:
    workload arguments (`{"seq": 24}`) whose inputs `steps` more steps take after the profiled
    ones (another shape: torch recompiles with symbolic sizes, which the plan must reach)."""
    mod = load_patched(patched_path)
    table = getattr(mod, "GRAPH_TABLE", None)
    if table is None:
        raise InputError(f"{patched_path} was written before `apply` wrote the graph table",
                         hint="run `slackswap apply` again to get a module with compile_planned")
    meta = mod.META
    if meta["device_type"] == "cuda" and not torch.cuda.is_available():
        raise InputError("the patched module was made for CUDA, but no GPU is visible",
                         hint="run verify on the machine the profile was made on")
    compiled, runs = _runs(mod, model_path, backend, seed)
    schedule = [None] * steps
    if also_at:
        schedule += [_inputs_at(mod, model_path, also_at, seed)] * steps
    diffs = _compare(runs, schedule, seed)
    eager = runs[0][0]
    loss_tol, grad_tol = (0.0, 0.0) if backend == "aot_eager" else \
        tolerances(next(eager.model.parameters()).dtype)
    got, plan, notes, reasons = _judge_graphs(table, compiled._slackswap_partitions, backend)
    recompiles = _recompiles(table, compiled._slackswap_partitions, backend, got)
    reasons += [r for rc in recompiles for r in rc["reasons"]]
    reasons += _value_reasons(diffs, loss_tol, grad_tol, REFERENCE[backend])
    if recompiles:
        notes.append(f"{len(recompiles)} recompile(s) after the first step's graphs (a guard "
                     "failure, another input shape): each is its own graph set under "
                     "`recompiles`, not summed into the step's figures")
    return {"backend": backend, "steps": len(schedule), "also_at": dict(also_at or {}),
            "reference": REFERENCE[backend],
            "compiled": got, "plan": plan, "recompiles": recompiles, **diffs,
            "tolerances": {"loss": loss_tol, "grad": grad_tol, "bytes": BYTES_TOLERANCE,
                           "ratio_to_reference": RATIO_TO_REFERENCE},
            "notes": notes, "passed": not reasons, "reasons": reasons}


def _runs(mod, model_path, backend: str, seed: int) -> tuple:
    """Copies of the workload from the same weights: (the compile_planned callable, [(workload,
    callable)]: eager, compile_planned and, with inductor, plain torch.compile)."""
    w = mod.META["workload"]
    dev = None if mod.META["device_type"] == "cpu" else mod.META["device_type"]
    models = []
    for _ in range(3 if backend == "inductor" else 2):
        torch.manual_seed(seed)
        models.append(load_workload(model_path or w["path"], w["entry"], dict(w["args"]),
                                    device=dev))
    eager, work = models[:2]
    for other in models[1:]:
        other.model.load_state_dict(eager.model.state_dict())
    # inductor draws dropout's random numbers its own way unless told to fall back to eager's
    extra = {"options": {"fallback_random": True}} if backend == "inductor" else {}
    compiled = mod.compile_planned(work.model, backend=backend, quiet=True, **extra)
    runs = [(eager, eager.model), (work, compiled)]
    if backend == "inductor":             # the reference: plain torch.compile, same options
        plain = models[2]
        runs.append((plain, torch.compile(plain.model, backend=backend, **extra)))
    return compiled, runs


def _inputs_at(mod, model_path, args: dict, seed: int):
    """The workload's inputs with `args` changed (its model is not used: the steps run the
    profiled model's weights)."""
    w = mod.META["workload"]
    dev = None if mod.META["device_type"] == "cpu" else mod.META["device_type"]
    torch.manual_seed(seed)
    return load_workload(model_path or w["path"], w["entry"], {**w["args"], **args},
                         device=dev).inputs


def _judge_graphs(table: dict, partitions, backend: str, graph_set: int = 0) -> tuple:
    """One graph set (`compiled.graph_sets`; 0: the graphs the first step ran, each once)
    against the plan: (its totals, the plan's figures beside them, notes, byte reasons)."""
    got = totals(partitions, graph_set)
    plan = _plan_numbers(table, got["lined_up_rows"], got.pop("resized_roots"),
                         got.pop("merged_rows"))
    unread = got.pop("unread_swaps")
    plan["unread_swapped_roots"] = sorted({op for op, _ in unread.values()})
    plan["swapped_bytes_read"] = plan["swapped_bytes_in_graph"] - sum(b for _, b in
                                                                       unread.values())
    notes = _notes(got, plan) if backend == "inductor" else []
    reasons = _byte_reasons(got, plan, REFERENCE[backend])
    del got["lined_up_rows"]
    return got, plan, notes, reasons


def _recompiles(table: dict, partitions, backend: str, first: dict) -> list[dict]:
    """The graph sets after the first (recompiles), each reported on its own. A set that
    recompiles every graph of the first (the same frames, as many forward ops: a guard failure
    on the whole model) is judged against the plan as the first is, and so is one with symbolic
    sizes (dynamic shapes: lined up and counted at the profiled sizes) of the same frames whose
    every forward op lined up; a partial one is shown."""
    out = []
    frames = sorted(c.split("/")[0] for c in first["compile_ids"])
    for k in range(1, len(graph_sets(partitions))):
        got, plan, _, reasons = _judge_graphs(table, partitions, backend, k)
        same_frames = sorted(c.split("/")[0] for c in got["compile_ids"]) == frames
        whole = same_frames and (got["graph_ops"] == first["graph_ops"] or (
            got["symbolic"] and got["lined_up_ops"] == got["graph_ops"]))
        out.append({"graph_set": k, "compile_ids": got["compile_ids"], "graphs": got["graphs"],
                    "graph_ops": got["graph_ops"], "lined_up_ops": got["lined_up_ops"],
                    "saved_bytes": got["saved_bytes"], "offloaded_bytes": got["offloaded_bytes"],
                    "recomputed_ops": got["recomputed_ops"], "judged": whole,
                    "symbolic": got["symbolic"], "symbols": got["symbols"],
                    "reasons": [f"recompile {k} ({', '.join(got['compile_ids'])}): {r}"
                                for r in reasons] if whole else []})
    return out


def _notes(got: dict, plan: dict) -> list[str]:
    """With inductor: what its decompositions change, and how the byte checks count it (see
    `_byte_reasons`)."""
    notes = []
    if got["decomposed_saves"]:
        notes.append(f"inductor decomposed {', '.join(got['decomposed_saves'])} before "
                     f"partitioning: backward saves {got['saved_bytes_not_lined_up']} B of "
                     f"values no profiled op makes; they count in the saved bytes checked "
                     f"against the plan's kept bytes (at most +{BYTES_TOLERANCE:.0%})")
    if got.get("substituted_swaps"):
        notes.append(f"for {got['substituted_swaps']} swapped root(s) backward reads values of "
                     f"their decomposed readers instead (layer norm's normalized input): "
                     f"those are offloaded in their place")
    if got.get("stood_in_copies"):
        notes.append(f"{got['stood_in_copies']} copy op(s) the plan keeps or swaps were dropped "
                     f"by inductor (a clone, a cat of one tensor: a KV cache's first update); "
                     f"the value they copied carries their decision")
    if plan["unread_swapped_roots"]:
        unread = plan["swapped_bytes_in_graph"] - plan["swapped_bytes_read"]
        notes.append(f"backward does not read {unread} B the plan swaps (results of "
                     f"{', '.join(plan['unread_swapped_roots'])}: "
                     f"a decomposed consumer reads another value), so the offload check counts "
                     f"the {plan['swapped_bytes_read']} B backward reads")
    return notes


REFERENCE = {"aot_eager": "eager", "inductor": "torch.compile"}
KEYS = ("max_loss_rel_diff", "max_grad_rel_diff", "first_grad_rel_diff", "max_param_rel_diff",
        "max_buffer_rel_diff")


def _compare(runs: list, schedule: list, seed: int) -> dict:
    """An AdamW step per entry of `schedule` (the inputs of that step: None for each run's own
    workload inputs) of each of `runs` ((workload, callable): eager, compile_planned and, with
    inductor, plain torch.compile) from the same seed; the largest relative differences
    (losses: `rel_diff`; gradients each step and at step 1, parameters and buffers after the last
    step: `scaled_diff`) of compile_planned against the reference (the last run) at the top
    level, against eager under `vs_eager`, and with inductor plain torch.compile's own against
    eager under `reference_vs_eager`."""
    opts = [torch.optim.AdamW(w.model.parameters(), lr=1e-2) for w, _ in runs]
    pairs = {"ref": (len(runs) - 1, 1), "vs_eager": (0, 1)}
    if len(runs) > 2:
        pairs["reference_vs_eager"] = (0, 2)
    out = {name: dict.fromkeys(KEYS, 0.0) for name in pairs}
    for k, given in enumerate(schedule):
        losses, grads = [], []
        for (w, model), opt in zip(runs, opts):
            w.model.train()
            torch.manual_seed(seed + 1 + k)
            inputs = w.inputs if given is None else given
            a, kw = split_inputs(inputs)
            loss = loss_from_output(model(*a, **kw), inputs, w.loss_fn)
            loss.backward()
            losses.append(loss.detach())
            grads.append([p.grad for p in w.model.parameters()])
            opt.step()
            opt.zero_grad(set_to_none=True)
        for name, (x, y) in pairs.items():
            d = out[name]
            d["max_loss_rel_diff"] = max(d["max_loss_rel_diff"], rel_diff(losses[x], losses[y]))
            g = scaled_diff(grads[x], grads[y])[0]
            d["max_grad_rel_diff"] = max(d["max_grad_rel_diff"], g)
            d["first_grad_rel_diff"] = g if k == 0 else d["first_grad_rel_diff"]
    for name, (x, y) in pairs.items():
        for key, of in (("max_param_rel_diff", "parameters"), ("max_buffer_rel_diff", "buffers")):
            both = [(a, b) for a, b in zip(getattr(runs[x][0].model, of)(),
                                           getattr(runs[y][0].model, of)())
                    if a.is_floating_point()]
            out[name][key] = scaled_diff(*zip(*both))[0] if both else 0.0
    return {**out.pop("ref"), **out}


SCALE_FLOOR = 1e-3


def scaled_diff(xs=(), ys=()) -> tuple[float, int | None]:
    """The largest difference of paired tensors, each relative to its own scale with a floor:
    max|x-y| / max(max|x|, SCALE_FLOOR * the largest max|x| of all the xs); and the index of
    the pair it comes from (None when there is none).

    Plain max|x-y| / max|x| blows up on a tensor that is zero up to rounding: the gradient of
    a convolution's bias before BatchNorm (BatchNorm removes the mean, so that gradient is a
    sum cancelling to ~1e-8 while the model's largest gradient is ~0.4) differed by 1.8e+01
    "relative" between eager and plain torch.compile. Measured against a floor of 1e-3 of the
    largest tensor of its kind, such a tensor says how large the difference is for the model."""
    pairs = {}
    for i, (x, y) in enumerate(zip(xs, ys)):
        if (x is None) != (y is None):
            return float("inf"), i          # a gradient on one side only
        if x is not None and x.numel():
            pairs[i] = (x.detach().double(), y.detach().double())
    if not pairs:
        return 0.0, None
    floor = SCALE_FLOOR * max(float(x.abs().max()) for x, _ in pairs.values())
    diffs = {i: float((x - y).abs().max()) / max(float(x.abs().max()), floor, 1e-30)
             for i, (x, y) in pairs.items()}
    worst = max(diffs, key=diffs.__getitem__)
    return diffs[worst], worst


def _plan_numbers(table: dict, rows: list[int], resized: dict, merged: list[int]) -> dict:
    """The plan's three numbers; its kept and swapped bytes as the compiled graphs hold them:
    the whole plan's, less what a root held in another size saves (`resized`: root -> bytes,
    a bool dropout mask for float noise), less a root only `merged` rows make (merged by the
    partitioner's CSE into an identical earlier op) and less a root only ops of the plan's
    recompute chains make (layer norm's mean and rstd, kept or swapped by the plan while a
    chain re-runs the layer norm for its result: the graph recomputes the whole op); and the
    kept and swapped bytes of the roots whose ops lined up."""
    size = {int(k): v for k, v in table["root_bytes"].items()}
    swapped_roots = set(table.get("swapped_roots", ()))
    lined_kept, lined_swapped = _roots(table, rows, size)
    gone = set().union(*_roots(table, merged, size)) - lined_kept - lined_swapped
    tagged = set().union(*_roots(table, range(len(table["ops"])), size))
    with_op = set(size) - tagged           # roots no row keeps or swaps: chain ops' results
    held = {**resized, **{t: 0 for t in gone | with_op}}
    less = {k: sum(size[t] - b for t, b in held.items() if (t in swapped_roots) == swap)
            for k, swap in (("kept", False), ("swapped", True))}
    return {"kept_bytes": table["kept_bytes"], "swapped_bytes": table["swapped_bytes"],
            "recomputed_ops": len(table["recompute_ops"]),
            "kept_bytes_in_graph": table["kept_bytes"] - less["kept"],
            "swapped_bytes_in_graph": table["swapped_bytes"] - less["swapped"],
            "resized_roots": len(resized),
            "merged_roots": [table["ops"][r].name for r in merged
                             if set(table["ops"][r].roots) & gone],
            "recomputed_with_op_bytes": sum(size[t] for t in with_op),
            "lined_up_kept_bytes": sum(size[r] for r in lined_kept),
            "lined_up_swapped_bytes": sum(size[r] for r in lined_swapped)}


def _roots(table: dict, rows, size: dict) -> tuple[set[int], set[int]]:
    """The roots of `rows` the plan keeps, and those it swaps (by the rows' tags)."""
    kept: set[int] = set()
    swapped: set[int] = set()
    for r in rows:
        row = table["ops"][r]
        for tag, root in zip(row.tags, row.roots):
            if root in size and tag in (ACTION_TAG["keep"], ACTION_TAG["swap"]):
                (swapped if tag == ACTION_TAG["swap"] else kept).add(root)
    return kept, swapped


def _reasons(got: dict, plan: dict, diffs: dict, loss_tol: float, grad_tol: float,
             reference: str = "eager") -> list[str]:
    """Why one graph set does not carry the plan out (`_byte_reasons`), or the values are off
    (`_value_reasons`)."""
    if got["graphs"] == 0:
        return ["torch.compile captured no graph with a backward: nothing was partitioned"]
    return _byte_reasons(got, plan, reference) + _value_reasons(diffs, loss_tol, grad_tol,
                                                                reference)


def _byte_reasons(got: dict, plan: dict, reference: str = "eager") -> list[str]:
    """The graphs' saved, offloaded and recomputed against the plan (as the graph holds it)."""
    reasons = []
    if got["graphs"] == 0:
        return ["torch.compile captured no graph with a backward: nothing was partitioned"]
    want = plan["kept_bytes_in_graph"] + plan["swapped_bytes_in_graph"]
    have = got["saved_bytes"] + got["offloaded_bytes"]
    swapped = plan["swapped_bytes_in_graph"]
    if reference != "eager" and (got.get("decomposed_saves") or plan.get("unread_swapped_roots")):
        # inductor's decompositions save other values than the profile's ops (`_notes`): all
        # the bytes the graphs hold on the device for backward, those values included,
        # against what the plan keeps; offloaded against the swaps backward reads
        swapped = plan["swapped_bytes_read"]
        want = plan["kept_bytes_in_graph"]
        have = got["saved_bytes"]
        if have > want * (1 + BYTES_TOLERANCE):
            reasons.append(f"the compiled graphs save {have} bytes on the device for backward "
                           f"({got['saved_bytes_not_lined_up']} of them values no profiled op "
                           f"makes), more than the plan keeps ({want}) plus "
                           f"{BYTES_TOLERANCE:.0%}")
    elif abs(have - want) > BYTES_TOLERANCE * max(want, 1):
        reasons.append(f"the compiled graphs hold {have} bytes for backward (saved plus "
                       f"offloaded), the plan {want} (kept plus swapped, in graph)")
    if got["offloaded_bytes"] != swapped:
        reasons.append(f"the compiled graphs offload {got['offloaded_bytes']} bytes, the plan "
                       f"swaps {swapped}" + (" that backward reads" if reference != "eager"
                                             else ""))
    if got["off_plan_recomputes"]:
        reasons.append(f"the backward graphs re-run ops outside the plan's recompute chains: "
                       f"{', '.join(got['off_plan_recomputes'][:8])}")
    return reasons


# With inductor compile_planned is judged by its distance from eager against plain
# torch.compile's own (both fuse and reorder): per kind, at most this many times torch.compile's
# distance plus the fp32 tolerance, or bitwise equal to torch.compile. Attention key biases
# (BERT) have a true gradient of 0: both get rounding-level gradients there, which AdamW turns
# into lr-sized steps, so parameters after a few steps differ from eager by ~1e-3 for either.
RATIO_TO_REFERENCE = 4.0
VALUE_KINDS = (("loss", "max_loss_rel_diff"), ("step-1 gradients", "first_grad_rel_diff"),
               ("parameters", "max_param_rel_diff"), ("buffers", "max_buffer_rel_diff"))


def _value_reasons(diffs: dict, loss_tol: float, grad_tol: float,
                   reference: str = "eager") -> list[str]:
    """Against eager (aot_eager): every step's loss and gradients, the parameters and buffers
    after the last, within the tolerances (0: bitwise). Against torch.compile (inductor): per
    kind bitwise equal to it, or no further from eager than RATIO_TO_REFERENCE times its own
    distance from eager plus the tolerance."""
    if reference == "eager":
        if all(diffs[k] <= (loss_tol if k == "max_loss_rel_diff" else grad_tol)
               for k in ("max_loss_rel_diff", "max_grad_rel_diff", "max_param_rel_diff",
                         "max_buffer_rel_diff")):
            return []
        return [f"compile_planned differs from eager: loss by {diffs['max_loss_rel_diff']:.2e}, "
                f"gradients by {diffs['max_grad_rel_diff']:.2e}, parameters by "
                f"{diffs['max_param_rel_diff']:.2e}, buffers by "
                f"{diffs['max_buffer_rel_diff']:.2e} (relative)"]
    mine, base = diffs["vs_eager"], diffs["reference_vs_eager"]
    bad = []
    for kind, key in VALUE_KINDS:
        allowed = RATIO_TO_REFERENCE * base[key] + (loss_tol if kind == "loss" else grad_tol)
        if diffs[key] > 0 and mine[key] > allowed:
            bad.append(f"{kind} {mine[key]:.2e} (torch.compile {base[key]:.2e}, allowed "
                       f"{allowed:.2e})")
    return [f"compile_planned is further from eager than {reference} is: " + ", ".join(bad)] \
        if bad else []
