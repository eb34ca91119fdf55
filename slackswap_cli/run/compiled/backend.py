"""`compile_planned(model)`: the plan carried out inside `torch.compile`.

How the plan reaches the graph. torch.compile hands AOTAutograd's joint forward+backward graph
of each captured piece (one per graph break, one per compiled block) to a *partition function*
that splits it into the forward and backward graphs. `compile_planned` passes its own
(`PlanPartition`): it lines the graph's forward ops up with the profile's (`graph_plan.line_up`:
op overload, occurrence, result shapes and dtypes), tags what lines up and then calls torch's
own `min_cut_rematerialization_partition`:

- a root the plan keeps: `node.meta["recompute"] = MUST_SAVE` (the partitioner may not
  recompute it, so it is saved when backward reads it);
- an op a recompute chain of the plan re-runs: `MUST_RECOMPUTE` (the partitioner re-runs it in
  backward, from what is saved);
- a root the plan swaps: `MUST_SAVE` and `should_offload`; after partitioning, the saved value
  is offloaded with torch's own insertion passes (`_activation_offloading`): `device_put` to
  the host after its last forward use and back before its first backward use; on CUDA with
  torch's `ao.offload`/`ao.reload` on a side stream, waits sunk to the end of forward and
  reloads prefetched (`activation_offload_sink_wait`, `activation_reload_prefetch`). torch's
  own chooser (`choose_offload_sets`) refuses getitem nodes, so every output of a multi-output
  op (layer norm's result, dropout's mask) would stay on the device; slackswap marks the
  nodes itself (`saved_for_offloading`) and refuses only what the insertion cannot carry:
  views, tensors that do not cover their storage and graph inputs (counted as `refused`). A
  saved value that is also a model output (a KV cache's tensor) is offloaded for backward
  while the caller gets the device tensor, as in eager (torch's own chooser refuses it).

A CPU dropout run of the profile (`scaled_dot_product_attention`'s math path calls `at::dropout`
from C++, traced as `empty_like`, `bernoulli_`, `div_`, `mul`) lines up with the graph's
`native_dropout` (`graph_plan.graph_units`); where the plan recomputes its result and keeps its
mask, a graph holding native_dropout as one random node (aot_eager; inductor with
`fallback_random`) gets the result re-made as `input * mask * scale`, equal bit for bit in
fp32, so backward can recompute it (inductor without it decomposes native_dropout itself).
Views of an offloaded or recomputed result are re-derived in backward (tagged MUST_RECOMPUTE;
`verify` counts them apart from recomputed ops). The partitioner's CSE runs first; rows that
line up only before it (an op merged into an identical earlier one) are reported as merged.

Inductor changes the graph before partitioning in two ways the plan is carried through: its
no-op removal drops a copy (a `clone` keeping its input's layout, a `cat` of one tensor: a
Hugging Face KV cache's first `torch.cat([empty, key_states])`), whose row then lines up with
nothing: the op whose whole result it copied (`graph_plan.copies`) takes its decision
(`_stand_in_copies`); and a decomposed reader (layer norm) may read values of its own instead
of a root the plan swaps: those are offloaded in the root's place (`_substitute_unread`).
And the partitioner may move the part of a decomposed backward op that reads only one
offloaded or recomputed root into forward and save its result instead (GPT-2's
`1 - tanh(x)**2`, a transposed copy of an attention input): every value made from such roots
alone is re-derived in backward (`compiled_derived.tag_derived`), so the root is what is saved.

Ops that do not line up are left to the partitioner; how many line up is said once per graph
on stderr. Nothing global changes: the backend is an `aot_autograd` backend or inductor with
`options={"custom_partitioner_fn": ..., "fx_graph_cache": False}`, both scoped to this compiled
object (the FX-graph and AOTAutograd caches key on the captured graph, not on the plan, so a
cached graph would skip the partition: they are off for it).

Private torch API used (tested with torch 2.13, 2.14 and 2.15: `torch_api.PARTS["compile"]`,
other versions are refused by name; the list of all of slackswap's is `torch_api.PRIVATE_API`):
`torch._functorch.partitioners.min_cut_rematerialization_partition` (and `get_default_op_list`),
`torch._functorch.compile_utils.fx_graph_cse`, `torch._functorch.config.cse`,
`torch._functorch._activation_offloading.activation_offloading` (offload_chosen_sets,
offload_chosen_sets_async, activation_offload_sink_wait_async,
activation_reload_prefetch_async, CPU_OFFLOAD_PREFIX), `torch._dynamo.backends.common
.aot_autograd`, `torch._dynamo.backends.debugging.boxed_nop`,
`torch._inductor.custom_graph_pass.CustomPartitionerFn`, and the node meta keys `recompute`,
`should_offload`, `saved_for_offloading`.
"""
from __future__ import annotations

import inspect
import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch._guards import CompileContext
from torch.utils.checkpoint import CheckpointPolicy

from ...errors import InputError
from ...profile_build import dtype_name
from ...table_rows import GraphRow
from ...torch_api import PARTS, refuse_untested
from ...trace.aten import returns_view
from ...trace.storage import storage_object_key
from ..notes import tell
from .derived import tag_derived
from .graph_plan import block_name, block_rows, graph_units, line_up, op_key
from .sac import POLICY_OF_TAG
from .sym_sizes import SymSizes, solve

TESTED_TORCH = PARTS["compile"].tested
BACKENDS = ("inductor", "aot_eager")
# AOTAutograd's graph detaches some saved outputs (attention's, log_softmax's); the profile's
# trace has them as `detach` (torch 2.13's make_fx) or `alias` (2.14's, 2.15's), which line up
# (graph_plan.FREE_VIEW_TWINS). A detach that still lines up with no profile op is autograd's
# bookkeeping (a view: no FLOPs, no bytes), not an op of the model: not counted as a graph op
AUTOGRAD_ONLY = frozenset({"aten.detach.default"})


def check_torch_version() -> None:
    """Refuse a torch whose partitioner internals this runtime was not tested with
    (`torch_api.PARTS["compile"]`)."""
    refuse_untested("compile")


