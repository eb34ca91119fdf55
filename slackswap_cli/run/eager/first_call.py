"""The first call at a signature of a patched model: its forward recorded, each saved tensor decided.

`patch(model, meta, table)` replaces `model.forward` (an instance attribute, so `unpatch`
restores the class's) with a wrapper. In eval mode or with grad disabled the wrapper calls the
original forward and does nothing else. In training, the first call at an input signature runs
the original forward under two things:

- **a recorder** (`Recorder`, a `TorchDispatchMode`): every aten op the model's forward bodies
  run is recorded (`record`: its function, its arguments with produced tensors replaced by
  references, weak references to its outputs and their versions) and aligned with the
  profile's forward ops (`RunTable.ops`, from `chains.runtime_table`): an op matches the next
  expected op, within a bounded window, with the same target, first output shape and module
  path that reads activations when the profile's does and no profile value it does not. Ops in
  module hooks (FSDP2's unshard and reshard, a wrapper's casts) are not recorded, except a
  hook's view of a recorded value; ops the profile does not have (a mask built another way in
  eager) stay unplanned.
- **saved-tensor hooks**: when autograd saves a tensor for backward, the plan's action for its
  storage root decides what autograd holds instead (`FirstCall.pack`). *keep*: an alias of the
  tensor (`holding.keep`); *swap*: a handle to a host copy of the tensor's whole storage
  (`holding.swap`: one copy per storage, shared by every view saved of it; a root an in-place
  op still has to write is kept, not copied); *recompute*: a reference, resolved in backward by
  replaying the root's chain (run/eager/backward.py). A root is recomputed only when every op it
  depends on lined up, reads the roots the profile says and is not random (`usable`); a saved
  tensor the plan cannot place is kept or swapped by the guard's rule (`holding.guard_decision`,
  guard.py). Each pack notes what it did (`packs.PackNote`), for the calls after this one
  (`templates.Template`).

Correctness never depends on the alignment being right: a replay runs the very functions and
arguments the forward ran, on the same values (kept tensors are held, swapped ones come back
bit for bit, views are re-derived), under `no_grad` with autocast off (the recorded ops already
carry every cast), with side-effect writes (BatchNorm statistics) sent to copies.

The parts: the line-up (run/eager/lineup.py, `LineUp`), what the recorder keeps of each op
(run/eager/recorded.py), the call's state (run/eager/call_state.py), what autograd holds
(run/eager/holding.py), the backward path (run/eager/backward.py). Later calls at the signature follow
this one's template (run/eager/steady_call.py).
"""
from __future__ import annotations

import weakref

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ...schema import Action
from ...trace.aten import written_returns
from ...trace.storage import storage_id, storage_key
from ..parallel import dtensor
from .call_state import CallState
from .holding import count, count_fresh, guard_decision, keep, plan_reserve, swap
from .packs import PackNote, RecomputedRef
from .recorded import ExtRef, OpRecord, OutRef, alias_flags, is_random_record

__all__ = ["FirstCall", "Recorder", "record"]

_LOCAL_SCALAR = torch.ops.aten._local_scalar_dense.default   # a value Python reads
_WAIT = torch.ops._c10d_functional.wait_tensor.default        # (tensor parallel: run/parallel/dtensor.py)


