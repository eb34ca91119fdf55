"""The first call at input shapes no plan was made for: another shape's plan, followed without
a trace.

A new sequence length or batch size (dynamic padding, the last short batch) runs the same ops
at other sizes. Its first call (`NewShapeCall`) follows, pack by pack, the template of a signature
that differs only in its shapes (`templates.Template`, made from that signature's first call),
checking each saved tensor's rank, dtype and producing node type (not its sizes). Each pack:

- *keep*: kept while the guard admits it (`guard.py`'s rule) at the budget for these shapes,
  else swapped;
- *swap*: swapped, as planned;
- *recompute*: swapped. A chain replays recorded ops whose arguments (view sizes) are the
  other shapes', so this one call copies instead; training is exact either way.

The budget at these shapes is the plan's fraction of what a keep-all run holds at them (each
storage autograd saves, once). Before the call has seen every pack it is predicted: the bytes
seen so far plus the template's later packs at their old bytes times `guard.Scale`'s ratio for
their old shape, which each pack seen refines. At the end of the call it is exact, and the
borrowed plan (`signatures.PlanTable.borrow`) takes the limit and, per pack, what the plan keeps
after it (`pack_reserve`). The next call at these shapes is recorded on the borrowed plan
(run/eager/first_call.py, ops lined up by rank, not size), so its recomputes replay this shape's own
ops, and makes the template the calls after it follow (run/eager/steady_call.py). A call that
leaves the template (other control flow at the new shapes) goes on under the guard.

Cost per saved tensor: a storage lookup, a few additions and one dict lookup for the
prediction; no dispatch mode, no module hooks, no trace.
"""
from __future__ import annotations

import torch

from ...guard import Guard, Scale
from ...schema import Action
from .call_state import CallState
from .holding import count_fresh, guard_decision, swap
from .steady_call import same_node

__all__ = ["NewShapeCall"]

_KEEP, _SWAP = Action.KEEP, Action.SWAP


def groups(tpl) -> tuple[list, dict, dict]:
    """The template's packs by old shape: each pack's shape key, and per shape the bytes its
    packs added to the keep-all count (all of them; the kept ones). Made once per template."""
    got = tpl.shape_groups
    if got is None:
        keys = [tuple(n.shape) for n in tpl.seq]
        total: dict[tuple, int] = {}
        kept: dict[tuple, int] = {}
        for key, n, fresh in zip(keys, tpl.seq, tpl.fresh):
            total[key] = total.get(key, 0) + fresh
            if n.action is _KEEP:
                kept[key] = kept.get(key, 0) + fresh
        got = tpl.shape_groups = (keys, total, kept)
    return got


class NewShapeCall:
    """The first call at new input shapes, on another signature's template (see the module's
    docstring): `s`, its state; `plan`: the borrowed table (`PlanTable.borrow`), whose byte
    figures this call settles; `scale`: the shapes' `guard.Scale`; the rest, the prediction
    of what a keep-all run holds at these shapes, refined pack by pack."""
    __slots__ = ("s", "scale", "fraction", "fresh", "shape_keys", "rest_all", "rest_kept",
                 "ratio", "pred_all", "pred_kept")
    kind = "new_shape"

    def __init__(self, patched, plan, tpl, inputs: list, scale: Scale):
        self.s = s = CallState(self.kind, patched, plan, tpl, inputs)
        s.chain_uses = {}               # no chain runs here: recomputes are swapped
        s.guard = Guard(plan.limit)
        s.followed = (0, 0)             # (its guard's swaps are its own)
        self.scale = scale
        self.fraction = (plan.limit / tpl.saved_total
                         if plan.limit is not None and tpl.saved_total else None)
        self.fresh = [0] * s.n           # what each pack added to the keep-all count here
        self.shape_keys, total, kept = groups(tpl)
        self.rest_all, self.rest_kept = dict(total), {k: kept.get(k, 0) for k in total}
        self.ratio = {key: scale.ratio(key) for key in total}
        self.pred_all = sum(b * self.ratio[k] for k, b in total.items())
        self.pred_kept = sum(b * self.ratio[k] for k, b in kept.items())

    def pack(self, x: torch.Tensor):
        s = self.s
        i = s.i
        s.i = i + 1
        if i >= s.n or s.broken:
            return self.differs(x)
        p = s.seq[i]
        if x.dim() != len(p.shape) or x.dtype is not p.dtype or (
                type(x.grad_fn) is not p.node and not same_node(type(x.grad_fn), p.node)):
            return self.differs(x)
        kind = p.action
        self._see(i, kind, x)
        if kind is _KEEP:             # kept while the guard admits it, else swapped
            return guard_decision(s, x, None, None, self.reserve(), p.tracked)
        return swap(s, x, p.root, p.own and kind is _SWAP)

    def _see(self, i: int, kind, x: torch.Tensor) -> None:
        """Pack `i` seen at the new shapes: its old bytes leave the prediction, its own join
        the count, what its shape became refines the prediction of later packs; the guard's
        limit follows."""
        s = self.s
        key = self.shape_keys[i]
        old = s.tpl.fresh[i]
        ratio = self.ratio[key]
        if old:
            self.rest_all[key] -= old
            self.pred_all -= old * ratio
            if kind is _KEEP:
                self.rest_kept[key] -= old
                self.pred_kept -= old * ratio
        self.fresh[i] = count_fresh(s, x)
        if self.scale.observe(key, tuple(x.shape)):
            now = self.ratio[key] = self.scale.ratio(key)
            self.pred_all += self.rest_all[key] * (now - ratio)
            self.pred_kept += self.rest_kept[key] * (now - ratio)
        if self.fraction is not None:
            s.guard.limit = int(self.fraction * (s.saved_bytes + max(self.pred_all, 0)))

    def reserve(self) -> int:
        """What the plan keeps in the packs still to come, as predicted at these shapes."""
        return int(max(self.pred_kept, 0))

    def differs(self, x: torch.Tensor):
        """A pack that left the template: the guard decides from here on (the limit stays
        where the prediction last put it). It is counted like the others, so what a keep-all
        run holds at these shapes is known exactly at the end all the same."""
        s = self.s
        s.broken = True
        count_fresh(s, x)
        return guard_decision(s, x, None, None, self.reserve())

    def finish(self) -> bool:
        """After forward: settle the borrowed plan's byte figures (the limit: the plan's
        fraction of what a keep-all run holds here, every pack counted, exact even where the
        call left the template; what the plan keeps after each pack, where it did not).
        True when every pack lined up with the template."""
        s = self.s
        if s.i != s.n:
            s.broken = True
        ok = not s.broken
        t, tpl = s.t, s.tpl
        seen = s.saved_bytes
        t.scale = seen / tpl.saved_total if tpl.saved_total else 1.0
        if self.fraction is not None:
            t.limit = int(self.fraction * seen)
        if ok:
            reserve = [0] * (s.n + 1)      # [m]: what the plan keeps from pack m on
            for m in range(s.n - 1, -1, -1):
                reserve[m] = reserve[m + 1] + (self.fresh[m] if s.seq[m].action is _KEEP
                                               else 0)
            t.pack_reserve = reserve
        return ok
