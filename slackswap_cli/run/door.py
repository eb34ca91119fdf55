"""The one runtime module a patched file (`slackswap apply`'s output) imports.

Everything the emitted file calls goes through here: `patch` / `unpatch` (the plan inside the
model's own forward: run/eager/inplace.py), `step_module` (the written-out step as one autograd node:
run/written/step.py), `compile_planned` (run/compiled/backend.py), `sac_policy` / `context_fn` (run/compiled/sac.py),
and the rows its tables are written with (`OpRow`, `GraphRow`: table_rows.py). Importing it
loads a dozen of the package's modules (tests/test_runtime_layout.py counts them): the call
machinery loads with the first training call, the written-out step, torch.compile's path and
the tracer and planners only when called (a re-plan at new shapes: run/eager/replan.py).
"""
from __future__ import annotations

from ..table_rows import GraphRow, OpRow
from .eager.inplace import patch as _patch
from .eager.inplace import unpatch

__all__ = ["patch", "unpatch", "step_module", "compile_planned", "sac_policy", "context_fn",
           "OpRow", "GraphRow"]


def patch(model, meta: dict, table: dict, *, strict: bool = False):
    """`inplace.patch(model, meta, table)`: the file's plan inside `model`'s own forward."""
    return _patch(model, meta, table, strict=strict)


def step_module(model, meta: dict, forward_fn, backward_fn, *, check_trace: bool = True):
    """`step.PatchedStep`: the file's written-out forward and backward steps as one module."""
    from .written.step import PatchedStep
    return PatchedStep(model, meta, forward_fn, backward_fn, check_trace=check_trace)


def compile_planned(model, graph_table: dict, **kwargs):
    """`compiled.compile_planned`: torch.compile with the plan in its joint graphs."""
    from .compiled import backend as compiled
    return compiled.compile_planned(model, graph_table, **kwargs)


def sac_policy(graph_table: dict, block_index: int):
    """`sac.sac_policy`: one block's plan as a selective-checkpoint policy."""
    from .compiled import sac
    return sac.sac_policy(graph_table, block_index)


def context_fn(graph_table: dict, block_index: int):
    """`sac.context_fn`: one block's plan for `checkpoint(..., context_fn=...)`."""
    from .compiled import sac
    return sac.context_fn(graph_table, block_index)
