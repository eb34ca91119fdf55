"""The plan as a graph runtime needs it: a choice per forward op, matched to another graph's ops.

`compile_planned` (run/compiled/backend.py) tags the joint graph that torch.compile captures, and
`sac_policy` (run/compiled/sac.py) answers `torch.utils.checkpoint`'s policy questions. Neither sees the
graph the profile was traced from: dynamo's graphs hold the model in pieces (graph breaks, one
graph per compiled block) and inductor decomposes some ops first. Both therefore line the ops
they see up with the profile's forward ops by (aten op overload, occurrence, output shapes and
dtypes), and carry out the plan only where an op lines up.

`graph_table(profile, plan)` (plain Python values, written into the patched module as
`GRAPH_TABLE`):

- `ops`: the forward ops in order, each a `table_rows.GraphRow` with
  `results` = `[[shape, dtype], ...]` of the op's tensor results and `tags[i]` what the plan
  does with result i: `"recompute"` (the op re-runs in a recompute chain of the plan),
  `"save"` (a saved root it keeps), `"offload"` (a saved root it swaps) or None (a view of a
  root, a temporary, a root backward does not read: left to torch); `roots[i]` the saved root
  whose decision result i carries (itself, or the root an in-place op writes), or None;
- `kept_bytes`, `swapped_bytes`: bytes of the saved roots kept and swapped; `root_bytes`:
  root id -> bytes, for the kept and swapped roots; `swapped_roots`: the swapped ones' ids;
  `recompute_ops`: names of the forward ops the plan's chains re-run;
- `container`: the module path of the repeated blocks (`layers.layer_container`), if any;
- `copies`: row -> [base row, result index] for an op copying one whole earlier result
  (`copies`), which inductor may drop: the base then carries the copy's decision;
- `inputs`: `[shape, dtype]` of the profiled step's inputs (a graph with symbolic sizes is
  read at these: `run/compiled/sym_sizes.py`).

`line_up(seen, ops)`: for each key seen (`op_key`), the index of the profile op it lines up
with, or None; a longest matching of the two key sequences in order (difflib), so an op
missing on either side (a decomposed op, a wrapper's own op) shifts nothing after it.

`graph_units(ops, rows)`: the rows as a captured graph holds them. A profile traces dropout
that C++ code calls (`scaled_dot_product_attention`'s math path calls `at::dropout`) as the CPU
kernel runs it: `empty_like`, `bernoulli_`, `div_` (the scaled noise, a float tensor) and `mul`;
AOTAutograd decomposes `aten.dropout` into `native_dropout` (the result and a bool mask) on
every device. Such a run of four rows is one unit, lined up with `native_dropout`: its result
carries `mul`'s decision, its mask the noise's (a bool mask, a quarter of the float noise's
bytes in fp32: `verify --compile` counts such a root at the size the graph holds it).
"""
from __future__ import annotations

import difflib

from ...chains import runtime_table
from ...errors import InputError
from ...layers import layer_container
from ...schema import Action, Plan, Profile
from ...table_rows import GraphRow
from ...trace.aten import is_inplace_target
from .tags import ACTION_TAG, RECOMPUTE


