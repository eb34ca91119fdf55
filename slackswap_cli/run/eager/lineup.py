"""Which op of the profile each op of a recorded forward is (`LineUp`), and which module runs.

An eager op lines up with the next expected forward op of the plan's table (`OpRow`s), within a
bounded window (`WINDOW`), when it has the same target, first output shape (its rank, for a
plan borrowed from other shapes: run/eager/new_shape.py) and module path, reads activations exactly
when the profile's op does, and reads no profile value the profile's op does not. So an op of a
wrapper's hook (FSDP2's views of gathered weights or of a block's input) cannot pass for a
model's op, and an op the profile does not have (a mask built another way in eager) stays
unmatched, shifting nothing after it.

The module stack follows the profile's attribution (the innermost module) and whether an op
runs in a module's forward body or in its hooks: a global pre-hook (called before every
module's own pre-hooks) enters a module's hooks (`enter`); our own pre-hook, kept last in each
module's pre-hooks, enters its body (`body`); our own forward hook, kept last, leaves it
(`leave`). Ops in hooks (FSDP2's unshard and reshard, a wrapper's input casts) are not the
model's: they are not recorded, and their results are outside values to the ops that read them.
"""
from __future__ import annotations

import torch

from ...table_rows import OpRow
from ...trace.aten import is_view_target
from ..parallel.dtensor import hooks_first_on_tp
from .packs import STATE

__all__ = ["LineUp", "BodyHooks", "WINDOW", "TRACE_ONLY", "trace_only_ops"]

WINDOW = 256            # how far ahead an op may match an expected op
# ops a trace has that eager never runs: make_fx writes a `detach` of each value autograd
# saves of an op's output; eager's autograd saves it without an op. Not counted as missed.
TRACE_ONLY = frozenset({"aten.detach.default"})
# the name eager runs an op under -> the name the profile's trace gives it
_TRACED_AS = {"aten.lift_fresh.default": "aten.lift_fresh_copy.default"}


def trace_only_ops(ops: list) -> frozenset[int]:
    """The positions of the profile's forward ops (`table["ops"]`) that eager may not run as
    ops of the model's forward: make_fx's `detach` of each saved output (`TRACE_ONLY`), a view
    no later forward op reads (autograd re-creating a view after an in-place write to it,
    which a trace replays as an op and eager does inside the autograd node), and the trailing
    ops outside every module (a `loss_fn`'s, which the training script runs after the
    patched forward returned; a model's own last ops there line up and count as usual)."""
    read = {t for o in ops for t in o.acts}
    only = set()
    for i, o in enumerate(ops):
        if o.target in TRACE_ONLY or (is_view_target(o.target)
                                      and not any(t in read for t in o.outputs)):
            only.add(i)
    for i in range(len(ops) - 1, -1, -1):
        if ops[i].module != "":
            break
        only.add(i)
    return frozenset(only)


