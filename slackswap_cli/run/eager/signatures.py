"""Which plan each input signature of a patched model gets.

A signature is the device type, the parameters' dtype, then the shapes and dtypes of a call's
tensors in order (`signature`). Each gets its own plan (`SignaturePlans.plan_for`): the
profiled one; one made at other shapes, borrowed without a trace (`_borrow`: run/eager/new_shape.py
follows another shape's template, or the call is recorded on the plan lent to these shapes,
its guard limit scaled); one made on the fly from a fake trace (run/eager/replan.py: another device
or dtype, or where a borrowed plan does not line up); or, with `strict`, a refusal.
`PlanTable` is one plan's table (`chains.runtime_table`) with the lookups the runtime derives
from it.
"""
from __future__ import annotations

import copy
import math
import time
from typing import TYPE_CHECKING

import torch
import torch.utils._pytree as pytree

from ...errors import FingerprintMismatch
from ...units import dtype_name
from ..notes import brief, shapes, tell
from .packs import NewShapeRoute
from .tables import RunTable

if TYPE_CHECKING:
    from ...guard import Scale

__all__ = ["PlanTable", "SignaturePlans", "signature", "leaves", "tensors", "alike",
           "first_guess", "NESTED"]


class PlanTable:
    """One plan's table (`chains.runtime_table`) and the lookups derived from it. A table
    `borrow`ed for other input shapes (`new_shape.py`) has its own byte figures: the guard's
    limit, what the plan keeps after each pack (`pack_reserve`, once a call at those shapes
    saw them) or the factor `keep_after` is scaled by."""
    borrowed = False
    pack_reserve: list[int] | None = None
    scale = 1.0
    fraction: float | None = None   # borrowed, limit not settled: of the keep-all bytes
    limit_made_at = 0               # (then: the limit at the shapes it was made for)

    def __init__(self, table, budget_bytes: int | None = None):
        self.table = t = RunTable.of(table)
        # what the guard holds a call to (`guard.py`): the plan's budget (none: no limit)
        limit = t.budget_bytes if t.budget_bytes is not None else budget_bytes
        self.limit = limit if limit and limit > 0 else None
        self.op_inputs = t.op_inputs
        self.non_activation = set(t.non_activation)
        self.last_write = t.last_write
        # roots chains read: `chain_uses` counts the chains that read each one. Kept (and
        # not yet offloaded) ones are held from production (`pin_roots`) until those chains
        # ran; recomputed or fetched ones stay after autograd took them until then too.
        self.chain_uses: dict[int, int] = {}
        for ins in t.chain_inputs.values():
            for r in ins:
                self.chain_uses[r] = self.chain_uses.get(r, 0) + 1
        self.pin_roots = {r for r in self.chain_uses
                          if t.action.get(r) != "recompute"}   # (schema.Action's value)
        self._trace_only = None

    @property
    def trace_only(self) -> frozenset[int]:
        """The profile's ops eager may not run (`lineup.trace_only_ops`): not counted as
        missed. Worked out on first use (the line-up's module loads with the first call)."""
        if self._trace_only is None:
            from .lineup import trace_only_ops
            self._trace_only = trace_only_ops(self.table.ops)
        return self._trace_only

    def borrow(self) -> "PlanTable":
        """This plan for other input shapes: the same table, its byte figures its own."""
        got = copy.copy(self)
        got.borrowed, got.pack_reserve = True, None
        return got

    def lend(self, fraction: float, ratio: float) -> "PlanTable":
        """This plan borrowed for a call recorded at other shapes before its limit there is
        known: `fraction` of the keep-all bytes (settled by that call: `settle`), the limit
        meanwhile this plan's times `ratio`, the guess of how those bytes grow."""
        got = self.borrow()
        got.fraction, got.limit_made_at = fraction, self.limit
        got.limit, got.scale = int(self.limit * ratio), ratio
        return got

    def settle(self, saved_bytes: int) -> None:
        """A lent plan's limit, once its call counted what a keep-all run holds there."""
        self.limit = int(self.fraction * saved_bytes)
        self.scale = self.limit / self.limit_made_at
        self.fraction = None


def signature(device_type: str, param_dtype: str, args, kwargs) -> tuple:
    """The device type, the parameters' dtype, then shapes and dtypes of a call's tensors in
    order: what a plan is made for (another device runs other kernels: a fake CPU profile's
    plan on a GPU; `.to(torch.float64)` is another graph at twice the bytes)."""
    return (device_type, dtype_name(param_dtype),
            *((tuple(x.shape), dtype_name(x.dtype))
              for x in leaves(args, kwargs) if isinstance(x, torch.Tensor)))