@dataclass
class GraphReport:
    """What one partitioned graph carries out (bytes dedupe storages)."""
    graph_ops: int                 # forward ops of the joint graph (getitems not counted, nor
    #                                a detach that lines up with no profile op: AUTOGRAD_ONLY)
    lined_up_ops: int              # of those, lined up with a profile op
    saved_bytes: int = 0           # activation bytes saved for backward on the device
    saved_bytes_not_lined_up: int = 0   # of those, results of ops that did not line up
    offloaded_bytes: int = 0       # activation bytes offloaded to the host
    recomputed_ops: list[str] = field(default_factory=list)   # profile names re-run in bwd
    off_plan_recomputes: list[str] = field(default_factory=list)  # lined up, not a view,
    #                                not in the plan's chains, yet re-run in backward
    rederived_views: int = 0       # views re-derived in backward (of a recomputed, offloaded
    #                                or saved value: no FLOPs, no memory of their own)
    remade_constants: int = 0      # ops with no tensor input (scalar_tensor) re-run in backward
    unplanned_recomputes: int = 0  # compute ops that did not line up, re-run in backward
    merged_rows: list[int] = field(default_factory=list)  # graph_table rows that line up
    #                                only before the partitioner's CSE merged them into an
    #                                identical earlier op (Llama's second causal mask)
    resized_roots: dict = field(default_factory=dict)  # root -> bytes the graph holds it in,
    #                                where not the profile's (a bool dropout mask for float noise)
    refused_offloads: int = 0      # swapped roots the offload insertion cannot carry (kept)
    unread_swaps: dict = field(default_factory=dict)  # root -> (op, bytes): swapped roots
    #                                backward does not read (neither saved nor offloaded: a
    #                                decomposed consumer, inductor's layer norm, reads another
    #                                value), or a decomposition does not make as a value
    decomposed_saves: list[str] = field(default_factory=list)  # ops (original_aten) whose
    #                                decomposition made values saved that did not line up
    rows: list[int] = field(default_factory=list)   # graph_table rows that lined up
    substituted: dict = field(default_factory=dict)  # swapped root backward does not read
    #                                -> the values its decomposed readers save, offloaded
    stood_in: dict = field(default_factory=dict)   # copy row the graph dropped -> the node
    #                                holding its base, which carries its decision instead
    compile_id: str = ""           # dynamo's "frame/compile of that frame" ("0/1": frame 0's
    #                                first recompile: a guard failure, another shape)
    saved_names: list[str] = field(default_factory=list)
    offloaded_names: list[str] = field(default_factory=list)
    symbolic: bool = False         # captured with symbolic sizes (dynamic shapes): lined up
    #                                and counted at the profiled sizes
    symbols: dict = field(default_factory=dict)   # symbol -> its value in the profiled step


class PlanPartition:
    """The partition function of one `compile_planned` call (see the module docstring).

    `rows`: the graph_table rows this compiled object may hold (all, or one block's), in
    order; graphs are matched against the rows after the last one matched before (graph
    breaks come in execution order), or against all rows when that lines up too little (a
    recompile)."""

    def __init__(self, table: dict, rows: list[int], *, label: str = "", quiet: bool = False):
        self.table, self.rows, self.label, self.quiet = table, rows, label, quiet
        self.cursor = 0
        self.reports: list[GraphReport] = []

    # the partitioner ----------------------------------------------------------------------
    def __call__(self, gm: fx.GraphModule, joint_inputs, **kwargs):
        # (torch's private partitioner APIs are imported where used, after the version
        # check: `refuse_untested` names a torch outside the tested set before they load)
        from torch._functorch import config as functorch_config
        from torch._functorch.partitioners import min_cut_rematerialization_partition
        merged: set[int] = set()
        n_out = kwargs["num_fwd_outputs"]
        sizes = solve(gm, self._candidates(), dtype_name)
        if functorch_config.cse:
            # the partitioner merges identical ops first (Llama's two causal masks): merged
            # before lining up; the rows that line up only before the merge are reported
            before = _rows(self._match(_graph_ops(_split(gm, n_out)[0], sizes)))
            gm.graph = _partitioner_cse(gm, n_out)
            gm.recompile()
        fwd_nodes, after_tangent = _split(gm, n_out)
        graph_ops = _graph_ops(fwd_nodes, sizes)
        matched, stood, copied = self._tag(gm, graph_ops, after_tangent)
        if functorch_config.cse:
            merged = before - _rows(matched)
        merged |= copied
        kwargs.setdefault("compiler", "inductor")
        fw, bw = min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)
        substituted = _substitute_unread(fw, n_out, graph_ops, matched, sizes)
        refused = _offload(fw, bw, n_out, _on_cuda(gm), sizes)
        report = _measure(fw, bw, n_out, graph_ops, matched, self.table, sizes, substituted)
        report.refused_offloads = refused
        report.merged_rows = sorted(merged)
        report.rows = sorted(set(report.rows) | set(stood))
        report.stood_in = {r: h.name for r, h in stood.items()}
        _measure_stood_in(report, stood, self.table, sizes)
        report.compile_id = _compile_id()
        report.symbolic, report.symbols = sizes.symbolic, sizes.solved()
        self.reports.append(report)
        if not self.quiet:
            self._say(report)
        return fw, bw

    def _say(self, report: GraphReport) -> None:
        """One line on stderr per graph: how much of it lines up."""
        where = f" ({self.label})" if self.label else ""
        extra = f"; {report.refused_offloads} swap(s) kept: not offloadable" \
            if report.refused_offloads else ""
        if report.symbolic:
            at = ", ".join(f"{k}={v}" for k, v in report.symbols.items())
            extra += (f"; dynamic shapes, lined up at the profiled sizes ({at}): the plan holds "
                      f"at every size" if at else "; dynamic shapes whose sizes match no "
                      "profiled input: re-profile at a shape this graph takes")
        tell(f"compiled graph {len(self.reports)}{where}: "
             f"{report.lined_up_ops} of {report.graph_ops} forward ops line up with the "
             f"profile, {report.graph_ops - report.lined_up_ops} left to torch's "
             f"partitioner{extra}")

    def _candidates(self) -> list[tuple[list, str | None]]:
        """The shapes a graph's inputs may have had in the profiled step: the model's inputs,
        then the inputs of this object's rows in order (a block's graph reads hidden states)."""
        ops = self.table["ops"]
        out = [(list(s), d) for s, d in self.table.get("inputs", ())]
        out += [(list(s), None) for r in self.rows for s in ops[r].input_shapes]
        return out

    def _match(self, graph_ops: list[GraphOp]) -> dict[GraphOp, tuple[GraphRow, list[int]]]:
        """Line the graph's ops up with the rows; op -> (the row it lined up with, the table
        rows that row stands for: `graph_plan.graph_units`)."""
        keys = [op_key(g.target, g.results()) for g in graph_ops]
        ops = self.table["ops"]

        def attempt(start: int) -> dict[GraphOp, tuple[GraphRow, list[int]]]:
            units = graph_units(ops, self.rows[start:])
            got = line_up(keys, [u[0] for u in units])
            return {g: units[k] for g, k in zip(graph_ops, got) if k is not None}

        matched = attempt(self.cursor)
        if self.cursor and len(matched) < 0.5 * len(graph_ops):
            matched = attempt(0)
        return matched

    def _tag(self, gm: fx.GraphModule, graph_ops: list[GraphOp], after_tangent: set[fx.Node]
             ) -> tuple[dict[GraphOp, tuple[GraphRow, list[int]]], dict[int, fx.Node], set[int]]:
        """Line the graph's ops up (`_match`) and tag what lines up; returns the line-up, the
        copy rows whose base stands in for them and the copy rows held as their base's
        (`_stand_in_copies`)."""
        matched = self._match(graph_ops)
        if matched:
            self.cursor = self.rows.index(max(_rows(matched))) + 1
        moved: set[fx.Node] = set()      # offloaded and recomputed results
        for g, (row, _) in matched.items():
            moved |= _tag_op(g, row)
        stood, copied = _stand_in_copies(self.table, set(self.rows), matched)
        for r, h in stood.items():
            tag = self.table["ops"][r].tags[0]
            h.meta["recompute"] = CheckpointPolicy.MUST_SAVE
            h.meta["should_offload"] = tag == "offload"
            if tag == "offload":
                moved.add(h)
        _tag_views(gm, moved, after_tangent)
        tag_derived(gm, moved, after_tangent)
        return matched, stood, copied


