"""Sizes in a graph torch.compile captured with symbolic shapes, read at the profiled step's.

After a second input shape (torch's automatic dynamic) or under `torch._dynamo.mark_dynamic`,
dynamo captures one graph for every size of a dimension: its fake tensors' sizes are SymInts
(`s0`, `2*s0`, `s0**2`). The plan was made at one shape, and its graph table holds concrete
shapes. `SymSizes` reads each size at the profiled step's values: each symbol's value is solved
from the graph's inputs against the profile's (`solve`), and an expression is evaluated there.
So the graph's ops line up with the profile's rows by the same keys as a static graph's, and
its saved and offloaded bytes are counted at the profiled shapes, comparable with the plan's.

Nothing here guards: `int(symint)` or `bool(symint == n)` would add a guard to dynamo's shape
environment, specialising the graph to this size (a recompile at every new length, and
`ConstraintViolationError` under `mark_dynamic`). Sizes are read from the symbolic expression
(`SymNode.expr`, substituted) and, where a symbol has no solved value, from its hint (the size
of the example that triggered this compile: `SymNode.hint`), also without a guard.

Private torch API: `SymInt.node` (a `torch.fx.experimental.sym_node.SymNode`: `.expr`, `.hint`),
listed in `torch_api.PRIVATE_API`.
"""
from __future__ import annotations

import sympy
import torch
import torch.fx as fx


def _expr(d):
    """The sympy expression of a symbolic size, or None for a plain int."""
    return d.node.expr if isinstance(d, torch.SymInt) else None


class SymSizes:
    """Sizes of one captured graph at the profiled step's values (see the module docstring).
    `subs`: symbol -> value; empty for a static graph, where every size is an int."""

    def __init__(self, subs: dict | None = None, symbolic: bool = False):
        self.subs = dict(subs or {})
        self.symbolic = symbolic        # the graph's inputs have symbolic sizes

    def solved(self) -> dict[str, int]:
        """symbol name -> its value in the profiled step."""
        return {str(k): int(v) for k, v in sorted(self.subs.items(), key=str)}

    def dim(self, d) -> int | str:
        """A size as an int at the profiled values; a symbolic one no solved symbol fixes as
        its expression's text (so it lines up with nothing)."""
        e = _expr(d)
        if e is None:
            return int(d)
        v = e.xreplace(self.subs)
        return int(v) if v.is_number else str(v)

    def count(self, d) -> int:
        """A size (a numel, a byte count) as an int: at the profiled values, else at the hint
        of the compile running now."""
        e = _expr(d)
        if e is None:
            return int(d)
        v = e.xreplace(self.subs)
        if v.is_number:
            return int(v)
        hint = d.node.hint
        return int(hint) if hint is not None else 0

    def nbytes(self, v: torch.Tensor) -> int:
        """The bytes of `v`'s storage."""
        return self.count(v.untyped_storage().nbytes())

    def dense(self, v: torch.Tensor) -> bool:
        """Whether `v` covers its storage exactly (read at the profiled values: the layout is
        the same at every size of a symbolic graph)."""
        return (self.count(v.storage_offset()) == 0
                and 0 not in [self.count(s) for s in v.stride()]
                and self.nbytes(v) == self.count(v.numel()) * v.element_size())


def solve(gm: fx.GraphModule, candidates: list[tuple[list, str | None]], dtype_name
          ) -> SymSizes:
    """The symbols of `gm`'s symbolic inputs at the profiled values: each input tensor with a
    symbolic size is paired with the first of `candidates` (the profile's shapes its inputs may
    have been: `[shape, dtype or None]`, the model's inputs first) of the same rank and dtype
    whose every size agrees (an int equal, a symbol unbound or bound to that value); the bare
    symbols take its values. A static graph gives an empty SymSizes."""
    subs: dict = {}
    symbolic = False
    for n in gm.graph.find_nodes(op="placeholder"):
        v = n.meta.get("val")
        if not isinstance(v, torch.Tensor) or all(_expr(d) is None for d in v.shape):
            continue
        symbolic = True
        name = dtype_name(v.dtype)
        for shape, dtype in candidates:
            bound = _bind(v.shape, shape, subs) if dtype in (None, name) else None
            if bound is not None:
                subs = bound
                break
    return SymSizes(subs, symbolic)


def _bind(sizes, shape, subs: dict) -> dict | None:
    """`subs` extended so that `sizes` read as `shape`, or None where they cannot."""
    if len(sizes) != len(shape):
        return None
    out = dict(subs)
    for d, want in zip(sizes, shape):
        e = _expr(d)
        if e is None:
            if int(d) != want:
                return None
            continue
        v = e.xreplace(out)
        if v.is_number:
            if int(v) != want:
                return None
        elif v.is_Symbol:
            out[v] = sympy.Integer(want)
    return out