def graph_table(profile: Profile, plan: Plan) -> dict:
    """The plan per forward op (see the module docstring)."""
    runtime = runtime_table(profile, plan.decisions, is_inplace_target)
    nf = runtime["n_forward"]
    chain_ops = sorted({p for ops in runtime["chains"].values() for p in ops})
    actions = plan.actions()
    saved_roots = {t.id: str(actions.get(t.id, Action.KEEP)) for t in profile.saved_activations}
    in_chain = set(chain_ops)
    ops = []
    for i, o in enumerate(profile.ops[:nf]):
        decided = [r if (r := _decided(profile, o, t)) in saved_roots else None
                   for t in o.outputs]
        tags = [(RECOMPUTE if i in in_chain else
                 ACTION_TAG[saved_roots[r]] if r is not None else None) for r in decided]
        ins = [list(profile.tensors[t].shape) for t in o.inputs]
        outs = [[list(profile.tensors[t].shape), profile.tensors[t].dtype] for t in o.outputs]
        ops.append(GraphRow(name=o.name, target=o.target, module=o.module, results=outs,
                            tags=tags, input_shapes=ins, roots=decided))
    size = {t.id: t.size_bytes for t in profile.saved_activations}
    return {
        "ops": ops,
        "root_bytes": {t: size[t] for t, a in saved_roots.items()
                       if a in (Action.KEEP, Action.SWAP)},
        "swapped_roots": sorted(t for t, a in saved_roots.items() if a == Action.SWAP),
        "kept_bytes": sum(size[t] for t, a in saved_roots.items() if a == Action.KEEP),
        "swapped_bytes": sum(size[t] for t, a in saved_roots.items() if a == Action.SWAP),
        "recompute_ops": [profile.ops[p].name for p in chain_ops],
        "container": layer_container(o.module for o in profile.ops[:nf]),
        "copies": copies(profile, nf),
        # the model's inputs in the profiled step: a graph captured with symbolic sizes
        # reads them at these (run/compiled/sym_sizes.py)
        "inputs": [[list(t.shape), t.dtype] for t in profile.tensors if t.kind == "input"],
    }


# Ops inductor's joint-graph pass may remove before partitioning (`remove_noop_ops`: a clone with
# its input's layout; inductor's `cat` decomposition drops legacy empty inputs, and a cat of one
# tensor is a clone of it): Hugging Face's KV cache `torch.cat([empty, key_states])`
COPY_OPS = ("aten.clone.default", "aten.cat.default")


def copies(profile: Profile, nf: int) -> dict[int, list[int]]:
    """row -> [base row, result index] for each forward op that copies one tensor (COPY_OPS,
    all other inputs empty) whose storage (through views) is a whole result of an earlier
    forward op: where the graph drops the copy, backward reads that result instead, and the
    copy's decision is carried by it (`backend.PlanPartition`)."""
    out: dict[int, list[int]] = {}
    tensors = profile.tensors
    for i, o in enumerate(profile.ops[:nf]):
        if o.target not in COPY_OPS or len(o.outputs) != 1:
            continue
        full = [t for t in o.inputs if tensors[t].size_bytes > 0]
        if len(full) != 1:
            continue
        t = full[0]
        base = tensors[t].alias_of if tensors[t].alias_of is not None else t
        prod = tensors[base].producer
        if prod is None or not 0 <= prod < i or \
                tensors[base].size_bytes != tensors[o.outputs[0]].size_bytes:
            continue
        out[i] = [prod, list(profile.ops[prod].outputs).index(base)]
    return out


# AOTAutograd functionalizes the graph it compiles: an in-place op becomes its out-of-place
# twin (`relu_` -> `relu`) and BatchNorm's hidden running-statistics writes become extra results
# (`_native_batch_norm_legit_functional`: native_batch_norm's 3 results, then the 2 new running
# statistics). Keys name both sides alike.
FUNCTIONAL_TWINS = {"aten._native_batch_norm_legit_functional.default":
                    "aten.native_batch_norm.default"}


# C++ `at::matmul` folds batch dimensions with `_unsafe_view`, its Python decomposition (which
# AOTAutograd runs) with `view`: the same free view. Autograd's view of a saved output is
# `detach` in AOTAutograd's graph (and in torch 2.13's make_fx trace, the profile's) and
# `alias` in torch 2.15's make_fx trace: the same free view.
FREE_VIEW_TWINS = {"aten._unsafe_view.default": "aten.view.default",
                   "aten.alias.default": "aten.detach.default"}


def _decided(profile: Profile, op, t: int) -> int:
    """The tensor whose decision result `t` of `op` carries in a functional graph: itself, or
    for an in-place op (`relu_`) the root it writes, whose new value the functional twin
    (`relu`) makes as a fresh tensor."""
    root = profile.tensors[t].alias_of
    in_place = op.target.split(".")[1:2] and op.target.split(".")[1].endswith("_")
    return root if root is not None and in_place else t


