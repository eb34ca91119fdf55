"""Values backward reads that are made from one offloaded or recomputed result alone.

Inductor decomposes backward ops before partitioning, and the partitioner may then move the
part of a backward op that reads only forward values into forward and save its result instead
of the root the plan swaps: `tanh_backward`'s `1 - t * t` (GPT-2's gelu), a `transpose` of a
contiguous copy of an expanded key (GPT-2's attention matmuls, a decomposed `matmul`'s
`clone` then `_unsafe_view`). The root is then neither saved nor offloaded (backward does not
read it) and the derived value stays on the device: memory the plan promised to free.

`tag_derived` tags every such value `MUST_RECOMPUTE` before partitioning: a node whose tensor
inputs are all offloaded or recomputed results of the plan, or values derived from them only
(no other tensor, no parameter), is re-derived in backward from the root, which the
partitioner then saves (and slackswap offloads) or recomputes as the plan says. Random ops
are never tagged (re-running one draws other numbers), nor a node the plan or the partitioner
already decided (`meta["recompute"]` set), nor one that depends on a tangent (backward's own).
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy


def tag_derived(gm: fx.GraphModule, moved: set[fx.Node], after_tangent: set[fx.Node]
                ) -> list[fx.Node]:
    """Tag the values made from `moved` (offloaded and recomputed results) alone; returns the
    nodes tagged, in graph order."""
    derived = set(moved)
    tagged: list[fx.Node] = []
    for n in gm.graph.nodes:
        if n.op != "call_function" or n in derived or n in after_tangent or _random(n):
            continue
        ins = n.all_input_nodes
        if not ins or not all(a in derived for a in ins):
            continue
        policy = n.meta.get("recompute")
        if policy is None:
            n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            tagged.append(n)
        elif policy != CheckpointPolicy.MUST_RECOMPUTE:
            continue
        derived.add(n)
    return tagged


def _random(node: fx.Node) -> bool:
    """Whether `node` draws random numbers (its op is tagged nondeterministic_seeded)."""
    tags = getattr(node.target, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags
