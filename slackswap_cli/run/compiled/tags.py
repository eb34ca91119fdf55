"""The plan's tags and the checkpoint policy each becomes, and the tagging of a joint graph.

A forward op's result carries one tag (`graph_plan.graph_table`'s `GraphRow.tags`): RECOMPUTE
(a recompute chain of the plan re-runs the op), SAVE (a root the plan keeps), OFFLOAD (a root
it swaps) or None (left to torch). `ACTION_TAG` is the plan's action -> tag and
`POLICY_OF_TAG` the tag -> `CheckpointPolicy`: the one map that both `compile_planned`
(`tag_op`, here) and `sac_policy` (sac.py) read; `op_policy` is the one policy of an op whose
results carry such tags.

`tag_op` sets a lined-up op's nodes' `meta["recompute"]` (and `should_offload`), `tag_views`
marks views of offloaded or recomputed results to be re-derived, `stand_in_copies` lets the
base of a copy inductor dropped carry the copy's decision.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from ...table_rows import GraphRow
from .graph_ops import GraphOp, holders, is_view, storage_of

SAVE, OFFLOAD, RECOMPUTE = "save", "offload", "recompute"
KEPT = (SAVE, OFFLOAD)                  # the tags of saved roots (kept on the device or swapped)
ACTION_TAG = {"keep": SAVE, "swap": OFFLOAD, "recompute": RECOMPUTE}
POLICY_OF_TAG = {RECOMPUTE: CheckpointPolicy.MUST_RECOMPUTE,
                 SAVE: CheckpointPolicy.MUST_SAVE,
                 OFFLOAD: CheckpointPolicy.MUST_SAVE}


def op_policy(tags) -> CheckpointPolicy | None:
    """The one policy of an op whose results carry `tags` (None entries ignored): MUST_RECOMPUTE
    where a recompute chain re-runs it, else MUST_SAVE where it makes a root the plan keeps or
    swaps, else None (left to torch)."""
    if RECOMPUTE in tags:
        return POLICY_OF_TAG[RECOMPUTE]
    return next((POLICY_OF_TAG[t] for t in tags if t in KEPT), None)


def tag_op(g: GraphOp, row: GraphRow) -> set[fx.Node]:
    """Tag one lined-up op as the plan decides its results; returns the result nodes it
    offloads or recomputes.

    Every node of the op takes the op's policy (a decomposition's inner nodes only when it is
    recomputed; otherwise they are left to the partitioner). One op whose results the plan
    decides differently (`native_dropout` standing for a CPU dropout run: its result
    recomputed, its mask kept) gets a policy per result. Inductor without `fallback_random`
    decomposes native_dropout (the mask, then the products); otherwise it is one random node
    that cannot re-run, so its result is re-made from the mask (`_dropout_from_mask`) to be
    recomputed; where it cannot be (not fp32), the node is saved and its result left to the
    partitioner (which saves it)."""
    tags = row.tags
    kept = any(t in KEPT for t in tags)
    mixed = kept and RECOMPUTE in tags
    made = _dropout_from_mask(g) if mixed and not g.decomposed and tags[0] == RECOMPUTE \
        else None
    policy = POLICY_OF_TAG[SAVE] if mixed else op_policy(tags)
    if policy is None:
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
        own = policy if not mixed else None if tag == RECOMPUTE and not g.decomposed \
            else POLICY_OF_TAG.get(tag)
        for h in hs if own is not None else ():
            h.meta["recompute"] = own
            if tag in (OFFLOAD, RECOMPUTE):
                h.meta["should_offload"] = tag == OFFLOAD
                moved.add(h)
    return moved


def _dropout_from_mask(g: GraphOp) -> list[fx.Node] | None:
    """For one `native_dropout` node of fp32: its result re-made as `input * mask * scale`
    (equal to native_dropout's bit for bit in fp32: the mask is 0 or 1), so that backward can
    recompute it from the saved mask; returns the new nodes, or None where it does not apply."""
    node = g.nodes[0]
    if node.target is not torch.ops.aten.native_dropout.default or len(node.args) < 2:
        return None
    held = holders(node)
    out, mask = (hs[0] if hs else None for hs in (held + [[], []])[:2])
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


def tag_views(gm: fx.GraphModule, moved: set[fx.Node], after_tangent: set[fx.Node]) -> None:
    """Views of an offloaded or recomputed result are re-derived in backward: the partitioner
    may save a view of a root instead of the root itself (free, as views are), but a view
    cannot be offloaded and a saved view of a recomputed root would keep its storage.

    A view is a node sharing such a result's storage, or a view op (by its schema) of one
    (fake tensors do not always share the storage of a view of a view)."""
    storages = {storage_of(n) for n in moved}
    derived = set(moved)
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target is operator.getitem or n in after_tangent:
            continue
        base = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
        if n in moved or not (storage_of(n) in storages or (is_view(n) and base in derived)):
            continue
        derived.add(n)
        n.meta.setdefault("recompute", CheckpointPolicy.MUST_RECOMPUTE)


def stand_in_copies(table: dict, rows: set[int], matched: dict
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
        if r not in rows or r in lined or base not in lined or tag not in KEPT:
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