class LineUp:
    """The line-up of one recorded forward with the plan's forward ops: the next expected op
    (`ptr`), the ops that matched none (`unmatched`) and the module stack. A steady-state call
    shares its first call's (`templates.Template`)."""

    def __init__(self, ops: list[OpRow], names: dict, borrowed: bool):
        """`ops`: the table's forward ops; `names`: id(module) -> its path in the model;
        `borrowed`: the plan was made at other shapes (ops line up by rank, not size)."""
        self.ops, self.names, self.borrowed = ops, names, borrowed
        self.ptr = 0                               # next expected forward op
        self.unmatched = 0
        # [module path, in its forward body?, id of a module not the model's (else None)]
        self.modules: list[list] = [["", True, None]]

    def align(self, func, leaves, reads_act: bool, known: set) -> int | None:
        """The next expected op with this op's target, first output shape (its rank, for a
        plan borrowed from other shapes) and module, that
        reads activations exactly when this op does, and reads no profile value it does not
        (so an op of a wrapper's hook, such as FSDP2's views of gathered weights or of a
        block's input, cannot pass for a model's op)."""
        ops = self.ops
        name = str(func)
        name = _TRACED_AS.get(name, name)
        first = next((list(x.shape) for x in leaves if isinstance(x, torch.Tensor)), None)
        module = self.modules[-1][0]
        end = min(len(ops), self.ptr + WINDOW)
        ranks = self.borrowed         # a plan made at other shapes: the same ranks, not sizes
        if ranks and first is not None:
            first = len(first)
        for i in range(self.ptr, end):
            o = ops[i]
            shape = o.shapes[0] if o.shapes else None
            if ranks and shape is not None:
                shape = len(shape)
            if (o.target == name and o.module == module and shape == first
                    and o.reads_act == reads_act and known.issubset(o.acts)):
                self.ptr = i + 1
                return i
        self.unmatched += 1
        return None

    def alignment(self, rec_of_op: dict, trace_only: frozenset) -> dict:
        """How this call lined up with the profile (`rec_of_op`: profile op -> record):
        `lined_up` of the profile's `expected` forward ops matched an op of the run (its
        trace-only ops, `trace_only_ops`, count only when eager ran them too); `run_ops` ops
        of the run were recorded, `run_unmatched` of them matched none."""
        lined = len(rec_of_op)
        expected = len(self.ops) - sum(1 for i in trace_only if i not in rec_of_op)
        return {"lined_up": lined, "expected": expected,
                "fraction": lined / expected if expected else 1.0,
                "run_ops": lined + self.unmatched,
                "run_unmatched": self.unmatched}

    def enter(self, mod, args) -> None:
        """(A global forward pre-hook: a module's hooks begin.)"""
        name = self.names.get(id(mod))
        if name is None:
            # not one of the model's modules (a loss module made inside forward): it has no
            # hooks of ours, so its body is entered now and left by the global forward hook
            # (`left`); the profile's trace attributes its ops to the module around it
            self.modules.append([self.modules[-1][0], self.modules[-1][1], id(mod)])
        else:
            self.modules.append([name, False, None])

    def left(self, mod, args, out) -> None:
        """(A global forward hook: a module not the model's is left.)"""
        if len(self.modules) > 1 and self.modules[-1][2] == id(mod):
            self.modules.pop()

    def body(self) -> None:
        """(Our pre-hook, last of a module's: its forward body begins.)"""
        if len(self.modules) > 1:
            self.modules[-1][1] = True

    def leave(self) -> None:
        """(Our forward hook, last of a module's: it is left.)"""
        if len(self.modules) > 1:
            self.modules.pop()

    def in_body(self) -> bool:
        return self.modules[-1][1]


class BodyHooks:
    """Our per-module hooks that tell a module's forward body from its hooks (`body_hook`,
    `leave_hook`: see the module docstring), on a model while its call is recorded."""

    def __init__(self):
        self.module_hooks: dict[int, tuple] = {}     # id(module) -> (pre-hook, hook) handles

    def keep_last(self, model) -> None:
        """Keep our body-entry pre-hook and body-exit forward hook last on every submodule
        of `model` (a wrapper such as FSDP2 may have added its own since)."""
        for mod in model.modules():
            if mod is model:
                continue
            mine = self.module_hooks.get(id(mod))
            if mine is not None and next(reversed(mod._forward_pre_hooks), None) == mine[0].id \
                    and next(reversed(mod._forward_hooks), None) == mine[1].id:
                continue
            if mine is not None:
                for h in mine:
                    h.remove()
            self.module_hooks[id(mod)] = (mod.register_forward_pre_hook(body_hook),
                                          mod.register_forward_hook(leave_hook, always_call=True))
            hooks_first_on_tp(mod, self.module_hooks[id(mod)])     # (run/parallel/dtensor.py)

    def remove(self) -> None:
        for hooks in self.module_hooks.values():
            for h in hooks:
                h.remove()
        self.module_hooks.clear()


def body_hook(mod, args) -> None:
    run = getattr(STATE, "run", None)
    if run is not None:
        run.lineup.body()


def leave_hook(mod, args, out) -> None:
    run = getattr(STATE, "run", None)
    if run is not None:
        run.lineup.leave()
