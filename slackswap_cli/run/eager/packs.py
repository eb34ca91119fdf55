"""The typed records of the eager runtime's hot path, read by name.

- `PackNote`: what a recorded call (`first_call.FirstCall`) notes at each saved-tensor pack,
  for the calls after it (filled in as the pack decides);
- `TemplatePack`: one pack of a steady-state template (`templates.Template.seq`), what a later
  call checks and does at that pack;
- `SwappedRef` and `RecomputedRef`: what autograd holds for a swapped or recomputed saved
  tensor (the pack hook returns one, the unpack hook hands the tensor back: fetched or made
  in the first backward, fetched or made again in a later one through a retained graph);
- `SteadyRoute` and `NewShapeRoute`: the route a call takes (`inplace._Patched.forward`): a
  later call at a signature with a template, or the first call at new shapes following another
  shape's template;
- `STATE`: `STATE.run`, the `call_state.CallState` of the training call running on this
  thread (None: none, or a chain replaying).

Nothing here imports the rest of the package: run/eager/inplace.py reads it on every call.
"""
from __future__ import annotations

import threading
from typing import Any, NamedTuple

__all__ = ["PackNote", "TemplatePack", "SwappedRef", "RecomputedRef", "SteadyRoute",
           "NewShapeRoute", "STATE"]

STATE = threading.local()        # .run: the call running on this thread


class PackNote:
    """One pack of a recorded call: the saved tensor's `shape`, `dtype` and autograd `node`
    type; the `action` taken and its `root` (None: the guard's swap); its output `loc` in the
    records and `base_loc`, its `_base`'s (None: not this forward's); `tracked`: weakly
    tracked as kept; `own`: swapped as its root's own storage; `held`: the guard's count
    before it; `fresh`: the bytes it added to what a keep-all run holds; `versions`: the
    tensor's version and its `_base`'s (None: no base) at the pack."""
    __slots__ = ("shape", "dtype", "action", "root", "loc", "tracked", "base_loc", "own",
                 "node", "held", "fresh", "versions")

    def __init__(self, shape, dtype, action, loc, base_loc, node, held: int, fresh: int,
                 versions: tuple = (None, None)):
        self.shape, self.dtype, self.action, self.root = shape, dtype, action, None
        self.loc, self.tracked, self.base_loc, self.own = loc, loc is not None, base_loc, False
        self.node, self.held, self.fresh, self.versions = node, held, fresh, versions


class TemplatePack(NamedTuple):
    """One pack of a steady-state template: the `shape`, `dtype` and autograd `node` type a
    later call checks; the `action` and `root`; `loc` (the record output it was); `tracked`
    (kept with a weak reference, for `held_device_bytes`); `binds`: [(loc, via its `_base`?)]
    of values a chain reads that this pack hands over, or None; `own`: a swap of the root's
    own storage."""
    shape: Any
    dtype: Any
    node: Any
    action: Any
    root: int | None
    loc: tuple | None
    tracked: bool
    binds: list | None
    own: bool


class SwappedRef:
    """What autograd holds for a swapped saved tensor: the copy of its storage (`copy`, a
    `swap.StorageCopy`), its host bytes (`host`, a `swap.HostCopy`: held here, so as long as
    the graph may unpack it again) and the view of it to hand back (`whole`: the very
    geometry of the tensor the copy was made of, so the fetched tensor is handed back as
    it is); `taken`: handed back already (a later unpack fetches `host` again)."""
    __slots__ = ("taken", "root", "copy", "host", "dtype", "shape", "stride", "offset",
                 "whole")

    def __init__(self, root, copy, host, dtype, shape, stride, offset, whole: bool = False):
        self.taken, self.root, self.copy, self.host = False, root, copy, host
        self.dtype, self.shape, self.stride, self.offset = dtype, shape, stride, offset
        self.whole = whole


class RecomputedRef:
    """What autograd holds for a recomputed saved tensor: its `root` and record output `loc`,
    resolved in backward once its chain ran; `taken`: handed back already (a later unpack
    makes it again: `backward.remake`)."""
    __slots__ = ("taken", "root", "loc")

    def __init__(self, root: int, loc: tuple):
        self.taken, self.root, self.loc = False, root, loc


class SteadyRoute(NamedTuple):
    """A later call's route (`Templates.hot`): its `plan`, signature `sig` and `template`."""
    plan: Any
    sig: tuple
    template: Any


class NewShapeRoute(NamedTuple):
    """The first call at new shapes (`SignaturePlans.first_at`): the `template` it follows, the
    shapes' `scale` (`guard.Scale`) and the plan it runs on (`runner`: None, the one
    borrowed; else the superseded call's plan)."""
    template: Any
    scale: Any
    runner: Any