def _stand_in_copies(table: dict, rows: set[int], matched: dict
                     ) -> tuple[dict[int, fx.Node], set[int]]:
    """The copy rows (`graph_plan.copies`: clone, a cat of one tensor) the graph dropped
    (inductor's no-op removal before partitioning: Hugging Face's KV cache
    `torch.cat([empty, key_states])`): backward reads the copied result instead. Where the
    plan keeps or swaps the copy and leaves its base to torch, the base's holder takes the
    copy's decision (returned: row -> node); where the plan decides the base itself, the copy
    is held as the base (returned as merged rows: not held twice)."""
    lined = {r: (g, row) for g, (row, members) in matched.items() for r in members}
    stood: dict[int, fx.Node] = {}
    copied: set[int] = set()
    for r, (base, k) in table.get("copies", {}).items():
        tag = table["ops"][r].tags[0]
        if r not in rows or r in lined or base not in lined or tag not in ("save", "offload"):
            continue
        g, row = lined[base]
        hs = g.holders_for(row.results)
        if k >= len(hs) or not hs[k]:
            continue
        if row.tags[k] is None and not any(h in stood.values() for h in hs[k]):
            stood[r] = hs[k][0]
        else:
            copied.add(r)
    return stood, copied


def _compile_id() -> str:
    """Dynamo's id of the compile running now ("frame/compile of that frame"), or ""."""
    cid = CompileContext.current_compile_id()
    return "" if cid is None else f"{cid.frame_id}/{cid.frame_compile_id}"


def _rows(matched: dict) -> set[int]:
    """The table rows a line-up (`PlanPartition._match`) holds."""
    return {r for _, members in matched.values() for r in members}


def _tag_op(g: GraphOp, row: GraphRow) -> set[fx.Node]:
    """Tag one lined-up op as the plan decides its results; returns the result nodes it
    offloads or recomputes.

    Every node of the op takes the op's policy (a decomposition's inner nodes only when it is
    recomputed; otherwise they are left to the partitioner). One op whose results the plan
    decides differently (`native_dropout` standing for a CPU dropout run: its result
    recomputed, its mask kept) gets a policy per result. Inductor without `fallback_random`
    decomposes native_dropout (the mask, then the products); otherwise it is one random node
    that cannot re-run, so its result is re-made from the mask (`_dropout_from_mask`) to be recomputed; where it cannot be
    (not fp32), the node is saved and its result left to the partitioner (which saves it)."""
    tags = row.tags
    kept = any(t in ("save", "offload") for t in tags)
    mixed = kept and "recompute" in tags
    made = _dropout_from_mask(g) if mixed and not g.decomposed and tags[0] == "recompute" \
        else None
    if "recompute" in tags and not mixed:
        policy = CheckpointPolicy.MUST_RECOMPUTE
    elif kept:
        policy = CheckpointPolicy.MUST_SAVE
    else:
        return set()
    for n in g.nodes if policy == CheckpointPolicy.MUST_RECOMPUTE or not g.decomposed else ():
        n.meta["recompute"] = policy
    for n in made or ():
        n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
    g.nodes += made or []
    # the re-made result is recomputed: its views are re-derived in backward, not saved (a
    # saved view would hold the forward's result on the device)
    moved: set[fx.Node] = {made[-1]} if made else set()
    for tag, hs in zip(tags, g.holders_for(row.results)):
        own = policy if not mixed else None if tag == "recompute" and not g.decomposed \
            else POLICY_OF_TAG.get(tag)
        for h in hs if own is not None else ():
            h.meta["recompute"] = own
            if tag in ("offload", "recompute"):
                h.meta["should_offload"] = tag == "offload"
                moved.add(h)
    return moved