class FirstCall:
    """The policy of a recorded call (see the module docstring): `pack` decides and notes
    each saved tensor; `finish` has nothing to check."""
    __slots__ = ("s",)
    kind = "first"

    def __init__(self, patched, plan, inputs: list):
        self.s = CallState(self.kind, patched, plan, None, inputs)

    def pack(self, x: torch.Tensor):
        s = self.s
        s.recording = False
        try:
            return self._pack(s, x)
        finally:
            s.recording = True

    def _pack(self, s: CallState, x: torch.Tensor):
        loc = s.where.get(x)
        base = x._base
        note = PackNote(x.shape, x.dtype, Action.KEEP, loc,
                        None if base is None else s.where.get(base), type(x.grad_fn),
                        s.guard.held, 0 if loc is None else count_fresh(s, x),
                        (x._version, None if base is None else base._version))
        s.seq.append(note)
        tid = None if loc is None else s.tid_of.get(loc)
        if tid is None:       # not the profile's (or not made by this forward: not counted)
            return x.detach() if loc is None else guard_decision(s, x, loc, note,
                                                                  plan_reserve(s))
        r = s.root(tid)
        act = s.table.action.get(r)
        if act is None and r not in s.table.bwd_use and r not in s.t.non_activation:
            # a value the profile's backward does not read but eager's autograd saves (a
            # node that saves more than the traced backward needs): not the plan's to place
            return guard_decision(s, x, loc, note, plan_reserve(s))
        if act == Action.SWAP and s.t.last_write.get(r, -1) >= s.lineup.ptr:
            # still to be written in place (a GRU cell's gates): a copy made now would miss
            # those writes, so it is kept as eager keeps it (and counted)
            return keep(s, x, loc)
        if act == Action.SWAP:
            mine = s.root_storage.get(r)
            note.action, note.root = Action.SWAP, r
            note.own = (mine is not None and mine[0] == storage_key(x)
                        and not mine[1].expired())
            return swap(s, x, r, note.own)
        if act == Action.RECOMPUTE and usable(s, r) and known(s, loc):
            note.action, note.root = Action.RECOMPUTE, r
            s.packs[r] = s.packs.get(r, 0) + 1
            s.deferred.setdefault(s.table.made_by[r], set()).add(r)
            return RecomputedRef(r, loc)
        if act == Action.RECOMPUTE or s.t.borrowed:
            # its chain did not line up, or a plan made at other shapes: the guard decides
            return guard_decision(s, x, loc, note, plan_reserve(s))
        return keep(s, x, loc)

    def finish(self) -> bool:
        """After forward: a recorded call is its own template (nothing to line up)."""
        return True


def record(s: CallState, func, args, kwargs, out, alias: bool = False) -> None:
    """Record one aten call of the forward. `alias`: a wrapper hook's view of a recorded
    value (FSDP2 views a block's input): not the model's op, but the same value to it."""
    k = len(s.records)
    leaves, _ = pytree.tree_flatten(out)
    outs = [weakref.ref(x) if isinstance(x, torch.Tensor) else None for x in leaves]
    # an in-place op's output has its version bumped after this mode returns (by the
    # ADInplaceOrView kernel above it): record the version it will have
    bump = written_returns(func)
    versions = [x._version + (j in bump) if isinstance(x, torch.Tensor) else 0
                for j, x in enumerate(leaves)]
    in_locs = []

    def ref(x):
        if isinstance(x, torch.Tensor):
            loc = s.where.get(x)
            if loc is not None:
                in_locs.append(loc)
                v = x._version
                if v != s.records[loc[0]].versions[loc[1]]:
                    s.read_version[loc] = v     # written since, through another alias
                return OutRef(*loc)
            if x.device.type != "meta":
                s.external.add(x)      # a parameter, buffer, input or a hook's value
            if not isinstance(x, torch.nn.Parameter) and id(x) not in s.inputs \
                    and id(x) not in s.p.buffer_ids:
                return ExtRef(x)     # held weakly: a replay may not rely on it
        return x
    rargs = pytree.tree_map(ref, args)
    rkwargs = pytree.tree_map(ref, kwargs)
    # does it read activations (values the forward computed from its inputs), as opposed
    # to parameters only (a wrapper's all-gather and views of weights)?
    reads_act = any(_activation(s, loc) for loc in in_locs)
    known_ = {t for t in (s.tid_of.get(loc) for loc in in_locs)
              if t is not None and s.root(t) not in s.t.non_activation}
    op = None if alias else s.lineup.align(func, leaves, reads_act, known_)
    s.records.append(OpRecord(func, rargs, rkwargs, outs, versions, op, in_locs))
    s.reads_act.append(reads_act)
    for j, x in enumerate(leaves):
        if isinstance(x, torch.Tensor):
            if s.device is None and x.device.type != "meta":
                s.device = x.device
            s.where[x] = (k, j)       # an in-place op's output: its newest value
    if alias and in_locs and in_locs[0] in s.tid_of and leaves \
            and isinstance(leaves[0], torch.Tensor):
        s.tid_of[(k, 0)] = s.tid_of[in_locs[0]]
    if op is not None:
        _lined_up(s, k, op, leaves)


