"""Running recorded ops again in backward: the values a recompute chain or an unpack needs.

`Rerun._resolve(loc, local)` gives the value recorded output `loc` had when the forward made
it: made in this replay (`local`) or by an earlier chain, still alive and unchanged (held by
autograd or pinned for a chain), fetched back from its host copy, or re-derived: a view from
its (resident) input, an in-place result from what it wrote into. `_replay(k, local)` re-runs
record k on resolved arguments (the very function and arguments the forward ran, side-effect
writes sent to copies); a view whose geometry is known is one `as_strided` from the nearest
value at hand (`_view_base`). `_chain_records` / `_chain_made` say what a chain replays and
which of its results are roots (a steady-state call reads them from its template).

Correctness never depends on the line-up being right: a replay runs the very functions and
arguments the forward ran, on the same values.

`Rerun` is a part of `record.PlanRun` (its state is the run's: see `PlanRun.__init__`).
"""
from __future__ import annotations

import torch
import torch.utils._pytree as pytree

from .recorded import InputRef, OpRecord, OutRef, prepare_replay, view_geometry, view_of

__all__ = ["Rerun"]

_as_strided = torch.Tensor.as_strided


class Rerun:
    """Resolving and re-running recorded ops (see the module docstring)."""

    def _chain_records(self, owner: int) -> list[int]:
        """The records chain `owner` replays, in order: the ops the roots it deferred need."""
        needs = self.table.needs
        return [self.rec_of_op[p]
                for p in sorted({p for r in self.deferred.get(owner, ()) for p in needs[r]})]

    def _chain_made(self, owner: int, local: dict) -> list[tuple[tuple[int, int], int]]:
        """(location, root) of the values chain `owner` made that are its own roots."""
        made_by = self.table.made_by
        return [(loc, tid) for loc in local
                if (tid := self.tid_of.get(loc)) is not None and made_by.get(tid) == owner]

    def _live(self, loc: tuple[int, int]):
        """Output `loc` of this forward if it is still alive (it may since have changed):
        the tensor itself, or the alias autograd holds of it."""
        ref = self.records[loc[0]].outs[loc[1]]
        x = ref() if ref is not None else None
        if x is not None:
            return x.detach()          # (a chain's values hold no graph: see `_kept`)
        ref = self.kept_alias.get(loc)
        x = ref() if ref is not None else None
        if x is None:       # a root held for a chain that autograd saves only views of
            tid = self.tid_of.get(loc)
            if tid is not None and self.loc_of_tid.get(tid) == loc:
                x = self.pinned.get(tid)
        return x

    def _replay(self, k: int, local: dict) -> None:
        rec = self.records[k]
        geom = rec.geom
        if geom:                  # a view, re-derived with C calls (see `view_geometry`)
            if self.chain is None:        # (an unpack's: straight from the value at hand)
                base, want = self._view_base(rec, local)
            else:
                base, want = rec.args[0], geom[0]
                if type(base) is OutRef:
                    base = self._resolve(base.loc, local)
            if (base.shape, base.stride(), base.storage_offset()) == want and not (
                    base.requires_grad and torch.is_grad_enabled()):
                for j, (size, stride, offset) in enumerate(geom[1]):
                    local[(k, j)] = _as_strided(base, size, stride, offset)
                return
        flat, spec, todo, written, n, keys = rec.prep or prepare_replay(rec)
        flat = list(flat)
        for i in todo:
            a = flat[i]
            cls = type(a)
            if cls is OutRef:
                flat[i] = self._resolve(a.loc, local)
            elif cls is InputRef:
                flat[i] = self.call_inputs[a.i]
            else:
                x = flat[i] = a.ref()
                if x is None:
                    raise RuntimeError(f"slackswap: replaying {rec.func} needs a value from "
                                       "outside the model's forward that is gone; this is a "
                                       "bug in slackswap, please report it")
        if spec is None:              # a flat call: positional arguments, then keywords
            args, kwargs = (flat[:n], dict(zip(keys, flat[n:]))) if keys else (flat, {})
        else:
            args, kwargs = pytree.tree_unflatten(flat, spec)
            args = list(args)
        for i in written:
            if isinstance(args[i], torch.Tensor):
                args[i] = args[i].clone()   # a side-effect write goes to a throwaway copy
        out = rec.func(*args, **kwargs)
        if geom is None and rec.alias:
            rec.geom = view_geometry(rec, args, out)
        if isinstance(out, torch.Tensor):
            local[(k, 0)] = out
            return
        leaves = out if isinstance(out, (tuple, list)) and not any(
            isinstance(x, (tuple, list, dict)) for x in out) else pytree.tree_leaves(out)
        for j, x in enumerate(leaves):
            if isinstance(x, torch.Tensor):
                local[(k, j)] = x

    def _view_base(self, rec: OpRecord, local: dict) -> tuple:
        """For view `rec` re-derived by its geometry outside a chain (in an unpack, whose
        `local` is thrown away after): the nearest value at hand below it through views
        re-derivable by geometry, and the geometry that value must have. The same value
        `_resolve` would reach level by level; one `as_strided` from it gives the same view
        (offsets count in the storage), without making the views between."""
        src, want = rec.args[0], rec.geom[0]
        while type(src) is OutRef:
            loc = src.loc
            x = self._at_hand(loc, local)
            if x is not None:
                return x, want
            below, tid = self.records[loc[0]], self.tid_of.get(loc)
            geom = below.geom
            if not geom or geom[1][loc[1]] != want or (
                    tid is not None and tid in self.metas and tid in self.root_swap):
                return self._resolve(loc, local), want
            src, want = below.args[0], geom[0]
        return src, want

    def _at_hand(self, loc: tuple[int, int], local: dict):
        """Output `loc`'s value if this call holds it: made in `local` or by a chain, or
        still alive (held by autograd or pinned) and unchanged since the forward."""
        x = local.get(loc)
        if x is not None:
            return x
        tid = self.tid_of.get(loc)
        if tid is not None:
            x = self.made.get(tid)
            if x is not None:
                return x
        x = self._live(loc)
        if x is not None and x._version == self._version_of(loc):
            if self.noting and self.chain is not None:
                self.live_reads.setdefault(self.chain, set()).add(loc)
            return x
        return None

    def _version_of(self, loc: tuple[int, int]) -> int:
        """The version output `loc` had when the forward produced it (a later call at the
        signature: when its pack handed it over, `steady.SteadyRun`)."""
        return self.records[loc[0]].versions[loc[1]]

    def _resolve(self, loc: tuple[int, int], local: dict) -> torch.Tensor:
        """The value recorded output `loc` had when the forward produced it."""
        x = self._at_hand(loc, local)
        if x is not None:
            return x
        k, j = loc
        rec = self.records[k]
        tid = self.tid_of.get(loc)
        if tid is not None and tid in self.metas and tid in self.root_swap:
            out = local[loc] = view_of(self.root_swap[tid].fetch(), *self.metas[tid])
            return out
        if rec.alias:
            if rec.wfirst:
                src = rec.args[0]      # in place: its effect is already in the data
                out = self._resolve(src.loc, local)
            else:
                self._replay(k, local)  # a view: re-derived from its (resident) input
                out = local[loc]
            local[loc] = out
            return out
        raise RuntimeError(
            f"slackswap: backward needs output {j} of {rec.func} (recorded op {k}, profile "
            f"tensor {tid}), which the plan neither kept "
            "nor can recompute here; this is a bug in slackswap, please report it")
