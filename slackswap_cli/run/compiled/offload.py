"""Offloading in the partitioned graphs: the saved values marked `should_offload` are moved to the
host with torch's own insertion passes (`offload`), and where a decomposed reader of a swapped
root saves values of its own instead, those are offloaded in the root's place
(`substitute_unread`). backend.py's docstring says how and with which private torch API.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .graph_ops import saved_values
from .sym_sizes import SymSizes
from .tags import OFFLOAD


def offload(fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int, cuda: bool,
             sizes: SymSizes) -> int:
    """Offload the saved values marked `should_offload`; returns how many could not be."""
    from torch._functorch._activation_offloading import activation_offloading as ao
    from torch._functorch.partitioners import get_default_op_list
    saved = saved_values(fw, num_fwd_outputs)[1]
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
        keep_outputs(fw, outs[:num_fwd_outputs])
    else:
        ao.offload_chosen_sets(fw, bw)
        out.update_arg(0, tuple(outs[:num_fwd_outputs]) + tuple(out.args[0]))
    for g in (fw, bw):
        g.graph.lint()
        g.recompile()
    return refused


def keep_outputs(fw: fx.GraphModule, model_outputs: list) -> None:
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


def substitute_unread(fw: fx.GraphModule, num_fwd_outputs: int, graph_ops, matched,
                       sizes: SymSizes) -> dict[int, list[str]]:
    """Where backward does not read a root the plan swaps because inductor decomposed the op
    that reads it (layer norm: its backward reads the normalized input, which the
    decomposition computes, instead of the input), the values of that decomposition which the
    forward graph saves in its place, untagged by the plan, are offloaded instead (marked
    `should_offload`), up to the root's bytes. Returns root -> the names offloaded for it."""
    saved = {n.name: n for n in saved_values(fw, num_fwd_outputs)[1] if n.op == "call_function"}
    out: dict[int, list[str]] = {}
    for g, (row, _) in matched.items():
        for tag, root, hs in zip(row.tags, row.roots, g.holders_for(row.results)):
            if tag != OFFLOAD or not hs or {h.name for h in hs} & set(saved):
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
