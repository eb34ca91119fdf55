"""The model's own checkpointing in the traced graph: its regions recomputed in backward.

A model that runs blocks through `torch.utils.checkpoint` (Hugging Face's
`gradient_checkpointing_enable()`, timm's `set_grad_checkpointing()`) holds, for each region,
only what the region was called with (the checkpoint keeps its inputs); what the region's ops
save for backward is dropped after forward and made again by re-running the region when
backward first needs it. The step is traced with each region as a plain call
(`joint._inline_checkpoints`: a graph cannot replay the generator state the re-run
restores), so the traced backward reads the region's values from forward, as a model without
checkpointing would.

`recompute_regions` makes the graph hold what the model holds: before the first backward
node that reads a value made inside a region (other than the region's outputs, which the
model's later ops may save themselves), it inserts a copy of the region's forward nodes,
marked backward, and those backward readers read the copies. The region's values are then
not saved, its inputs are (read by the copies), and backward pays the re-run. The region's
inputs are held by the checkpoint, out of a plan's reach: `recompute_regions` returns them,
the profile lists their roots (`summary["checkpoint_held"]`) and every plan keeps them
(`planners.plan_and_simulate`, `simulate.budget_floor_bytes`).

A random op is not copied (nor an in-place write into its result, dropout's scaling): the
copies read its forward result. The checkpoint draws the same numbers again from the
restored generator state; a graph cannot restore it, and a backward that drew would not
give eager's values. Its result then counts as held (kept) through backward, where the model
holds it only while the region re-runs: the profile counts more than the model holds, never
less, and no random op runs in backward. A graph that runs the copies (the compiled path,
`verify`'s written step) computes what eager computes: deterministic ops re-run on the same
inputs, random results read from forward.
"""
from __future__ import annotations

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor

from .costs import is_random_op
from .storage import storage_nbytes, storage_object_key

__all__ = ["recompute_regions"]


def recompute_regions(gm: fx.GraphModule, regions: list[list[str]], phase: dict,
                      module: dict) -> list[str]:
    """Rewrite `gm` so that backward re-runs each region in `regions` (forward node names)
    as its checkpoint does (see the module docstring); `phase` and `module` (node name ->
    phase / module path) get the copies. Returns the names of the regions' inputs that
    the copies read (what the checkpoints hold), in graph order."""
    held: dict[str, None] = {}
    for names in regions:
        held.update(dict.fromkeys(_recompute_one(gm, set(names), phase, module)))
    gm.graph.lint()
    gm.recompile()
    return list(held)


def _recompute_one(gm: fx.GraphModule, names: set, phase: dict, module: dict) -> list[str]:
    nodes = list(gm.graph.nodes)
    region = [n for n in nodes if n.name in names]
    inside = set(region)
    outputs = {n for n in region
               if any(u not in inside and phase.get(u.name) != "backward" for u in n.users)}
    readers = [u for u in nodes if phase.get(u.name) == "backward"
               and any(a in inside and a not in outputs for a in u.all_input_nodes)]
    if not readers:
        return []
    env: dict[fx.Node, fx.Node] = {}
    drawn: set = set()
    with gm.graph.inserting_before(readers[0]):
        for n in region:
            if is_random_op(n) or (_writes(n) and any(a in drawn for a in n.all_input_nodes)):
                drawn.add(n)       # (read from forward, never drawn again: see below)
                continue
            c = gm.graph.node_copy(n, lambda a: env.get(a, a))
            env[n] = c
            phase[c.name] = "backward"
            module[c.name] = module.get(n.name, "")

    def swap(a):
        return env[a] if a in env and a not in outputs else a
    for u in readers:
        u.args, u.kwargs = fx.map_arg(u.args, swap), fx.map_arg(u.kwargs, swap)
    for n in reversed(region):          # copies nothing reads (and that write nothing)
        c = env.get(n)
        if c is not None and not c.users and not c.is_impure():
            gm.graph.erase_node(c)
            phase.pop(c.name, None)
            module.pop(c.name, None)
            env.pop(n)
    _fresh_storages(nodes, inside, env)
    held: dict[str, None] = {}
    copies = set(env.values())
    for c in env.values():           # (in graph order)
        held.update((a.name, None) for a in c.all_input_nodes
                    if a.op == "call_function" and (a not in inside or a in drawn)
                    and a not in copies)
    held.update((n.name, None) for n in region      # random results backward reads
                if n in drawn and any(phase.get(u.name) == "backward" for u in n.users))
    return list(held)


def _writes(n: fx.Node) -> bool:
    """Does `n` write one of its arguments in place (`div_` on a dropout mask)?"""
    schema = getattr(n.target, "_schema", None)
    return schema is not None and any(a.alias_info is not None and a.alias_info.is_write
                                      for a in schema.arguments)


def _fresh_storages(nodes: list, inside: set, env: dict) -> None:
    """The copies' recorded values (`meta["val"]`, FakeTensors) on storages of their own,
    shared among the copies as the originals share theirs: the profile finds storages by
    these, and a copy is not the value it re-makes. Storages of values made outside the
    region (its inputs, the parameters it views) stay theirs."""
    outside = {storage_object_key(v) for n in nodes if n not in inside
               for v in pytree.tree_leaves(n.meta.get("val")) if isinstance(v, FakeTensor)}
    fresh: dict[int, torch.Tensor] = {}

    def renew(v):
        if not isinstance(v, FakeTensor) or storage_nbytes(v) == 0:
            return v
        key = storage_object_key(v)
        if key in outside:
            return v
        with v.fake_mode:
            base = fresh.get(key)
            if base is None:
                base = fresh[key] = torch.empty(storage_nbytes(v), dtype=torch.uint8,
                                                device=v.device)
            return base.view(v.dtype).as_strided(v.shape, v.stride(), v.storage_offset())

    for c in env.values():
        if "val" in c.meta:
            c.meta["val"] = pytree.tree_map(renew, c.meta["val"])