def _dropout_from_mask(g: GraphOp) -> list[fx.Node] | None:
    """For one `native_dropout` node of fp32: its result re-made as `input * mask * scale`
    (equal to native_dropout's bit for bit in fp32: the mask is 0 or 1), so that backward can
    recompute it from the saved mask; returns the new nodes, or None where it does not apply."""
    node = g.nodes[0]
    if node.target is not torch.ops.aten.native_dropout.default or len(node.args) < 2:
        return None
    holders = _holders(node)
    out, mask = (hs[0] if hs else None for hs in (holders + [[], []])[:2])
    x, p = node.args[0], node.args[1]
    if out is None or mask is None or out.meta["val"].dtype != torch.float32 \
            or not isinstance(p, float) or not 0 < p < 1:
        return None
    graph = node.graph
    with graph.inserting_after(mask):
        masked = graph.call_function(torch.ops.aten.mul.Tensor, (x, mask))
    with graph.inserting_after(masked):
        result = graph.call_function(torch.ops.aten.mul.Tensor, (masked, 1.0 / (1.0 - p)))
    for n in (masked, result):
        n.meta["val"] = out.meta["val"]
    out.replace_all_uses_with(result)
    graph.erase_node(out)
    return [masked, result]


def _tag_views(gm: fx.GraphModule, moved: set[fx.Node], after_tangent: set[fx.Node]) -> None:
    """Views of an offloaded or recomputed result are re-derived in backward: the partitioner
    may save a view of a root instead of the root itself (free, as views are), but a view
    cannot be offloaded and a saved view of a recomputed root would keep its storage.

    A view is a node sharing such a result's storage, or a view op (by its schema) of one
    (fake tensors do not always share the storage of a view of a view)."""
    storages = {_storage(n) for n in moved}
    derived = set(moved)
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target is operator.getitem or n in after_tangent:
            continue
        base = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
        if n in moved or not (_storage(n) in storages or (_is_view(n) and base in derived)):
            continue
        derived.add(n)
        n.meta.setdefault("recompute", CheckpointPolicy.MUST_RECOMPUTE)


def _is_view(node: fx.Node) -> bool:
    """Whether `node` is a view op (`trace.aten.returns_view`: the schema says its result
    aliases an input, unwritten, or it is a view the schema does not declare, such as
    `_unsafe_view`: C++ `at::matmul` folds batch dimensions with it, and `reshape` of an
    expanded tensor - grouped-query attention's repeat_kv - is `clone` then `_unsafe_view`)."""
    return returns_view(node.target)


def _split(gm: fx.GraphModule, num_fwd_outputs: int | None = None
           ) -> tuple[list[fx.Node], set[fx.Node]]:
    """(the joint graph's forward ops in order, the nodes that depend on a tangent).

    Forward ops: call_function nodes that depend on no tangent and that AOTAutograd did not
    tag as backward (weight transposes for backward matmuls depend on no tangent either),
    nor untagged nodes that feed only backward (no forward output is computed from them:
    inductor's joint-graph passes replace backward ops with new nodes without AOTAutograd's
    tag, as nll_loss's backward with `iota`, `eq` and `scalar_tensor`s that read only the
    labels); getitems count as part of their op."""
    after: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if (n.op == "placeholder" and n.name.startswith("tangent")) or \
                any(a in after for a in n.all_input_nodes):
            after.add(n)
    feeds = _feeding_forward(gm, num_fwd_outputs)
    fwd = [n for n in gm.graph.nodes if n.op == "call_function" and n not in after
           and n.target is not operator.getitem and not _writes_back(n)
           and n.meta.get("partitioner_tag") != "is_backward"
           and (feeds is None or n in feeds or n.meta.get("partitioner_tag") == "is_forward")]
    return fwd, after


def _feeding_forward(gm: fx.GraphModule, num_fwd_outputs: int | None) -> set[fx.Node] | None:
    """The nodes some forward output of the joint graph is computed from (None: unknown)."""
    if num_fwd_outputs is None:
        return None
    outs = gm.graph.find_nodes(op="output")[0].args[0]
    stack = [a for a in list(outs)[:num_fwd_outputs] if isinstance(a, fx.Node)]
    seen: set[fx.Node] = set()
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


@dataclass(eq=False)
class GraphOp:
    """One op of the model as the captured graph holds it: one node, or the run of nodes a
    decomposition made of it (inductor decomposes `gelu`, `native_layer_norm`, ... before
    partitioning; each node records the op it came from in `meta["original_aten"]`)."""
    nodes: list[fx.Node]
    target: str
    decomposed: bool
    order: dict          # node -> position in the graph (shared by the graph's ops)
    sizes: SymSizes      # how its sizes read (symbolic ones at the profiled values)

    def outputs(self) -> list[fx.Node]:
        """The nodes holding the op's tensor results: for one node, its result (or the first
        getitem picking each); for a decomposition, the nodes read from outside the run."""
        if not self.decomposed:
            return [hs[0] for hs in _holders(self.nodes[0]) if hs]
        inside = set(self.nodes) | {u for n in self.nodes for u in n.users
                                    if u.target is operator.getitem}
        outs = [m for m in sorted(inside, key=self.order.__getitem__)
                if isinstance(m.meta.get("val"), torch.Tensor)
                and any(u not in inside for u in m.users)]
        # the op's own result first: the last one forward reads on (the others are what the
        # decomposed backward reads: layer norm's mean and rstd, or an inner value)
        main = [m for m in outs if any(u not in inside and u.meta.get("partitioner_tag")
                                       != "is_backward" for u in m.users)]
        return sorted(outs, key=lambda m: m is not (main or outs)[-1])

    def results(self) -> list[tuple[tuple, str]]:
        return [_outputs(n, self.sizes)[0] for n in self.outputs()] if self.decomposed else \
            _outputs(self.nodes[0], self.sizes)

    def holders_for(self, row_outputs: list) -> list[list[fx.Node]]:
        """For each result of the profile's op (`[shape, dtype]`), the nodes holding it here:
        results are paired in order among those of the same shape and dtype."""
        if not self.decomposed:
            return _holders(self.nodes[0])
        free = list(zip(self.outputs(), self.results()))
        out = [[free.pop(0)[0]]] if free and row_outputs else []
        for shape, dtype in row_outputs[1:]:
            k = next((i for i, (_, r) in enumerate(free) if r == (tuple(shape), str(dtype))), None)
            out.append([free.pop(k)[0]] if k is not None else [])
        return out


