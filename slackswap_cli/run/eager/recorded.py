"""What the recorder keeps of a forward, and how a recorded op is run again.

A recorded op (`OpRecord`) holds its function, its arguments with the tensors the forward
produced replaced by references (`OutRef`: record and output; `ExtRef`: a value from outside
the recorded forward, held weakly; `InputRef`: the call's own input number i, in a steady-state
template), weak references to its outputs and their versions. `prepare_replay` works out once
what replaying a record needs; `view_geometry` notes a view's geometry so a later replay is
one `as_strided` (C calls instead of the boxed op). Used by run/eager/first_call.py (the recorder),
run/eager/backward.py (replays) and run/eager/templates.py.
"""
from __future__ import annotations

import functools
import weakref

import torch
import torch.utils._pytree as pytree

from ...trace.aten import aliases_input, writes_first, written_positions
from ...trace.costs import is_random_call
from ...trace.dtensor import is_collective

__all__ = ["OutRef", "ExtRef", "InputRef", "OpRecord", "alias_flags", "prepare_replay",
           "is_random_record", "view_geometry", "view_of"]

def is_random_record(rec: "OpRecord") -> bool:
    return is_random_call(rec.func, rec.args, rec.kwargs) or is_collective(rec.func)


class OutRef:
    """A tensor argument produced by recorded op `rec`, output `out` (`loc`: both)."""
    __slots__ = ("rec", "out", "loc")

    def __init__(self, rec: int, out: int):
        self.rec, self.out, self.loc = rec, out, (rec, out)


class ExtRef:
    """A tensor argument from outside the recorded forward that is neither a parameter nor
    one of the call's inputs (a wrapper's view of a block's input, say): held weakly."""
    __slots__ = ("ref",)

    def __init__(self, x: torch.Tensor):
        self.ref = weakref.ref(x)


class InputRef:
    """A tensor argument that is the call's own input number `i` (in a steady-state template,
    where each call brings its own inputs)."""
    __slots__ = ("i",)

    def __init__(self, i: int):
        self.i = i


@functools.lru_cache(maxsize=None)
def alias_flags(func) -> tuple[bool, bool]:
    """(a view or in-place op, an in-place op writing its first argument): read from the
    schema once per op (building `func._schema.returns` costs microseconds a call)."""
    return aliases_input(func), writes_first(func)


class OpRecord:
    __slots__ = ("func", "args", "kwargs", "outs", "versions", "op", "in_locs", "prep",
                 "alias", "wfirst", "geom")

    def __init__(self, func, args, kwargs, outs, versions, op, in_locs):
        self.func, self.args, self.kwargs = func, args, kwargs
        self.outs, self.versions, self.op, self.in_locs = outs, versions, op, in_locs
        self.prep = None
        self.alias, self.wfirst = alias_flags(func)
        self.geom = None        # a view: None (not replayed yet), False, or `view_geometry`


def prepare_replay(rec: OpRecord) -> tuple:
    """What replaying `rec` needs, worked out once: the flat arguments, their structure (None
    for a flat call), the positions to resolve, the positions of side-effect writes, the
    number of positional arguments and the keyword names."""
    marker = (OutRef, ExtRef, InputRef)
    if is_random_record(rec):
        raise RuntimeError(f"slackswap: a recompute chain would re-run the random op "
                           f"{rec.func}; this is a bug in slackswap, please report it")
    top = [*rec.args, *rec.kwargs.values()]

    def marks(y) -> bool:
        return isinstance(y, marker)
    if any(isinstance(a, (list, tuple, dict)) and
           any(marks(x) for x in pytree.tree_leaves(a, is_leaf=marks))
           for a in top):     # (a list of sizes is one argument; a list of tensors is not)
        flat, spec = pytree.tree_flatten((rec.args, rec.kwargs), is_leaf=marks)
    else:
        flat, spec = top, None
    todo = tuple(i for i, a in enumerate(flat) if isinstance(a, marker))
    written = tuple(written_positions(rec.func, list(rec.args),
                                      lambda a: isinstance(a, (torch.Tensor, *marker))))
    rec.prep = (tuple(flat), spec, todo, written, len(rec.args), tuple(rec.kwargs))
    return rec.prep


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def view_geometry(rec: OpRecord, args: list, out):
    """For a view op replayed as `out = rec.func(*args)` (one tensor, or a list of them:
    `split`): (its input's size, stride and offset; each output's size, stride and offset),
    so a later replay of `rec` on an input of that geometry is `Tensor.as_strided(input, ...)`
    per output, C calls instead of the boxed op (the same storage, sizes, strides and offset:
    the same aliasing and values). Only for a plain, strided, real view of the first argument
    (a chain value, or a tensor held as a constant: a parameter) whose other arguments are
    constants, each output's `_base` the input's own base, with the same dtype (no
    `view.dtype` or complex views) and no conjugate or negative bit; False otherwise."""
    _, spec, todo, written, _, _ = rec.prep
    outs = [out] if type(out) is torch.Tensor else out
    base = args[0] if args else None
    if (rec.wfirst or spec is not None or written or type(base) not in _PLAIN
            or todo != ((0,) if isinstance(rec.args[0], OutRef) else ())
            or type(outs) not in (list, tuple) or not outs
            or any(type(o) is not torch.Tensor for o in outs)):
        return False
    root = base if base._base is None else base._base
    if (base.is_complex() or base.layout != torch.strided or base.is_nested
            or base.is_quantized or base.is_conj() or base.is_neg() or any(
                o._base is not root or o.dtype != base.dtype or o.is_conj() or o.is_neg()
                or o.grad_fn is not None for o in outs)):
        return False
    return ((base.shape, base.stride(), base.storage_offset()),
            tuple((o.shape, o.stride(), o.storage_offset()) for o in outs))


def view_of(raw: torch.Tensor, dtype, shape, stride, offset) -> torch.Tensor:
    return torch.empty(0, dtype=dtype, device=raw.device).set_(raw.untyped_storage(), offset,
                                                                 shape, stride)
