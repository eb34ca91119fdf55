"""The first call at input shapes no plan was made for: another shape's plan, followed without
a trace.

A new sequence length or batch size (dynamic padding, the last short batch) runs the same ops
at other sizes. Its first call (`ShapeRun`) follows, pack by pack, the template of a signature
that differs only in its shapes (`steady.Template`, made from that signature's first call),
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
(`record.PlanRun`, ops lined up by rank, not size), so its recomputes replay this shape's own
ops, and makes the template the calls after it follow (`steady.SteadyRun`). A call that
leaves the template (other control flow at the new shapes) goes on under the guard.

Cost per saved tensor: a storage lookup, a few additions and one dict lookup for the
prediction; no dispatch mode, no module hooks, no trace.
"""
from __future__ import annotations

import torch

from ..guard import Guard, Scale
from ..schema import Action
from ..trace.storage import storage_key, storage_nbytes
from .steady import SteadyRun, Template, _same_node
from .swap import Storages

__all__ = ["ShapeRun"]

_KEEP, _SWAP = Action.KEEP, Action.SWAP


def _groups(tpl: Template) -> tuple[list, dict, dict]:
    """The template's packs by old shape: each pack's shape key, and per shape the bytes its
    packs added to the keep-all count (all of them; the kept ones). Made once per template."""
    got = tpl.__dict__.get("shape_groups")
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


class ShapeRun(SteadyRun):
    """The first call at new input shapes, on another signature's template (see the module's
    docstring). `plan`: the borrowed table (`PlanTable.borrow`), whose byte figures this call
    settles; `scale`: the shapes' `guard.Scale`."""
    noting = False
    recorded = False

    def __init__(self, patched, plan, tpl: Template, inputs: list, scale: Scale):
        super().__init__(patched, plan, tpl, inputs)
        self.chain_uses = {}            # no chain runs here: recomputes are swapped
        self.scale = scale
        self.guard = Guard(plan.limit)
        self.fraction = (plan.limit / tpl.saved_total
                         if plan.limit is not None and tpl.saved_total else None)
        self.saved_keys = Storages()
        self.saved_bytes = 0
        self.fresh = [0] * self.n        # what each pack added to the keep-all count here
        self.shape_keys, total, kept = _groups(tpl)
        self.rest_all, self.rest_kept = dict(total), {k: kept.get(k, 0) for k in total}
        self.ratio = {key: scale.ratio(key) for key in total}
        self.pred_all = sum(b * self.ratio[k] for k, b in total.items())
        self.pred_kept = sum(b * self.ratio[k] for k, b in kept.items())

    def pack(self, x: torch.Tensor):
        i = self.i
        self.i = i + 1
        if i >= self.n or self.broken:
            return self._differs(x)
        p = self.seq[i]
        if x.dim() != len(p.shape) or x.dtype is not p.dtype or (
                type(x.grad_fn) is not p.node and not _same_node(type(x.grad_fn), p.node)):
            return self._differs(x)
        kind = p.action
        self._see(i, kind, x)
        if kind is _KEEP:
            return self._hold(x, p.tracked)
        return self._swap(x, p.root, p.own and kind is _SWAP)

    def _see(self, i: int, kind, x: torch.Tensor) -> None:
        """Pack `i` seen at the new shapes: its old bytes leave the prediction, its own join
        the count, what its shape became refines the prediction of later packs; the guard's
        limit follows."""
        key = self.shape_keys[i]
        old = self.tpl.fresh[i]
        ratio = self.ratio[key]
        if old:
            self.rest_all[key] -= old
            self.pred_all -= old * ratio
            if kind is _KEEP:
                self.rest_kept[key] -= old
                self.pred_kept -= old * ratio
        self.fresh[i] = self._count_fresh(x)
        if self.scale.observe(key, tuple(x.shape)):
            now = self.ratio[key] = self.scale.ratio(key)
            self.pred_all += self.rest_all[key] * (now - ratio)
            self.pred_kept += self.rest_kept[key] * (now - ratio)
        if self.fraction is not None:
            self.guard.limit = int(self.fraction * (self.saved_bytes + max(self.pred_all, 0)))

    def _hold(self, x: torch.Tensor, tracked: bool):
        """A tensor the plan keeps: kept while the guard admits it, else swapped."""
        if x.device.type == "meta":
            return x.detach()
        key = storage_key(x)
        if key in self.external:        # a parameter, buffer or input: not held for it
            return x.detach()
        if self.guard.admit(key, storage_nbytes(x), self._reserve()):
            return self._kept(x) if tracked else x.detach()
        return self._swap(x, None, False)

    def _reserve(self) -> int:
        """What the plan keeps in the packs still to come, as predicted at these shapes."""
        return int(max(self.pred_kept, 0))

    def _differs(self, x: torch.Tensor):
        """A pack that left the template: the guard decides from here on (the limit stays
        where the prediction last put it). It is counted like the others, so what a keep-all
        run holds at these shapes is known exactly at the end all the same."""
        self.broken = True
        self._count_fresh(x)
        return self._unplaced(x, None, None)

    def guarded(self) -> tuple[int, int]:
        return self.guard.swaps, self.guard.swapped_bytes

    def held_at_end(self) -> int:
        return self.guard.held

    def finish(self) -> bool:
        """After forward: settle the borrowed plan's byte figures (the limit: the plan's
        fraction of what a keep-all run holds here, every pack counted, exact even where the
        call left the template; what the plan keeps after each pack, where it did not).
        True when every pack lined up with the template."""
        ok = super().finish()
        t, tpl = self.t, self.tpl
        seen = self.saved_bytes
        t.scale = seen / tpl.saved_total if tpl.saved_total else 1.0
        if self.fraction is not None:
            t.limit = int(self.fraction * seen)
        if ok:
            reserve = [0] * (self.n + 1)      # [m]: what the plan keeps from pack m on
            for m in range(self.n - 1, -1, -1):
                reserve[m] = reserve[m + 1] + (self.fresh[m] if self.seq[m].action is _KEEP else 0)
            t.pack_reserve = reserve
        return ok