SYM_VALUES = (torch.SymInt, torch.SymFloat, torch.SymBool)


def _graph_ops(fwd_nodes: list[fx.Node], sizes: SymSizes) -> list[GraphOp]:
    """The forward nodes as the model's ops (see GraphOp); a graph with symbolic sizes computes
    sizes too (`sym_size`, products of them): those nodes are no ops of the model."""
    ops: list[GraphOp] = []
    order = {n: i for i, n in enumerate(fwd_nodes[0].graph.nodes)} if fwd_nodes else {}
    for n in fwd_nodes:
        if isinstance(n.meta.get("val"), SYM_VALUES):
            continue
        orig = n.meta.get("original_aten")
        decomposed = orig is not None and str(orig) != str(n.target)
        if decomposed and ops and ops[-1].decomposed and ops[-1].target == str(orig) \
                and _source(ops[-1].nodes[-1]) == _source(n):
            ops[-1].nodes.append(n)
        else:
            ops.append(GraphOp([n], str(orig) if decomposed else str(n.target), decomposed,
                               order, sizes))
    return ops


def _source(node: fx.Node) -> tuple | None:
    """The captured-graph nodes `node` was made from (`meta["from_node"]`; None where absent).
    A decomposition's nodes share it; two ops in a row that inductor's no-op removal left with
    the same `original_aten` do not (torch 2.14's joint-graph pass drops `x * 1.0` and copies
    the mul's meta onto x: Llama's rotary `cos() * attention_scaling` and `sin() * ...` are
    then `cos` and `sin`, each naming `mul`: two ops, not one decomposed mul)."""
    src = node.meta.get("from_node")
    return tuple(getattr(s, "name", s) for s in src) if isinstance(src, (list, tuple)) else None


def _identity_slice(g: GraphOp) -> bool:
    """A slice that takes the whole of its input (at the profiled sizes): a static trace drops
    it, a graph with symbolic sizes keeps it (`x[:, :n]` where n is the length itself cannot be
    proven whole for every size). A free view, not an op of the profile's."""
    node = g.nodes[0]
    if g.decomposed or node.target is not torch.ops.aten.slice.Tensor or not node.args:
        return False
    src = node.args[0]
    return isinstance(src, fx.Node) and g.results()[:1] == _outputs(src, g.sizes)[:1]


def _writes_back(node: fx.Node) -> bool:
    """AOTAutograd's copy of a mutated input's new value back into it (BatchNorm's running
    statistics): not an op of the model's forward."""
    return (node.target is torch.ops.aten.copy_.default and bool(node.args)
            and getattr(node.args[0], "op", None) == "placeholder")


def _storage(node: fx.Node) -> int | None:
    v = node.meta.get("val")
    return storage_object_key(v) if isinstance(v, torch.Tensor) else None


def _tensor_vals(node: fx.Node) -> list[tuple[int, torch.Tensor]]:
    val = node.meta.get("val")
    vals = list(val) if isinstance(val, (tuple, list)) else [val]
    return [(i, v) for i, v in enumerate(vals) if isinstance(v, torch.Tensor)]


def _outputs(node: fx.Node, sizes: SymSizes) -> list[tuple[tuple, str]]:
    return [(tuple(sizes.dim(s) for s in v.shape), dtype_name(v.dtype))
            for _, v in _tensor_vals(node)]


def _holders(node: fx.Node) -> list[list[fx.Node]]:
    """For each tensor result of `node` (in order), the nodes that hold it: the node itself, or
    the getitems that pick it out of a multi-output op."""
    val = node.meta.get("val")
    if not isinstance(val, (tuple, list)):
        return [[node]]
    picks: dict[int, list[fx.Node]] = {}
    for u in node.users:
        if u.target is operator.getitem:
            picks.setdefault(int(u.args[1]), []).append(u)
    return [picks.get(i, []) for i, _ in _tensor_vals(node)]


def _partitioner_cse(gm: fx.GraphModule, num_fwd_outputs: int) -> fx.Graph:
    """The CSE the partitioner runs first, as it runs it (run here so the merged graph is the one
    lined up). torch 2.13: `fx_graph_cse(graph)`. torch 2.14 and 2.15 key each node on whether
    backward depends on it as well (`extra_node_key`), so that a forward-only value is not
    merged into one backward reads (which would be saved as an extra forward output): the same
    key here, else our merge would join what torch's keeps apart and its own CSE could not undo
    it."""
    from torch._functorch.compile_utils import fx_graph_cse
    if "extra_node_key" not in inspect.signature(fx_graph_cse).parameters:
        return fx_graph_cse(gm.graph)
    from torch._functorch.partitioners import _extract_fwd_bwd_outputs
    _, bwd_outputs, _, _ = _extract_fwd_bwd_outputs(gm, num_fwd_outputs=num_fwd_outputs)
    needed: set[fx.Node] = set()
    stack = [o for o in bwd_outputs if o is not None and o.op != "output"]
    while stack:
        node = stack.pop()
        if node not in needed:
            needed.add(node)
            stack.extend(node.all_input_nodes)
    return fx_graph_cse(gm.graph, extra_node_key=lambda node: node in needed)


def _on_cuda(gm: fx.GraphModule) -> bool:
    return any(isinstance(v := n.meta.get("val"), torch.Tensor) and v.device.type == "cuda"
               for n in gm.graph.nodes if n.op == "placeholder")


