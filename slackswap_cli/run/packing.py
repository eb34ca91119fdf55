"""The forward side of a recorded call's saved-tensor hooks: what autograd holds for each tensor.

When autograd saves a tensor for backward, the plan's action for its storage root decides what
autograd holds instead (`Packing.pack`): *keep*: an alias of the tensor (`_kept`); *swap*: a
handle to a host copy of the tensor's whole storage (`_swap`: one copy per storage, shared by
every view saved of it; a root an in-place op still has to write is kept, not copied);
*recompute*: a reference, resolved in backward by replaying the root's chain (run/unpacking.py,
run/rerun.py). A root is recomputed only when every op it depends on lined up, reads the roots
the profile says and is not random (`_usable`); a saved tensor the plan cannot place is kept or
swapped by the guard's rule (`_unplaced`, guard.py). Each pack notes what it did, for the calls
after this one (`steady.Template`).

`Packing` is a part of `record.PlanRun` (its state is the run's: see `PlanRun.__init__`).
"""
from __future__ import annotations

import weakref

import torch
import torch.utils._pytree as pytree

from ..schema import Action
from ..trace.storage import storage_id, storage_key, storage_nbytes
from . import swap
from .packs import PackNote, RecomputedRef, SwappedRef
from .recorded import ExtRef, OutRef, is_random_record

__all__ = ["Packing"]