def op_key(target: str, outputs) -> tuple:
    """What two ops must share to line up: the op (its functional form) and its first result's
    shape and dtype."""
    name = FUNCTIONAL_TWINS.get(str(target), str(target))
    name = FREE_VIEW_TWINS.get(name, name)
    parts = name.split(".")
    if len(parts) == 3 and parts[1].endswith("_") and not parts[1].endswith("__"):
        parts[1] = parts[1][:-1]           # in place -> out of place
    # the first result only: a decomposed op (inductor's `native_layer_norm`) keeps the
    # results backward reads, not always the op's (and functional twins add results)
    outs = list(outputs)[:1]
    return (".".join(parts), tuple((tuple(s), str(d)) for s, d in outs))


def line_up(seen: list[tuple], ops: list[GraphRow]) -> list[int | None]:
    """For each key in `seen`, the index into `ops` (graph_table rows) it lines up with."""
    want = [op_key(o.target, o.results) for o in ops]
    match = difflib.SequenceMatcher(None, seen, want, autojunk=False)
    out: list[int | None] = [None] * len(seen)
    for a, b, n in match.get_matching_blocks():
        for k in range(n):
            out[a + k] = b + k
    return out


def block_rows(table: dict, block: str | None) -> list[int]:
    """Indices of the rows of `table["ops"]` that run inside module `block` (all for None or
    the empty string: the whole model)."""
    if not block:
        return list(range(len(table["ops"])))
    return [i for i, o in enumerate(table["ops"])
            if o.module == block or o.module.startswith(block + ".")]


def block_name(table: dict, index: int) -> str:
    """The module path of repeated block `index` (`transformer.h.3`)."""
    container = table.get("container")
    if container is None:
        raise InputError("the profiled model has no repeated blocks (no numbered submodules)",
                         hint="use compile_planned(model) on the whole model")
    name = f"{container}.{index}" if container else str(index)
    if not block_rows(table, name):
        raise InputError(f"block {index} ({name}) runs no profiled op",
                         hint=f"blocks are the numbered children of `{container}`")
    return name


CPU_DROPOUT = ("aten.empty_like.default", "aten.bernoulli_.float", "aten.div_.Scalar",
               "aten.mul.Tensor")


def graph_units(ops: list[GraphRow], rows: list[int]) -> list[tuple[GraphRow, list[int]]]:
    """`rows` (indices into `ops`) as (row, the rows it stands for): each row itself, or a CPU
    dropout run folded into one `native_dropout` row (see the module docstring)."""
    units, k = [], 0
    while k < len(rows):
        run = rows[k:k + 4]
        if _cpu_dropout(ops, run):
            empty, mul = ops[run[0]], ops[run[3]]
            mask = [empty.results[0][0], "bool"]
            units.append((mul._replace(target="aten.native_dropout.default",
                                       results=[mul.results[0], mask],
                                       tags=[mul.tags[0], empty.tags[0]],
                                       roots=[mul.roots[0], empty.roots[0]]), run))
            k += 4
        else:
            units.append((ops[rows[k]], [rows[k]]))
            k += 1
    return units


def _cpu_dropout(ops: list[GraphRow], run: list[int]) -> bool:
    """Whether rows `run` are `at::dropout` as the CPU runs it: consecutive, the four ops of
    CPU_DROPOUT on one shape, `bernoulli_` and `div_` writing `empty_like`'s noise."""
    if len(run) != 4 or run[3] - run[0] != 3:
        return False
    rows = [ops[r] for r in run]
    if tuple(r.target for r in rows) != CPU_DROPOUT or any(len(r.results) != 1 for r in rows):
        return False
    shape = rows[0].results[0][0]
    return (all(r.results[0][0] == shape for r in rows)
            and rows[1].roots[0] == rows[2].roots[0] == rows[0].roots[0])