def _saved(fw: fx.GraphModule, num_fwd_outputs: int) -> tuple[list[fx.Node], list[fx.Node]]:
    outs = list(fw.graph.find_nodes(op="output")[0].args[0])
    return outs[:num_fwd_outputs], [n for n in outs[num_fwd_outputs:]
                                    if isinstance(n, fx.Node)
                                    and isinstance(n.meta.get("val"), torch.Tensor)]


def _offload(fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int, cuda: bool,
             sizes: SymSizes) -> int:
    """Offload the saved values marked `should_offload`; returns how many could not be."""
    from torch._functorch._activation_offloading import activation_offloading as ao
    from torch._functorch.partitioners import get_default_op_list
    saved = _saved(fw, num_fwd_outputs)[1]
    views = get_default_op_list()
    chosen = refused = 0
    for n in saved:
        if not n.meta.get("should_offload"):
            continue
        if n.op != "call_function" or views.is_view(n) or not sizes.dense(n.meta["val"]):
            refused += 1
            continue
        n.meta["saved_for_offloading"] = True
        chosen += 1
    if not chosen:
        return refused
    # torch's insertion replaces an offloaded value in every output position; a value that
    # is also a model output (Hugging Face's KV cache: the key states themselves once
    # inductor dropped the cache's copy) goes to the caller as it is, and only backward's
    # reference to it is offloaded, as a patched eager step's pack hook does: the model's
    # outputs are taken out of the output while the pass runs and put back after
    out = fw.graph.find_nodes(op="output")[0]
    outs = list(out.args[0])
    out.update_arg(0, tuple(outs[num_fwd_outputs:]))
    if cuda:
        ao.offload_chosen_sets_async(fw, bw)
        out.update_arg(0, tuple(outs[:num_fwd_outputs]) + tuple(out.args[0]))
        ao.activation_offload_sink_wait_async(fw)
        ao.activation_reload_prefetch_async(bw)
        _keep_outputs(fw, outs[:num_fwd_outputs])
    else:
        ao.offload_chosen_sets(fw, bw)
        out.update_arg(0, tuple(outs[:num_fwd_outputs]) + tuple(out.args[0]))
    for g in (fw, bw):
        g.graph.lint()
        g.recompile()
    return refused


def _keep_outputs(fw: fx.GraphModule, model_outputs: list) -> None:
    """torch's offload wait (`ao.wait_tensor`) frees the storage of its `keepalive`, the
    offloaded device value, once the compute stream has waited for the copy: a value that is
    also a model output (a KV cache's tensor) would reach the caller with no storage. Such a
    wait keeps nothing alive instead: the value lives on as the output, and the wait still
    comes before the graph returns (sunk to its end), so the copy has finished by then."""
    outputs = {n for n in model_outputs if isinstance(n, fx.Node)}
    for n in fw.graph.nodes:
        if n.op == "call_function" and n.target == torch.ops.ao.wait_tensor.default \
                and len(n.args) > 1 and n.args[1] in outputs:
            n.update_arg(1, None)


def _substitute_unread(fw: fx.GraphModule, num_fwd_outputs: int, graph_ops, matched,
                       sizes: SymSizes) -> dict[int, list[str]]:
    """Where backward does not read a root the plan swaps because inductor decomposed the op
    that reads it (layer norm: its backward reads the normalized input, which the
    decomposition computes, instead of the input), the values of that decomposition which the
    forward graph saves in its place, untagged by the plan, are offloaded instead (marked
    `should_offload`), up to the root's bytes. Returns root -> the names offloaded for it."""
    saved = {n.name: n for n in _saved(fw, num_fwd_outputs)[1] if n.op == "call_function"}
    out: dict[int, list[str]] = {}
    for g, (row, _) in matched.items():
        for tag, root, hs in zip(row.tags, row.roots, g.holders_for(row.results)):
            if tag != "offload" or not hs or {h.name for h in hs} & set(saved):
                continue
            left = sizes.nbytes(hs[0].meta["val"])
            for n in _saved_by_readers(hs, graph_ops, saved):
                nbytes = sizes.nbytes(n.meta["val"])
                if nbytes <= left and not n.meta.get("should_offload"):
                    n.meta["should_offload"] = True
                    out.setdefault(root, []).append(n.name)
                    left -= nbytes
    return out


def _saved_by_readers(holders: list[fx.Node], graph_ops, saved: dict) -> list[fx.Node]:
    """The saved forward values (`saved`: name -> node of the forward graph) that decomposed
    ops reading `holders` make and the plan left untagged."""
    names = {h.name for h in holders}
    out = []
    for g in graph_ops:
        if not g.decomposed or not any(a.name in names for n in g.nodes
                                       for a in n.all_input_nodes):
            continue
        made = [n for n in g.nodes] + [u for n in g.nodes for u in n.users
                                       if u.target is operator.getitem]
        out += [saved[n.name] for n in made if n.name in saved
                and n.meta.get("recompute") is None]
    return out


def _measure(fw, bw, num_fwd_outputs, graph_ops, matched, table, sizes: SymSizes,
             substituted: dict | None = None) -> GraphReport:
    """Read what the partitioned graphs save, offload and recompute (`substituted`: swapped
    roots whose decomposed readers' values were offloaded instead, `_substitute_unread`)."""
    counted = [g for g in graph_ops if g in matched or not (g.target in AUTOGRAD_ONLY
                                                            or _identity_slice(g))]
    rep = GraphReport(graph_ops=len(counted), lined_up_ops=len(matched),
                      rows=sorted(_rows(matched)))
    primal = {storage_object_key(v) for n in fw.graph.find_nodes(op="placeholder")
              if isinstance(v := n.meta.get("val"), torch.Tensor)}
    # views (a view op, or results sharing an input's or an earlier result's storage, as
    # split's do): free to re-derive
    views, owned = set(), set(primal)
    for n in (n for g in graph_ops for n in g.nodes):
        keys = {_storage(h) for hs in _holders(n) for h in hs} - {None}
        if _is_view(n) or (keys and keys <= owned):
            views.add(n)
        owned |= keys
    lined = {_storage(h) for g in matched if not (set(g.nodes) & views) for h in g.outputs()}
    _measure_saved(rep, fw, num_fwd_outputs, primal, lined, sizes)
    _measure_recomputes(rep, bw, graph_ops, matched, views, set(table["recompute_ops"]))
    roots = {int(k): v for k, v in table["root_bytes"].items()}
    rep.substituted = dict(substituted or {})
    _measure_unread(rep, matched, roots, sizes)
    for g, (row, _) in matched.items():
        for tag, root, hs in zip(row.tags, row.roots, g.holders_for(row.results)):
            if tag in ("save", "offload") and root in roots and hs and \
                    (nbytes := sizes.nbytes(hs[0].meta["val"])) != roots[root]:
                rep.resized_roots[root] = nbytes
    return rep