class Packing:
    """What autograd holds for each saved tensor of a recorded call (see the module docstring),
    and the bytes the call holds on the device for backward."""

    def pack(self, x: torch.Tensor):
        self.recording = False
        try:
            return self._pack(x)
        finally:
            self.recording = True

    def _pack(self, x: torch.Tensor):
        loc = self.where.get(x)
        base = x._base
        # what a later call at these shapes checks and does at this pack (`steady.Template`)
        note = PackNote(x.shape, x.dtype, Action.KEEP, loc,
                        None if base is None else self.where.get(base), type(x.grad_fn),
                        self.guard.held, self._fresh(x, loc))
        self.seq.append(note)
        tid = None if loc is None else self.tid_of.get(loc)
        if tid is None:       # not the profile's (or not made by this forward: not counted)
            return x.detach() if loc is None else self._unplaced(x, loc, note)
        r = self.root(tid)
        act = self.table.action.get(r)
        if act is None and r not in self.table.bwd_use and r not in self.t.non_activation:
            # a value the profile's backward does not read but eager's autograd saves (a
            # node that saves more than the traced backward needs): not the plan's to place
            return self._unplaced(x, loc, note)
        if act == Action.SWAP and self.t.last_write.get(r, -1) >= self.lineup.ptr:
            # still to be written in place (a GRU cell's gates): a copy made now would miss
            # those writes, so it is kept as eager keeps it (and counted)
            return self._kept(x, loc)
        if act == Action.SWAP:
            mine = self.root_storage.get(r)
            note.action, note.root = Action.SWAP, r
            note.own = (mine is not None and mine[0] == storage_key(x)
                        and not mine[1].expired())
            return self._swap(x, r, note.own)
        if act == Action.RECOMPUTE and self._usable(r) and self._known(loc):
            note.action, note.root = Action.RECOMPUTE, r
            self.packs[r] = self.packs.get(r, 0) + 1
            self.deferred.setdefault(self.table.made_by[r], set()).add(r)
            return RecomputedRef(r, loc)
        if act == Action.RECOMPUTE or self.t.borrowed:
            # its chain did not line up, or a plan made at other shapes: the guard decides
            return self._unplaced(x, loc, note)
        return self._kept(x, loc)

    def _fresh(self, x: torch.Tensor, loc) -> int:
        """The bytes of `x`'s storage if this is the first time autograd saves it and this
        forward made it (parameters, buffers and inputs are not counted), else 0."""
        return 0 if loc is None else self._count_fresh(x)

    def _count_fresh(self, x: torch.Tensor) -> int:
        """Add `x`'s storage to what a keep-all run holds (`saved_bytes`), the first time it
        is saved and not a parameter, buffer or input; the bytes added."""
        if x.device.type == "meta":
            return 0
        key = storage_key(x)
        if key in self.saved_keys or key in self.external:
            return 0
        self.saved_keys.add(x)
        n = storage_nbytes(x)
        self.saved_bytes += n
        return n

    def _unplaced(self, x: torch.Tensor, loc, note: PackNote | None):
        """A saved tensor the plan cannot place: kept while the guard admits it, else swapped
        (`guard.py`'s rule); the note tells later calls at this signature which."""
        if x.device.type == "meta":
            return self._kept(x, loc)
        key = storage_key(x)
        if key in self.external:           # a parameter, buffer or input: not held for it
            return x.detach()
        if self.guard.admit(key, storage_nbytes(x), self._reserve()):
            return self._kept(x, loc)
        if note is not None:
            note.action = Action.SWAP
        return self._swap(x, None, False)

    def _reserve(self) -> int:
        """Bytes the plan keeps from the next expected op on (`keep_after`): room the guard
        leaves. (0 for a table written before it was kept, and after the last op.) A plan
        borrowed from other shapes has them per pack, as the first call at these shapes saw
        them (`pack_reserve`), or `keep_after` scaled."""
        t = self.t
        if t.pack_reserve is not None:
            return t.pack_reserve[min(len(self.seq), len(t.pack_reserve) - 1)]
        after = self.table.keep_after
        return int(after[min(self.lineup.ptr, len(after) - 1)] * t.scale) if after else 0

    def _count(self, x: torch.Tensor) -> None:
        """Count a storage this forward holds for backward as planned (`Guard.hold`)."""
        guard = self.guard
        if guard is not None and x.device.type != "meta":
            key = storage_key(x)
            if key not in self.external:
                guard.hold(key, storage_nbytes(x))

    def _kept(self, x: torch.Tensor, loc=None) -> torch.Tensor:
        """What autograd holds for a kept tensor: `x.detach()` (same storage, same version
        counter), never `x` itself. A node that saves its own output would hold that output,
        whose `grad_fn` is the node: a cycle through C++ that Python's collector cannot see,
        so a graph dropped without backward (a skipped step, an OOM retry) would keep every
        saved tensor alive for good. For the same reason, what a run holds for its chains
        (pinned roots, handed-over values, what a chain reads live) are such aliases: the
        graph holds the run (its unpack hook), so the run must not hold the graph. The weak
        references (for `held_device_bytes`, and for a chain that reads output `loc` while
        autograd holds it: `_live`) are to what autograd holds."""
        kept = x.detach()
        self._count(x)
        ref = weakref.ref(kept)
        self.kept_refs.append(ref)
        if loc is not None:
            self.kept_alias.setdefault(loc, ref)
        return kept

    def _swap(self, x: torch.Tensor, r: int, own: bool) -> list:
        """Pack `x` (root `r` or a view of it) as a host copy of its storage. `own`: x's
        storage is root r's own (so a chain reading r fetches this copy): found out on the
        first call, followed later."""
        # one copy per storage (a root and its views), found by the storage itself: an
        # address alone may be a new tensor's, once a swapped one's memory was freed
        key, ref = storage_id(x)
        sw = self.by_storage.get(key)
        if sw is None or sw.ref.expired() or sw.version != x._version:
            # (a storage written since its copy, say a buffer filled step by step, is
            # copied again: a copy serves only the contents it saw)
            copy = swap.offload(swap.storage_as_bytes(x))
            sw = self.by_storage[key] = swap.StorageCopy(ref, copy, x._version)
            self.swaps.append(sw)
        if own:
            self.root_swap[r] = sw
            held = self.pinned.pop(r, None)      # the host copy serves a chain that reads it
            if held is not None and self.guard is not None:
                self.guard.drop(key, storage_nbytes(held))
        sw.packs += 1
        self.packs[r] = self.packs.get(r, 0) + 1
        return SwappedRef(r, sw, x.dtype, tuple(x.shape), tuple(x.stride()), x.storage_offset())

    def _usable(self, r: int) -> bool:
        """Every op root `r` depends on in its chain was matched, reads the roots the profile
        says it reads, and is not random: then replaying them gives what the forward computed.
        (They all ran before `r` was produced, so this is known when autograd saves `r`.)"""
        ok = self.usable.get(r)
        if ok is None:
            ok = r in self.table.made_by
            for p in self.table.needs.get(r, ()) if ok else ():
                ok = self._op_ok(p)
                if not ok:
                    break
            self.usable[r] = ok
        return ok

    def _op_ok(self, p: int) -> bool:
        k = self.rec_of_op.get(p)
        if k is None:
            return False
        rec = self.records[k]
        if is_random_record(rec) or not all(self._known(loc) for loc in rec.in_locs):
            return False               # random, or reads a value the profile does not know
        if any(isinstance(a, ExtRef) for a in pytree.tree_leaves((rec.args, rec.kwargs))):
            return False               # reads an outside value nobody promises to keep
        got = {self.root(self.tid_of[loc]) for loc in rec.in_locs}
        return (got - self.t.non_activation) <= set(self.t.op_inputs.get(p, ()))

    def _known(self, loc: tuple[int, int]) -> bool:
        """Is `loc` a value of the profile, and, if a view or in-place alias, derived from one
        with the same storage root (so re-deriving it walks only known values)?"""
        tid = self.tid_of.get(loc)
        if tid is None:
            return False
        rec = self.records[loc[0]]
        if not rec.alias:
            return True
        src = rec.args[0] if rec.args else None
        if not isinstance(src, OutRef):
            return self.root(tid) in self.t.non_activation or not rec.in_locs
        return (self._known(src.loc)
                and self.root(self.tid_of[src.loc]) == self.root(tid))

    def held_device_bytes(self) -> int:
        """Activation bytes this step holds on the device for backward right now: storages of
        forward-produced tensors autograd holds as they are, plus what the plan holds (tensors
        kept for a chain, made by one, fetched back, or still being copied to the host).
        Parameters, buffers and inputs are not counted; each storage counts once."""
        seen, total = set(), 0
        tensors = [r() for r in self.kept_refs]
        tensors += [*self.pinned.values(), *self.made.values(), *self.bound.values(),
                    *(sw.dev for sw in self.swaps if sw.dev is not None)]
        for t in tensors:
            if t is None or t.device.type == "meta":
                continue
            key = storage_key(t)
            if key not in seen and key not in self.external:
                seen.add(key)
                total += storage_nbytes(t)
        for sw in self.swaps:
            h = sw.handle
            if h is not None and h.d2h_done is not None and not h.d2h_done.query():
                total += h.nbytes
        return total
