"""What later calls at a signature follow: the first call's template, by signature.

`Template` keeps what a later call needs from the first call's full record (its packs'
decisions, the records its chains replay, the values each chain read and the pack that hands
each over); `Templates` holds each signature's first call until its backward ran, then its
template; `Fingerprint` is what a template is valid for besides the signature (the very
parameter and buffer tensors in their slots, the autocast state). The calls that follow a
template: run/eager/steady_call.py (later calls), run/eager/new_shape.py (the first call at new shapes).
"""
from __future__ import annotations

import operator
from typing import TYPE_CHECKING

import torch
import torch.utils._pytree as pytree

from .packs import SteadyRoute, TemplatePack

if TYPE_CHECKING:
    from .call_state import CallState

__all__ = ["Template", "Templates", "Fingerprint"]

_KEEP = "keep"          # (schema.Action.KEEP's value: a table names actions by value)

# why a later call at a signature is recorded again (cause, what to do): `Templates.why_not`
UNREACHABLE = ("a chain of the plan read a value that no saved tensor of the step holds, so "
               "a call without the recorder cannot hand it over",
               "this is a gap in slackswap, please report it with the model; training stays "
               "bitwise meanwhile")
NO_BACKWARD = ("the last recorded call's backward did not run every recompute chain its plan "
               "deferred (a forward without backward, or a backward that never reached a "
               "recomputed tensor)",
               "run backward through each training forward, or plan with the loss the "
               "training loop uses (loss_fn)")
REPLACED = ("the model's parameter or buffer tensors were replaced (or autocast changed) "
            "since the last recorded call",
            "update parameters in place (an optimizer, `p.data.copy_`), not by assigning new "
            "tensors to the module, and keep autocast as it was")
DIVERGED = ("the last call's saved tensors stopped matching the recorded ones (other control "
            "flow at the same shapes)",
            "re-profile on the path the training loop takes (plan_model with inputs like "
            "the training batches), or set model.forward.__slackswap__.steady = False")