def _lined_up(s: CallState, k: int, op: int, leaves: list) -> None:
    """Record `k` is profile op `op`: its outputs are the profile's tensors; a root a chain
    reads is pinned (`holding.keep`'s alias rule), a swapped one's geometry noted."""
    s.rec_of_op[op] = k
    for j, tid in enumerate(s.table.ops[op].outputs):
        if j < len(leaves) and isinstance(leaves[j], torch.Tensor):
            s.tid_of[(k, j)] = tid
            s.loc_of_tid[tid] = (k, j)
            r = s.root(tid)
            if r == tid and r in s.t.pin_roots:     # (an alias: see `holding.keep`)
                s.pinned[r] = leaves[j].detach()
                count(s, leaves[j])
            if r == tid and s.table.action.get(r) == Action.SWAP:
                x = leaves[j]
                s.metas[r] = (x.dtype, tuple(x.shape), tuple(x.stride()), x.storage_offset())
                s.root_storage[r] = storage_id(x)


def _activation(s: CallState, loc: tuple[int, int]) -> bool:
    tid = s.tid_of.get(loc)
    if tid is not None:
        return s.root(tid) not in s.t.non_activation
    return s.reads_act[loc[0]]


def usable(s: CallState, r: int) -> bool:
    """Every op root `r` depends on in its chain was matched, reads the roots the profile
    says it reads, and is not random: then replaying them gives what the forward computed.
    (They all ran before `r` was produced, so this is known when autograd saves `r`.)"""
    ok = s.usable.get(r)
    if ok is None:
        ok = r in s.table.made_by
        for p in s.table.needs.get(r, ()) if ok else ():
            ok = _op_ok(s, p)
            if not ok:
                break
        s.usable[r] = ok
    return ok


def _op_ok(s: CallState, p: int) -> bool:
    k = s.rec_of_op.get(p)
    if k is None:
        return False
    rec = s.records[k]
    if is_random_record(rec) or not all(known(s, loc) for loc in rec.in_locs):
        return False               # random, or reads a value the profile does not know
    if any(isinstance(a, ExtRef) for a in pytree.tree_leaves((rec.args, rec.kwargs))):
        return False               # reads an outside value nobody promises to keep
    got = {s.root(s.tid_of[loc]) for loc in rec.in_locs}
    return (got - s.t.non_activation) <= set(s.t.op_inputs.get(p, ()))


def known(s: CallState, loc: tuple[int, int]) -> bool:
    """Is `loc` a value of the profile, and, if a view or in-place alias, derived from one
    with the same storage root (so re-deriving it walks only known values)?"""
    tid = s.tid_of.get(loc)
    if tid is None:
        return False
    rec = s.records[loc[0]]
    if not rec.alias:
        return True
    src = rec.args[0] if rec.args else None
    if not isinstance(src, OutRef):
        return s.root(tid) in s.t.non_activation or not rec.in_locs
    return known(s, src.loc) and s.root(s.tid_of[src.loc]) == s.root(tid)


class Recorder(TorchDispatchMode):
    """The mode a recorded call runs under: each aten op of a module's forward body is
    recorded (`record`); a value Python reads is noted (`CallState.values`)."""

    def __init__(self, s: CallState):
        super().__init__()
        self.s = s
        self.tp = dtensor.uses_dtensor(s.p.model)     # tensor parallel: run/parallel/dtensor.py

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.tp and dtensor.distributed_wrapper(types):
            if dtensor.takes_dtensor(types):
                return NotImplemented    # DTensor's dispatch runs it: its local ops come here
            args, kwargs = dtensor.waited(args, kwargs, self._wait)
        out = func(*args, **kwargs)
        s = self.s
        if func is _LOCAL_SCALAR:        # a Python value, not an op of the step's graph
            if s.recording:
                s.values.append(out)
            return out
        if s.recording:
            if s.lineup.in_body():
                record(s, func, args, kwargs, out)
            elif alias_flags(func)[0] and args and isinstance(args[0], torch.Tensor) \
                    and args[0] in s.where:
                record(s, func, args, kwargs, out, alias=True)   # a hook's view of a value
        return out

    def _wait(self, x: torch.Tensor) -> None:
        self.__torch_dispatch__(_WAIT, (), (x,), {})       # recorded as any op