def leaves(args, kwargs) -> list:
    """pytree's leaves of (args, kwargs), without pytree for flat calls (the common case)."""
    flat = [*args, *kwargs.values()]
    for a in flat:
        if isinstance(a, NESTED):
            return pytree.tree_leaves((args, kwargs))
    return flat


NESTED = (list, tuple, dict)


def tensors(args, kwargs) -> list:
    """The call's tensors, in `leaves` order."""
    return [x for x in leaves(args, kwargs) if isinstance(x, torch.Tensor)]


def first_guess(plan: PlanTable, old: tuple, new: tuple) -> tuple[float, float] | None:
    """For a call at signature `new` recorded on `plan`, made at `old`, before any call ran on
    it: (the plan's fraction of the keep-all bytes, as its profile saved them at `old`; the
    factor those bytes are guessed to grow by at `new`). The guess is the lower of two
    `guard.Scale` predictions, each saved shape's (`saved_by_shape`: it over-predicts where a
    dimension equals a changed size by chance, a head dimension of 16 at length 16) and the
    largest input's (it under-predicts tensors quadratic in the length, such as attention
    scores, where the length grows). The lower one, because the guard holds the call to the
    guessed limit and what it holds is judged against the limit the call settles (the plan's
    fraction of what it saved): a guess too high would let it hold more. None:
    the plan has no limit or its table no saved bytes (written before it named them)."""
    by_shape = plan.table.saved_by_shape
    made_at = sum(b for _, b in by_shape) if by_shape else 0
    if not made_at or plan.limit is None or plan.borrowed:
        return None
    scale = shape_scale(old, new)
    per_shape = sum(b * scale.ratio(tuple(shape)) for shape, b in by_shape) / made_at
    return plan.limit / made_at, min(per_shape, largest_input_ratio(old, scale))


def shape_scale(old: tuple, new: tuple) -> Scale:
    """`guard.Scale` from signature `old`'s input shapes to signature `new`'s."""
    from ...guard import Scale  # (the guard loads with a call's machinery, not at import)
    return Scale([shape for shape, _ in old[2:]], [shape for shape, _ in new[2:]])


def largest_input_ratio(old: tuple, scale: Scale) -> float:
    """How much `old`'s largest input (by elements) grows under `scale`: a first guess."""
    return scale.ratio(max((shape for shape, _ in old[2:]), key=math.prod, default=()))


def alike(a: tuple, b: tuple) -> bool:
    """Do signatures `a` and `b` differ only in their shapes (device, parameter dtype, each
    input's dtype and rank the same)?"""
    return a[:2] == b[:2] and len(a) == len(b) and all(
        x[1] == y[1] and len(x[0]) == len(y[0]) for x, y in zip(a[2:], b[2:]))