class Template:
    """What a later call at the same input signature needs from the first one's full record
    (a `first_call.FirstCall`'s state) to run the plan with saved-tensor hooks alone
    (`steady_call.SteadyCall`): each pack's expected shape, dtype and node type and its
    decision, the records of the ops (with the call's inputs as `InputRef` markers, so later
    calls' inputs take their place), and, for each value a chain read while it was alive, the
    pack that hands it over; the first call's line-up, which a followed call reports."""
    __slots__ = ("fingerprint", "n", "records", "reads_act", "rec_of_op", "tid_of",
                 "loc_of_tid", "usable", "metas", "device", "prefetch_order", "lineup",
                 "external", "chain_reads", "uses", "ok", "seq", "held_at", "fresh",
                 "saved_total", "guarded", "seq_quiet", "keep_only", "chain_records",
                 "chain_made", "shape_groups")

    def __init__(self, run: "CallState", fingerprint: "Fingerprint"):
        # (made after a first call, whose machinery is loaded: not at import, see inplace.py)
        from .recorded import InputRef, OpRecord
        self.fingerprint = fingerprint
        self.n = len(run.seq)
        pos = {id(x): i for i, x in enumerate(run.call_inputs)}

        def sub(a):
            return InputRef(pos[id(a)]) if isinstance(a, torch.Tensor) and id(a) in pos else a
        self.records = [OpRecord(r.func, pytree.tree_map(sub, r.args),
                                pytree.tree_map(sub, r.kwargs), None, r.versions, r.op,
                                r.in_locs) for r in run.records]
        self.reads_act, self.rec_of_op, self.tid_of = run.reads_act, run.rec_of_op, run.tid_of
        self.loc_of_tid, self.usable, self.metas = run.loc_of_tid, run.usable, run.metas
        self.device, self.prefetch_order = run.device, run.prefetch_order
        self.lineup = run.lineup
        self.external = run.external.without_tensors(run.call_inputs)
        self.chain_reads = {o: tuple(sorted(locs)) for o, locs in run.live_reads.items()}
        self.uses: dict[tuple, int] = {}          # loc -> chains that read it (`_binds`)
        binds = self._binds(run.seq, _replayed(run))
        # each pack: what a later call checks and does there (`packs.TemplatePack`)
        self.seq = [TemplatePack(n.shape, n.dtype, n.node, n.action, n.root, n.loc, n.tracked,
                                 binds.get(i), n.own) for i, n in enumerate(run.seq)]
        # the guard's count before each pack, and after the last (`guard.py`): where a later
        # call that leaves the template resumes counting
        self.held_at = [n.held for n in run.seq] + [run.guard.held]
        # the bytes each pack added to what a keep-all run holds (its storage's, the first
        # time it is saved), and their sum: what a first call at other shapes scales by
        self.fresh = [n.fresh for n in run.seq]
        self.saved_total = sum(self.fresh)
        self.guarded = (run.guard.swaps, run.guard.swapped_bytes)   # followed by later calls
        # the same, for a call that does not measure what it holds: nothing weakly tracked
        self.seq_quiet = [n._replace(tracked=False) for n in self.seq]
        # a keep-all plan: nothing depends on which tensor is which, nothing to check
        self.keep_only = all(a == _KEEP for a in run.table.action.values())
        self.chain_records: dict[int, list[int]] = {}    # filled by the first steady call
        self.chain_made: dict[int, list] = {}
        self.shape_groups = None       # the packs by old shape (`new_shape.groups`)

    def holds(self) -> bool:
        """Still valid for a later call: a keep-all plan reads no parameter, any other needs
        its fingerprint to hold."""
        return self.keep_only or self.fingerprint.holds()

    def _binds(self, seq: list, replayed: set[int]) -> dict[int, list]:
        """pack -> [(loc, via its _base?)]: the pack that hands each value a chain read while
        it was alive over to this call (the tensor autograd saves, or its `_base`). `ok` is
        False when a chain read a value autograd does not save (nothing can hand it over)."""
        first_self, first_base = {}, {}
        for i, n in enumerate(seq):
            first_self.setdefault(n.loc, i)
            first_base.setdefault(n.base_loc, i)
        # the same tensor, written in place since (a chain read it through such a write:
        # an in-place activation's input, held for the chain from its production)
        same_self, same_base = {}, {}
        for i, n in enumerate(seq):
            same_self.setdefault(self._written(n.loc), i)
            same_base.setdefault(self._written(n.base_loc), i)

        def saved(loc) -> bool:
            return (loc in first_self or loc in first_base
                    or self._written(loc) in same_self or self._written(loc) in same_base)
        self._read_through_aliases(seq, first_self, first_base, saved, replayed)
        binds: dict[int, list] = {}
        self.ok = True
        for loc in self.uses:
            if loc in first_self:
                binds.setdefault(first_self[loc], []).append((loc, False))
            elif loc in first_base:
                binds.setdefault(first_base[loc], []).append((loc, True))
            elif self._written(loc) in same_self:
                binds.setdefault(same_self[self._written(loc)], []).append((loc, False))
            elif self._written(loc) in same_base:
                binds.setdefault(same_base[self._written(loc)], []).append((loc, True))
            else:
                self.ok = False
        return binds

    def _read_through_aliases(self, seq, first_self, first_base, saved, replayed) -> None:
        """A chain that read a root no pack holds (the first call held it for the chain:
        `first_call._lined_up`'s pin) reads, in a later call, the alias of it a pack holds:
        an op's output that is the root's only reader and an alias autograd does not link
        by `_base` (`_unsafe_view`, which `linear` ends with: the saved views' `_base` is its
        output, not the root). Only where that output is no record a chain replays (the
        chain then resolves the alias before the root) and the pack saw it unchanged since
        its production (its own version counter, not the root's). Fills `uses`."""
        from .recorded import OutRef
        readers: dict[tuple, list[int]] = {}
        moved = {}
        for loc in sorted({x for locs in self.chain_reads.values() for x in locs}):
            if saved(loc):
                continue
            if not readers:
                for k, rec in enumerate(self.records):
                    for x in set(rec.in_locs):
                        readers.setdefault(x, []).append(k)
            got = readers.get(loc, [])
            rec = self.records[got[0]] if len(got) == 1 else None
            if (rec is None or not rec.alias or rec.wfirst or got[0] in replayed
                    or not rec.args or type(rec.args[0]) is not OutRef
                    or rec.args[0].loc != loc):
                continue
            to = (got[0], 0)
            i, j = ((first_self[to], 0) if to in first_self else
                    (first_base[to], 1) if to in first_base else (None, 0))
            if i is not None and seq[i].versions[j] == rec.versions[0]:
                moved[loc] = to
        self.chain_reads = {o: tuple(dict.fromkeys(moved.get(x, x) for x in locs))
                            for o, locs in self.chain_reads.items()}
        for locs in self.chain_reads.values():
            for loc in locs:
                self.uses[loc] = self.uses.get(loc, 0) + 1

    def _written(self, loc):
        """The output an in-place write's result `loc` is (the first one of that tensor,
        following writes back), or `loc` itself."""
        from .recorded import OutRef
        while loc is not None:
            rec = self.records[loc[0]]
            src = rec.args[0] if rec.wfirst and rec.args else None
            if type(src) is not OutRef:
                return loc
            loc = src.loc
        return loc