def _measure_saved(rep: GraphReport, fw, num_fwd_outputs: int, primal: set[int],
                   lined: set[int], sizes: SymSizes) -> None:
    """Bytes the forward graph saves on the device and offloads (storages once)."""
    from torch._functorch._activation_offloading.activation_offloading import CPU_OFFLOAD_PREFIX
    seen: set[int] = set()
    for n in _saved(fw, num_fwd_outputs)[1]:
        v = n.meta["val"]
        offloaded = n.name.startswith(CPU_OFFLOAD_PREFIX)
        key = id(n) if offloaded else storage_object_key(v)
        if key in primal or key in seen:
            continue
        seen.add(key)
        nbytes = sizes.nbytes(v)
        if offloaded:
            rep.offloaded_bytes += nbytes
            rep.offloaded_names.append(n.name.removeprefix(CPU_OFFLOAD_PREFIX))
        else:
            rep.saved_bytes += nbytes
            rep.saved_names.append(n.name)
            if key not in lined:
                rep.saved_bytes_not_lined_up += nbytes
                src = n.args[0] if n.target is operator.getitem else n
                orig = src.meta.get("original_aten")
                if orig is not None and str(orig) != str(src.target) \
                        and str(orig) not in rep.decomposed_saves:
                    rep.decomposed_saves.append(str(orig))


def _measure_stood_in(rep: GraphReport, stood: dict, table: dict, sizes: SymSizes) -> None:
    """A swapped copy whose standing-in base backward neither saves nor offloads is unread."""
    held = set(rep.saved_names) | set(rep.offloaded_names)
    for r, h in stood.items():
        row = table["ops"][r]
        if row.tags[0] == "offload" and h.name not in held:
            rep.unread_swaps[row.roots[0]] = (row.name, sizes.nbytes(h.meta["val"]))


def _measure_unread(rep: GraphReport, matched, roots: dict, sizes: SymSizes) -> None:
    """The swapped roots of lined-up ops that the partitioned forward neither saves nor
    offloads (backward does not read them), and those a decomposition makes no value for. A
    root held through another op's result counts as read (an in-place op's: BatchNorm's output
    rewritten by `relu_`, whose functional result is what backward reads)."""
    held = set(rep.saved_names) | set(rep.offloaded_names)
    read = {root for g, (row, _) in matched.items()
            for root, hs in zip(row.roots, g.holders_for(row.results))
            if {h.name for h in hs} & held}
    for g, (row, _) in matched.items():
        for tag, root, hs in zip(row.tags, row.roots, g.holders_for(row.results)):
            if tag != "offload" or root not in roots or root in rep.substituted or root in read:
                continue
            if not hs and g.decomposed:
                rep.unread_swaps[root] = (row.name, roots[root])
            elif hs and not {h.name for h in hs} & held:
                rep.unread_swaps[root] = (row.name, sizes.nbytes(hs[0].meta["val"]))


def _measure_recomputes(rep: GraphReport, bw, graph_ops, matched, views: set[fx.Node],
                        planned: set[str]) -> None:
    """Sort the forward ops the backward graph re-runs: ops of the plan's chains, views
    re-derived, constants re-made (no input: free), lined-up compute ops off the plan, and
    compute ops that did not line up."""
    op_of = {n.name: g for g in graph_ops for n in g.nodes}
    for n in bw.graph.nodes:
        g = op_of.get(n.name) if n.op == "call_function" else None
        if g is None:
            continue
        row = matched[g][0] if g in matched else None
        name = row.name if row is not None else None
        if name in planned:
            if name not in rep.recomputed_ops:
                rep.recomputed_ops.append(name)
        elif set(g.nodes) & views:
            rep.rederived_views += 1
        elif not n.all_input_nodes:       # a constant (scalar_tensor, arange): no inputs
            rep.remade_constants += 1
        elif row is not None and (not g.decomposed or n.name == g.outputs()[0].name):
            if name not in rep.off_plan_recomputes:
                rep.off_plan_recomputes.append(name)
        else:
            rep.unplanned_recomputes += 1


def _inductor_partitioner(partition: PlanPartition):
    """`partition` as inductor's `custom_partitioner_fn` (a CustomPartitionerFn)."""
    from torch._inductor.custom_graph_pass import CustomPartitionerFn

    class InductorPartitioner(CustomPartitionerFn):
        def __call__(self, gm, joint_inputs, **kwargs):
            return partition(gm, joint_inputs, **kwargs)

        def uuid(self):
            return None        # never cache (fx_graph_cache is off as well)

        def __reduce__(self):  # inductor may pickle its config: a stand-in, not the plan
            return (str, ("slackswap plan partition",))

    return InductorPartitioner()


