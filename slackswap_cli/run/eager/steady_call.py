"""The steady state of `patch(model)`: later calls at a signature run the plan on saved-tensor
hooks alone.

The first call at an input signature (run/eager/first_call.py) records every aten op under a
`TorchDispatchMode`, lines it up with the profile and decides, pack by pack, what autograd holds.
Once that call's backward ran every chain it deferred, `templates.Template` keeps what a later
call needs from it; `SteadyCall` (or `KeepAllCall`, for a keep-all plan) is such a later call's
policy over its `call_state.CallState`. What costs what, and why:

- **per forward op: nothing.** No dispatch mode, no module hooks (they are registered for a
  full record and removed after it): an op that saves nothing for backward runs as in eager.
- **per saved tensor, keep-all plan (`KeepAllCall`):** nothing: there is nothing to do, so the
  call runs without saved-tensor hooks (autograd saves as in eager) unless it measures.
- **per saved tensor (pack hook), any other plan (`SteadyCall`):** a counter, one record
  (`Template.seq`, a `packs.TemplatePack`, precomputed) and three checks: shape, dtype and the
  type of the autograd node that made it, so other control flow at the same shapes is caught
  (from the first difference on, the call's saved tensors are the guard's to place, and the
  next call records again). Then the noted action: *keep* returns `x.detach()`; *swap* copies
  its storage to the host (one copy per storage; the tensor as it is where it covers its
  storage exactly: `holding.swap`); *recompute* returns a reference. A pack that
  hands a value to a chain (the template knows which) binds an alias of it by position.
- **why aliases:** autograd is never handed `x` itself, and a call holds only aliases (see
  `holding.keep`): otherwise a forward dropped without backward leaks, through cycles
  Python's collector cannot see.
- **measuring** what a call holds (`held_device_bytes`) is opt-in on later calls,
  `model.forward.__slackswap__.measure_held = True` (verify, the benchmarks and the tests set
  it): then kept packs take a weak reference each (a keep-all call then runs with hooks, its
  pack `holding.keep`).
- **per unpack:** run/eager/backward.py, the same path as the first call's: a tensor comes back as
  it is; a swapped one is fetched (prefetches issued at the plan's points); the first unpack
  of a recomputed root runs its chain, whose records and roots are worked out on the first
  steady call and kept on the template; a view whose input has the geometry noted at its first
  replay is `Tensor.as_strided` at the noted output geometry (`recorded.view_geometry`).
- **per step:** one dict lookup (`Templates.hot`) by the key of the call (the first
  parameter's device and dtype, the inputs' shapes and dtypes: one loop) for the plan and the
  template; for a plan that recomputes or swaps, whether the very parameter and buffer tensors
  still sit in their module slots and the autocast state is unchanged (`Fingerprint.holds`: a
  C-level walk over a flat list, no module tree); a few fresh containers.
- **per new signature:** a full record (the first call), possibly a new plan (`run/eager/replan.py`).

Limits: a divergence that keeps every saved tensor's shape, dtype and producing node type at
every position before a recomputed one is not caught; `model.forward.__slackswap__.steady =
False` records every call.
"""
from __future__ import annotations

import weakref
from functools import partial

import torch

from ...guard import Guard
from ...schema import Action
from .call_state import CallState
from .holding import guard_decision, keep, plan_reserve, swap
from .packs import RecomputedRef

__all__ = ["SteadyCall", "KeepAllCall", "follow", "same_node"]

_KEEP, _SWAP = Action.KEEP, Action.SWAP

# autograd nodes that record the same thing under another name: `reshape` is `_reshape_alias`
# in plain eager and `view` under a Python dispatch mode (the first call's recorder)
_ALIKE = ({"ViewBackward0", "ReshapeAliasBackward0"},)


def same_node(got, want) -> bool:
    names = {getattr(got, "__name__", None), getattr(want, "__name__", None)}
    return any(names <= alike for alike in _ALIKE)


def follow(tpl, patched, plan, inputs: list):
    """A later call's policy on template `tpl`: `KeepAllCall` for a keep-all plan, else
    `SteadyCall`."""
    return (KeepAllCall if tpl.keep_only else SteadyCall)(patched, plan, tpl, inputs)


class SteadyCall:
    """A later call at a signature whose first call made a template (see the module's
    docstring): the pack follows the template's decisions by position."""
    __slots__ = ("s",)
    kind = "steady"

    def __init__(self, patched, plan, tpl, inputs: list):
        self.s = CallState(self.kind, patched, plan, tpl, inputs)

    def pack(self, x: torch.Tensor):
        s = self.s
        i = s.i
        s.i = i + 1
        if i >= s.n or s.broken:
            return self.differs(x)
        p = s.seq[i]
        if x.shape != p.shape or x.dtype is not p.dtype or (
                type(x.grad_fn) is not p.node and not same_node(type(x.grad_fn), p.node)):
            return self.differs(x)
        binds = p.binds
        kind = p.action
        kept = None
        if binds is not None:
            bound = s.bound
            for bloc, via_base in binds:
                v = x._base if via_base else x
                if v is None:
                    return self.differs(x)
                if via_base or kind is not _KEEP:
                    bound[bloc] = v.detach()     # (an alias: see `holding.keep`)
                else:       # the very alias autograd holds (a later backward reads it weakly)
                    if kept is None:
                        kept = keep(s, x) if p.tracked else x.detach()
                    bound[bloc] = kept
                s.bound_version[bloc] = v._version
        if kind is _KEEP:
            if kept is None:
                kept = keep(s, x) if p.tracked else x.detach()  # (never `x`: `holding.keep`)
            if p.loc is not None:      # (a later backward through a retained graph reads it
                s.kept_alias[p.loc] = weakref.ref(kept)         # weakly: `backward.live`)
                s.bound_version.setdefault(p.loc, x._version)
            return kept
        r = p.root
        if kind is _SWAP:
            return swap(s, x, r, p.own)
        packs = s.packs
        packs[r] = packs.get(r, 0) + 1
        owner = s.table.made_by[r]
        got = s.deferred.get(owner)
        if got is None:
            s.deferred[owner] = {r}
        else:
            got.add(r)
        return RecomputedRef(r, p.loc)

    def differs(self, x: torch.Tensor):
        """A pack that left the template (other control flow at the same shapes): from here
        on what autograd saves is the plan's no longer, so the guard decides (`guard.py`),
        counting on from where the first call's count stood at this pack."""
        s = self.s
        if not s.broken:
            s.broken = True
            s.guard = Guard(s.t.limit)
            s.guard.held = s.tpl.held_at[min(s.i - 1, s.n)]
        return guard_decision(s, x, None, None, plan_reserve(s))

    def finish(self) -> bool:
        """After forward: did every pack line up with the template?"""
        s = self.s
        if s.i != s.n:
            s.broken = True
        return not s.broken


class KeepAllCall:
    """A later call of a keep-all plan: nothing to do per saved tensor, so no saved-tensor
    hooks at all (`pack` is None): autograd saves as in eager. Nothing depends on which tensor
    is which (no counter, no checks) and no parameter is read (no fingerprint either).
    Measuring (`measure_held`), the hooks are on: the pack notes an alias of each tensor
    (`holding.keep`)."""
    __slots__ = ("s", "pack")
    kind = "keep_all"

    def __init__(self, patched, plan, tpl, inputs: list):
        self.s = s = CallState(self.kind, patched, plan, tpl, inputs)
        self.pack = partial(keep, s) if s.measuring else None   # (not a method: no cycle)

    def finish(self) -> bool:
        """After forward: nothing to line up (every pack is kept as it is)."""
        return True
