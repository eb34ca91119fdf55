"""Reading the joint graph torch.compile hands the partitioner: its forward ops as the model's
ops (`GraphOp`: one node, or the run of nodes a decomposition made of one op), the nodes
holding each result, views and storages, the partitioner's CSE as torch runs it, and the
values the partitioned forward saves. Used by the tagging (tags.py), the offload (offload.py),
the measuring (report.py) and the partition function (backend.py).
"""
from __future__ import annotations

import inspect
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from ...profile_build import dtype_name
from ...trace.aten import returns_view
from ...trace.storage import storage_object_key
from .sym_sizes import SymSizes

# AOTAutograd's graph detaches some saved outputs (attention's, log_softmax's); the profile's
# trace has them as `detach` (torch 2.13's make_fx) or `alias` (2.14's, 2.15's), which line up
# (graph_plan.FREE_VIEW_TWINS). A detach that still lines up with no profile op is autograd's
# bookkeeping (a view: no FLOPs, no bytes), not an op of the model: not counted as a graph op
AUTOGRAD_ONLY = frozenset({"aten.detach.default"})


def split_joint(gm: fx.GraphModule, num_fwd_outputs: int | None = None
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
            return [hs[0] for hs in holders(self.nodes[0]) if hs]
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
            return holders(self.nodes[0])
        free = list(zip(self.outputs(), self.results()))
        out = [[free.pop(0)[0]]] if free and row_outputs else []
        for shape, dtype in row_outputs[1:]:
            k = next((i for i, (_, r) in enumerate(free) if r == (tuple(shape), str(dtype))), None)
            out.append([free.pop(k)[0]] if k is not None else [])
        return out


SYM_VALUES = (torch.SymInt, torch.SymFloat, torch.SymBool)


def model_ops(fwd_nodes: list[fx.Node], sizes: SymSizes) -> list[GraphOp]:
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


def identity_slice(g: GraphOp) -> bool:
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


def storage_of(node: fx.Node) -> int | None:
    v = node.meta.get("val")
    return storage_object_key(v) if isinstance(v, torch.Tensor) else None


def _tensor_vals(node: fx.Node) -> list[tuple[int, torch.Tensor]]:
    val = node.meta.get("val")
    vals = list(val) if isinstance(val, (tuple, list)) else [val]
    return [(i, v) for i, v in enumerate(vals) if isinstance(v, torch.Tensor)]


def _outputs(node: fx.Node, sizes: SymSizes) -> list[tuple[tuple, str]]:
    return [(tuple(sizes.dim(s) for s in v.shape), dtype_name(v.dtype))
            for _, v in _tensor_vals(node)]


def holders(node: fx.Node) -> list[list[fx.Node]]:
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


def is_view(node: fx.Node) -> bool:
    """Whether `node` is a view op (`trace.aten.returns_view`: the schema says its result
    aliases an input, unwritten, or it is a view the schema does not declare, such as
    `_unsafe_view`: C++ `at::matmul` folds batch dimensions with it, and `reshape` of an
    expanded tensor - grouped-query attention's repeat_kv - is `clone` then `_unsafe_view`)."""
    return returns_view(node.target)


def partitioner_cse(gm: fx.GraphModule, num_fwd_outputs: int) -> fx.Graph:
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


def on_cuda(gm: fx.GraphModule) -> bool:
    return any(isinstance(v := n.meta.get("val"), torch.Tensor) and v.device.type == "cuda"
               for n in gm.graph.nodes if n.op == "placeholder")


def saved_values(fw: fx.GraphModule, num_fwd_outputs: int) -> tuple[list[fx.Node], list[fx.Node]]:
    outs = list(fw.graph.find_nodes(op="output")[0].args[0])
    return outs[:num_fwd_outputs], [n for n in outs[num_fwd_outputs:]
                                    if isinstance(n, fx.Node)
                                    and isinstance(n.meta.get("val"), torch.Tensor)]


def lined_rows(matched: dict) -> set[int]:
    """The table rows a line-up (`PlanPartition._match`) holds."""
    return {r for _, members in matched.values() for r in members}