def _backend(backend: str, partition: PlanPartition, options: dict | None):
    """torch.compile arguments that run `partition` as the partitioner of `backend`."""
    if backend == "aot_eager":
        if options:
            raise InputError("options= applies to the inductor backend only",
                             hint="drop options, or use backend='inductor'")
        from torch._dynamo.backends.common import aot_autograd
        from torch._dynamo.backends.debugging import boxed_nop
        return {"backend": aot_autograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop,
                                        partition_fn=partition,
                                        keep_inference_input_mutations=True)}
    if backend not in BACKENDS:
        raise InputError(f"compile_planned runs backend {' or '.join(map(repr, BACKENDS))}, "
                         f"not {backend!r}",
                         hint="a plan needs a backend whose partitioner it can set")
    opts = dict(options or {})
    if opts.get("custom_partitioner_fn") is not None:
        raise InputError("options sets custom_partitioner_fn, which compile_planned sets",
                         hint="drop custom_partitioner_fn from options")
    opts["custom_partitioner_fn"] = _inductor_partitioner(partition)
    # the caches key on the graph torch captured, not on the plan: a graph compiled under
    # another plan (or none) would come back without this partition running
    opts["fx_graph_cache"] = False
    return {"backend": "inductor", "options": opts}


def compile_planned(model: torch.nn.Module, table: dict, *, block=None,
                    per_block: bool = False, backend: str = "inductor", quiet: bool = False,
                    **compile_kwargs):
    """`torch.compile(model, **compile_kwargs)` with the plan applied in its joint graphs.

    - the whole model (default): returns what torch.compile returns;
    - `block=i` (or a module path): `model` is repeated block i of the profiled model (the
      torchtitan way: compile each block); it gets that block's part of the plan;
    - `per_block=True`: compiles every repeated block of `model` in place (each child of the
      blocks' container is replaced by its compiled module) and returns `model`.

    The partition function is reachable as `result._slackswap_partitions` (a list: one per
    compiled object), whose `reports` say what each graph carries out.
    """
    check_torch_version()
    if per_block:
        if block is not None:
            raise InputError("pass block= or per_block=True, not both",
                             hint="per_block compiles every block; block= is for one")
        return _compile_blocks(model, table, backend=backend, quiet=quiet, **compile_kwargs)
    if isinstance(block, int):
        name = block_name(table, block)
    else:
        name = block or ""
    rows = block_rows(table, name)
    if not rows:
        raise InputError(f"module {name!r} runs no op of the profile",
                         hint="pass the module path of a block, e.g. 'model.layers.0'")
    partition = PlanPartition(table, rows, label=name, quiet=quiet)
    args = _backend(backend, partition, compile_kwargs.pop("options", None))
    compiled = torch.compile(model, **args, **compile_kwargs)
    compiled._slackswap_partitions = [partition]
    return compiled


def _compile_blocks(model, table, *, backend, quiet, **compile_kwargs):
    container = table.get("container")
    if container is None:
        raise InputError("the profiled model has no repeated blocks",
                         hint="use compile_planned(model) on the whole model")
    try:
        parent = model.get_submodule(container)
    except AttributeError:
        raise InputError(f"the model has no submodule {container!r} (the profiled model's "
                         "blocks)", hint="pass the model that was profiled") from None
    partitions = []
    for child_name, child in list(parent.named_children()):
        if not child_name.isdigit():
            continue
        compiled = compile_planned(child, table, block=int(child_name), backend=backend,
                                   quiet=quiet, **compile_kwargs)
        parent.register_module(child_name, compiled)
        partitions += compiled._slackswap_partitions
    model._slackswap_partitions = partitions
    return model


def graph_sets(partitions: list[PlanPartition]) -> list[list[GraphReport]]:
    """The graphs compiled so far as the steps ran them: set 0 holds each frame's first
    compile (one of each graph the first step ran: a graph break's pieces, every block's
    graph); set k holds the k-th recompile of a frame (a guard failure, another input shape),
    which replaces that frame's graph in the steps after it. Recompiles share their frame
    (dynamo's `frame/compile` id), counted per compiled object (`per_block` compiles one code
    object once per block)."""
    sets: list[list[GraphReport]] = []
    for p in partitions:
        seen: dict[str, int] = {}
        for r in p.reports:
            frame = r.compile_id.split("/")[0] if r.compile_id else f"#{len(seen)}"
            k = seen[frame] = seen.get(frame, -1) + 1
            while len(sets) <= k:
                sets.append([])
            sets[k].append(r)
    return sets or [[]]


def totals(partitions: list[PlanPartition], graph_set: int = 0) -> dict:
    """The reports of one graph set (`graph_sets`: by default the graphs the first step ran,
    each once; never a recompile summed into them), summed; `recompiled_graph_sets`: how
    many sets came after it."""
    sets = graph_sets(partitions)
    reps = sets[graph_set] if graph_set < len(sets) else []
    return {
        "lined_up_rows": sorted({row for r in reps for row in r.rows}),
        "graphs": len(reps),
        "compile_ids": [r.compile_id for r in reps],
        "recompiled_graph_sets": len(sets) - 1,
        "graph_ops": sum(r.graph_ops for r in reps),
        "lined_up_ops": sum(r.lined_up_ops for r in reps),
        "saved_bytes": sum(r.saved_bytes for r in reps),
        "saved_bytes_not_lined_up": sum(r.saved_bytes_not_lined_up for r in reps),
        "offloaded_bytes": sum(r.offloaded_bytes for r in reps),
        "recomputed_ops": sum(len(r.recomputed_ops) for r in reps),
        "off_plan_recomputes": sorted({o for r in reps for o in r.off_plan_recomputes}),
        "rederived_views": sum(r.rederived_views for r in reps),
        "remade_constants": sum(r.remade_constants for r in reps),
        "unplanned_recomputes": sum(r.unplanned_recomputes for r in reps),
        "resized_roots": {k: v for r in reps for k, v in r.resized_roots.items()},
        "merged_rows": sorted({row for r in reps for row in r.merged_rows}),
        "refused_offloads": sum(r.refused_offloads for r in reps),
        "stood_in_copies": sum(len(r.stood_in) for r in reps),
        "substituted_swaps": sum(len(r.substituted) for r in reps),
        "unread_swaps": {k: v for r in reps for k, v in r.unread_swaps.items()},
        "decomposed_saves": sorted({o for r in reps for o in r.decomposed_saves}),
        "symbolic": any(r.symbolic for r in reps),
        "symbols": {k: v for r in reps for k, v in r.symbols.items()},
    }

