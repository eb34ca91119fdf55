"""The rows of the two tables a patched module holds: one definition each, read by name.

`chains.runtime_table` makes `TABLE` (what `patch(model)` carries out in eager): its `ops` are
`OpRow`s. `run/graph_plan.graph_table` makes `GRAPH_TABLE` (what `compile_planned` and
`sac_policy` tag into a captured graph): its `ops` are `GraphRow`s. Both are written into the
emitted file as these types' constructor calls (the file imports them from here), so the file
reads as it runs, and `run/generated.py`'s GENERATOR_VERSION says which layout it has.

Both rows start with the same three columns: the profile op's `name`, its aten `target`
(`aten.mm.default`) and the `module` path it runs in (innermost module, "" for the model).
"""
from __future__ import annotations

from typing import NamedTuple

__all__ = ["OpRow", "GraphRow"]


class OpRow(NamedTuple):
    """One forward op as the in-place runtime lines the model's ops up with it (run/eager/first_call.py).

    `shapes`: each output's shape; `outputs`: the profile's tensor ids of its outputs (in the
    same order); `reads_act`: whether it reads an activation (a value computed from the
    inputs, not a parameter, buffer or input); `acts`: the activation ids it reads."""
    name: str
    target: str
    module: str
    shapes: list
    outputs: list
    reads_act: bool
    acts: list


class GraphRow(NamedTuple):
    """One forward op as a graph runtime tags it (run/compiled/backend.py, run/compiled/sac.py).

    `results`: `[shape, dtype]` of each tensor result; `tags[i]`: what the plan does with
    result i ("recompute", "save", "offload" or None: left to torch); `input_shapes`: the
    shape of each input; `roots[i]`: the saved root whose decision result i carries, or
    None (`graph_plan.graph_table`)."""
    name: str
    target: str
    module: str
    results: list
    tags: list
    input_shapes: list
    roots: list
