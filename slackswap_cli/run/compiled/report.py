"""Measuring and reporting what the partitioned graphs carry out: `GraphReport` (one graph: bytes
saved and offloaded, ops re-run, what lined up), `measure` (read from the forward and backward
graphs), and `graph_sets` / `totals` (the reports of one step's graphs, summed: what
`verify --compile`, run/verify/compiled.py, judges against the plan).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from ...trace.storage import storage_object_key
from .graph_ops import (
    AUTOGRAD_ONLY,
    holders,
    identity_slice,
    is_view,
    lined_rows,
    saved_values,
    storage_of,
)
from .sym_sizes import SymSizes
from .tags import KEPT, OFFLOAD


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


def measure(fw, bw, num_fwd_outputs, graph_ops, matched, table, sizes: SymSizes,
             substituted: dict | None = None) -> GraphReport:
    """Read what the partitioned graphs save, offload and recompute (`substituted`: swapped
    roots whose decomposed readers' values were offloaded instead, `substitute_unread`)."""
    counted = [g for g in graph_ops if g in matched or not (g.target in AUTOGRAD_ONLY
                                                            or identity_slice(g))]
    rep = GraphReport(graph_ops=len(counted), lined_up_ops=len(matched),
                      rows=sorted(lined_rows(matched)))
    primal = {storage_object_key(v) for n in fw.graph.find_nodes(op="placeholder")
              if isinstance(v := n.meta.get("val"), torch.Tensor)}
    # views (a view op, or results sharing an input's or an earlier result's storage, as
    # split's do): free to re-derive
    views, owned = set(), set(primal)
    for n in (n for g in graph_ops for n in g.nodes):
        keys = {storage_of(h) for hs in holders(n) for h in hs} - {None}
        if is_view(n) or (keys and keys <= owned):
            views.add(n)
        owned |= keys
    lined = {storage_of(h) for g in matched if not (set(g.nodes) & views) for h in g.outputs()}
    measure_saved(rep, fw, num_fwd_outputs, primal, lined, sizes)
    _measure_recomputes(rep, bw, graph_ops, matched, views, set(table["recompute_ops"]))
    roots = {int(k): v for k, v in table["root_bytes"].items()}
    rep.substituted = dict(substituted or {})
    _measure_unread(rep, matched, roots, sizes)
    for g, (row, _) in matched.items():
        for tag, root, hs in zip(row.tags, row.roots, g.holders_for(row.results)):
            if tag in KEPT and root in roots and hs and \
                    (nbytes := sizes.nbytes(hs[0].meta["val"])) != roots[root]:
                rep.resized_roots[root] = nbytes
    return rep


def measure_saved(rep: GraphReport, fw, num_fwd_outputs: int, primal: set[int],
                   lined: set[int], sizes: SymSizes) -> None:
    """Bytes the forward graph saves on the device and offloads (storages once)."""
    from torch._functorch._activation_offloading.activation_offloading import CPU_OFFLOAD_PREFIX
    seen: set[int] = set()
    for n in saved_values(fw, num_fwd_outputs)[1]:
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


def measure_stood_in(rep: GraphReport, stood: dict, table: dict, sizes: SymSizes) -> None:
    """A swapped copy whose standing-in base backward neither saves nor offloads is unread."""
    held = set(rep.saved_names) | set(rep.offloaded_names)
    for r, h in stood.items():
        row = table["ops"][r]
        if row.tags[0] == OFFLOAD and h.name not in held:
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
            if tag != OFFLOAD or root not in roots or root in rep.substituted or root in read:
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


def graph_sets(partitions: list) -> list[list[GraphReport]]:
    """`partitions`: `backend.PlanPartition`s (their `reports` are read). The graphs compiled so far as the steps ran them: set 0 holds each frame's first
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


def totals(partitions: list, graph_set: int = 0) -> dict:
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