class SignaturePlans:
    """The plan each input signature gets (see the module docstring), for the patch `p` (an
    `inplace._Patched`: its model, settings and templates): `plans`, signature -> its plan
    (None: the profiled one, `default`, runs there); `fast_plans`, a call's key -> (plan,
    signature); `first_at`, new shapes -> the `packs.NewShapeRoute` their first call takes;
    `keep_all`, signature -> the bytes a keep-all run holds there."""
    __slots__ = ("p", "plans", "default", "fast_plans", "first_at", "keep_all")

    def __init__(self, patched, plans: dict):
        self.p = patched
        self.plans: dict[tuple, PlanTable | None] = plans
        self.default = next(iter(plans.values()))
        self.fast_plans: dict[tuple, tuple] = {}
        self.first_at: dict[tuple, NewShapeRoute] = {}
        self.keep_all: dict[tuple, int] = {}

    def forget(self, sig) -> None:
        """`sig`'s plan was made again: calls find it anew."""
        self.fast_plans = {k: v for k, v in self.fast_plans.items() if v[1] != sig}

    def plan_for(self, args, kwargs, key: tuple) -> tuple["PlanTable", tuple]:
        """The plan for this call's signature (device, parameter dtype, input shapes and
        dtypes): the profiled one, or one made for it the first time it is seen (said once
        on stderr), cached; and the signature. `key`: `_Patched.key`'s."""
        got = self.fast_plans.get(key)
        if got is None:
            got = self.fast_plans[key] = self._plan_for(args, kwargs, self.p._first_param())
        return got

    def _plan_for(self, args, kwargs, ref) -> tuple["PlanTable", tuple]:
        sig = signature(ref.device.type if ref is not None else "cpu",
                         str(ref.dtype if ref is not None else torch.float32), args, kwargs)
        if sig in self.plans:
            return self.plans[sig] or self.default, sig
        if self.p.strict:
            profiled = next(iter(self.plans))
            raise FingerprintMismatch(
                f"the model was called with {shapes(sig)}, the plan was made for "
                f"{shapes(profiled)} (patched with strict=True)",
                hint="re-profile at these shapes, or patch without strict=True to plan for "
                     "them on the fly")
        plan = None
        if self.p.replan and self.p.steady:
            got = self._borrow(sig)
            if got is not None:
                return got, sig
        if self.p.replan and self.p.branchy:
            # this model's calls read values its fake trace cannot (`branches.py`): the first
            # call at these shapes runs held by the guard, then one trace along its branches
            # plans for the calls after it (`_follow_branches`), instead of two traces
            self.plans[sig] = None
            return self.default, sig
        if self.p.replan:
            t0 = time.perf_counter()
            try:
                from . import replan as replanning  # (the tracer and planners: only here)
                table, what = replanning.replan_table(self.p.model, self.p.original_forward, args,
                                                      kwargs, self.p.meta)
                plan = PlanTable(table)
                tell(f"new inputs {shapes(sig)}: planned for them in "
                     f"{time.perf_counter() - t0:.1f} s ({what})")
            except Exception as exc:
                tell(f"new inputs {shapes(sig)}: could not plan for them ({brief(exc)}); "
                     "running with the profiled plan")
        self.plans[sig] = plan
        return plan or self.default, sig

    def _borrow(self, sig) -> "PlanTable | None":
        """A plan for new input shapes without a trace (`new_shape.py`): the plan of a
        signature that differs from `sig` only in its shapes (same device, dtypes and ranks)
        and whose first call made a template, borrowed; the first call at `sig` follows that
        template (`self.first_at`). Where none has a template of its plan, but one had its
        first call recorded on a plan since made again (along its branches), the first call
        at `sig` follows that call's template, on that plan, held by the guard to the new
        plan's fraction of the keep-all bytes (the packs are eager's, whatever the plan: the
        template's keep-all bytes are the new plan's too), and the new plan is borrowed for
        the calls after it (`_superseded`). Where no such signature has a template yet but
        one has a plan and a recorded call, that plan, recorded at `sig`; where none has had
        a call yet (the run's first call, at other shapes than the profiled ones), the plan,
        recorded at `sig`, its limit first guessed from its profile (`first_guess`). None
        when neither (a table written before it named its saved bytes)."""
        similar = [(other, plan) for other, plan in self.plans.items()
                   if plan is not None and plan.fraction is None and alike(other, sig)]
        for other, plan in similar:
            tpl = self.p.templates.get(other)
            if tpl is None:
                continue
            got = self.plans[sig] = plan.borrow()
            if tpl.keep_only:              # keeps everything, at any shape: nothing to scale
                self.p.templates.by_sig[sig] = tpl
            else:
                self.first_at[sig] = NewShapeRoute(tpl, shape_scale(other, sig), None)
            return got
        for other, plan in similar:
            old = self.p.templates.superseded_of(other)
            if old is None or plan.limit is None:
                continue
            tpl, ran_on = old
            got = self.plans[sig] = plan.borrow()
            runner = ran_on.borrow()
            runner.limit = plan.limit       # (the new plan's fraction: `NewShapeCall.fraction`)
            self.first_at[sig] = NewShapeRoute(tpl, shape_scale(other, sig), runner)
            return got
        for other, plan in similar:
            # no template yet (its plan was just made): the first call at `sig` is recorded
            # on that plan, its limit scaled by the inputs' sizes until the call has counted
            # what a keep-all run holds here (then the plan's fraction of it)
            made_at = self.keep_all.get(other)
            if made_at and plan.limit is not None:
                ratio = largest_input_ratio(other, shape_scale(other, sig))
                got = self.plans[sig] = plan.lend(plan.limit / made_at, ratio)
                return got
        for other, plan in similar:
            guess = first_guess(plan, other, sig)
            if guess is not None:
                got = self.plans[sig] = plan.lend(*guess)
                return got
        return None