class Templates:
    """A patched model's first calls, by input signature: each one's record (with the
    fingerprint it was made with) until its backward ran, then its `Template` (False: none
    can be made); `hot`: a later call's key -> its `packs.SteadyRoute`, the one lookup a
    steady call makes; `superseded`: the first call's record at a signature whose plan was
    since made again along its branches (a new length may follow it:
    `signatures.SignaturePlans._borrow`); `why`: for a signature whose template is gone or
    cannot be made, why (what a call recorded again says: `why_not`)."""
    __slots__ = ("by_sig", "hot", "superseded", "why")

    def __init__(self):
        self.by_sig: dict[tuple, object] = {}
        self.hot: dict[tuple, SteadyRoute] = {}
        self.superseded: dict[tuple, object] = {}
        self.why: dict[tuple, tuple[str, str]] = {}

    def note(self, sig, run: "CallState", fingerprint: "Fingerprint") -> None:
        """`run` is the first call at `sig` (its template is made once its backward ran)."""
        self.by_sig[sig] = (run, fingerprint)

    def supersede(self, sig, run: "CallState") -> None:
        """`sig`'s plan was made again after its first call `run`: keep that call's record
        (a new length may follow its template: `SignaturePlans._borrow`)."""
        got = self.by_sig.get(sig)
        if type(got) is tuple and got[0] is run:
            self.superseded[sig] = got

    def get(self, sig):
        """The steady-state template for `sig`, made from its first call once that call's
        backward ran every chain it deferred (it then knows what each chain reads)."""
        got = self.by_sig.get(sig)
        if got is None or got is False:
            return None
        if type(got) is not tuple:
            if got.holds():
                return got
            self.drop(sig, REPLACED)           # parameters replaced, or autocast changed
            return None
        run, made_with = got
        if not made_with.holds():
            self.why[sig] = REPLACED
            return None
        if not set(run.deferred) <= run.done_chains:
            self.why[sig] = NO_BACKWARD
            return None                          # (the first call's backward has not run)
        tpl = Template(run, made_with)
        self.by_sig[sig] = tpl if tpl.ok else False
        if not tpl.ok:
            self.why[sig] = UNREACHABLE
        return tpl if tpl.ok else None

    def why_not(self, sig) -> tuple[str, str]:
        """(cause, what to do) for a call at `sig` recorded again on the plan its last
        recorded call ran."""
        return self.why.get(sig, NO_BACKWARD)

    def superseded_of(self, sig):
        """(template, the plan it ran) of `sig`'s first call, recorded on a plan since made
        again, once its backward ran; None if there is none, it keeps everything (nothing
        to follow pack by pack) or the parameters were replaced since."""
        got = self.superseded.get(sig)
        if got is None:
            return None
        if type(got[1]) is Fingerprint:        # (a first call's record: no template yet)
            run, made_with = got
            if made_with.holds() and not set(run.deferred) <= run.done_chains:
                return None                     # (its backward has not run yet)
            tpl = Template(run, made_with) if made_with.holds() else None
            got = (tpl, run.t) if tpl is not None and tpl.ok and not tpl.keep_only else None
        if got is None or not got[0].holds():
            self.superseded.pop(sig, None)      # (nothing to follow: not kept either)
            return None
        self.superseded[sig] = got
        return got

    def drop(self, sig, why: tuple[str, str] | None = None) -> None:
        """Forget `sig`'s template: the next call at it records again (`why`: the cause,
        where that call is not meant to: `why_not`)."""
        if why is not None:
            self.why[sig] = why
        self.by_sig.pop(sig, None)
        self.hot = {k: v for k, v in self.hot.items() if v.sig != sig}


def _replayed(run: "CallState") -> set[int]:
    """The records the chains of recorded call `run` replay (`backward.chain_records`)."""
    needs, rec_of_op = run.table.needs, run.rec_of_op
    return {rec_of_op[p] for roots in run.deferred.values() for r in roots
            for p in needs.get(r, ()) if p in rec_of_op}


def _autocast_state() -> tuple:
    return (torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu"),
            torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda"))


class Fingerprint:
    """What a template is valid for besides the signature: the very parameter and buffer
    tensors in each module's slots (its records hold them) and the autocast state. `holds()`
    checks it without walking the module tree (three flat lists, compared at C level)."""
    __slots__ = ("autocast", "dicts", "names", "tensors")

    def __init__(self, model: torch.nn.Module):
        self.autocast = _autocast_state()
        slots = [(d, name, t) for m in model.modules()
                 for d in (m._parameters, m._buffers) for name, t in d.items()]
        self.dicts = [d for d, _, _ in slots]
        self.names = [name for _, name, _ in slots]
        self.tensors = [t for _, _, t in slots]

    def holds(self) -> bool:
        return (_autocast_state() == self.autocast
                and all(map(operator.is_, map(dict.get, self.dicts, self.names), self.tensors)))
