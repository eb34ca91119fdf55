"""The steady state of `patch(model)`: later calls at a signature run the plan on saved-tensor
hooks alone.

The first call at an input signature (`record.PlanRun`) records every aten op under a
`TorchDispatchMode`, lines it up with the profile and decides, pack by pack, what autograd holds.
Once that call's backward ran every chain it deferred, `Template` keeps what a later call needs
from it; `SteadyRun` (or `KeepRun`, for a keep-all plan) is such a later call. What costs
what, and why:

- **per forward op: nothing.** No dispatch mode, no module hooks (they are registered for a
  full record and removed after it): an op that saves nothing for backward runs as in eager.
- **per saved tensor, keep-all plan (`KeepRun`):** nothing: there is nothing to do, so the call
  runs without saved-tensor hooks (autograd saves as in eager) unless it measures.
- **per saved tensor (pack hook), any other plan (`SteadyRun`):** a counter, one tuple
  (`Template.seq`, precomputed) and three checks: shape, dtype and the type of the autograd
  node that made it, so other control flow at the same shapes is caught (from the first
  difference on, the call keeps what autograd saves, as eager does, and the next call records
  again). Then the noted action: *keep* returns `x.detach()`; *swap* copies its storage to the
  host (one copy per storage); *recompute* returns a reference. A pack that hands a value to a
  chain (the template knows which) binds an alias of it by position.
- **why aliases:** autograd is never handed `x` itself, and a run holds only aliases (see
  `packing.Packing._kept`): otherwise a forward dropped without backward leaks, through cycles
  Python's collector cannot see.
- **measuring** what a call holds (`held_device_bytes`) is opt-in on later calls,
  `model.forward.__slackswap__.measure_held = True` (verify, the benchmarks and the tests set
  it): then kept packs take a weak reference each (a keep-all call then runs with hooks, its
  pack `packing.Packing._kept`).
- **per unpack:** a tensor comes back as it is; a swapped one is fetched (prefetches issued
  at the plan's points); the first unpack of a recomputed root runs its chain.
- **per chain:** the records it replays (the ops its deferred roots need) and the roots it
  makes are worked out on the first steady call and reused (they depend on the template only);
  each record's arguments were flattened once (`recorded.prepare_replay`), and whether it is a
  view or an in-place op was read from its schema once (`recorded.alias_flags`). A replay then runs the
  recorded function on this call's values: handed-over ones, current parameters and inputs; a
  view whose input has the geometry noted at its first replay is `Tensor.as_strided` at the
  noted output geometry instead (`recorded.view_geometry`: one C call, not the boxed op), and an
  unpack's view of a view is one `as_strided` from the value at hand (`_view_base`).
- **per step:** one dict lookup (`Templates.hot`) by the key of the call (the first
  parameter's device and dtype, the inputs' shapes and dtypes: one loop) for the plan and the
  template; for a plan that recomputes or swaps, whether the very parameter and buffer tensors
  still sit in their module slots and the autocast state is unchanged (`Fingerprint.holds`: a
  C-level walk over a flat list, no module tree); a few fresh containers.
- **per new signature:** a full record (the first call), possibly a new plan (`run/replan.py`).

Limits: a divergence that keeps every saved tensor's shape, dtype and producing node type at
every position before a recomputed one is not caught; `model.forward.__slackswap__.steady =
False` records every call.
"""
from __future__ import annotations

import operator
from types import MappingProxyType

import torch
import torch.utils._pytree as pytree

from ..guard import Guard
from ..schema import Action
from ..trace.storage import storage_key
from .packs import RecomputedRef, TemplatePack
from .record import PlanRun
from .recorded import InputRef, OpRecord
from .swap import Storages

__all__ = ["Template", "Templates", "Fingerprint", "SteadyRun", "KeepRun"]

_KEEP, _SWAP = Action.KEEP, Action.SWAP


class Template:
    """What a later call at the same input signature needs from the first one's full record
    (`PlanRun`) to run the plan with saved-tensor hooks alone (`SteadyRun`): each pack's
    expected shape, dtype and node type and its decision, the records of the ops (with the
    call's inputs as `InputRef` markers, so later calls' inputs take their place), and, for each
    value a chain read while it was alive, the pack that hands it over."""

    def __init__(self, run: PlanRun, fingerprint: "Fingerprint"):
        self.fingerprint = fingerprint
        self.n = len(run.seq)
        pos = {id(x): i for i, x in enumerate(run.call_inputs)}

        def sub(a):
            return InputRef(pos[id(a)]) if isinstance(a, torch.Tensor) and id(a) in pos else a
        self.records = [OpRecord(r.func, pytree.tree_map(sub, r.args),
                                pytree.tree_map(sub, r.kwargs), None, r.versions, r.op,
                                r.in_locs) for r in run.records]
        self.shared = {name: getattr(run, name) for name in (
            "reads_act", "rec_of_op", "tid_of", "loc_of_tid", "usable", "metas", "device",
            "prefetch_order", "lineup")}
        inputs = {storage_key(x) for x in run.call_inputs if x.device.type != "meta"}
        self.external = run.external.without(inputs)
        self.chain_reads = {o: tuple(locs) for o, locs in run.live_reads.items()}
        self.uses: dict[tuple, int] = {}          # loc -> chains that read it
        for locs in self.chain_reads.values():
            for loc in locs:
                self.uses[loc] = self.uses.get(loc, 0) + 1
        binds = self._binds(run.seq)
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

    def holds(self) -> bool:
        """Still valid for a later call: a keep-all plan reads no parameter, any other needs
        its fingerprint to hold."""
        return self.keep_only or self.fingerprint.holds()

    def start(self, patched, plan, inputs: list) -> "SteadyRun":
        """A later call's run: `KeepRun` for a keep-all plan, else `SteadyRun`."""
        return (KeepRun if self.keep_only else SteadyRun)(patched, plan, self, inputs)

    def _binds(self, seq: list) -> dict[int, list]:
        """pack -> [(loc, via its _base?)]: the pack that hands each value a chain read while
        it was alive over to this call (the tensor autograd saves, or its `_base`). `ok` is
        False when a chain read a value autograd does not save (nothing can hand it over)."""
        first_self, first_base = {}, {}
        for i, n in enumerate(seq):
            first_self.setdefault(n.loc, i)
            first_base.setdefault(n.base_loc, i)
        binds: dict[int, list] = {}
        self.ok = True
        for loc in self.uses:
            if loc in first_self:
                binds.setdefault(first_self[loc], []).append((loc, False))
            elif loc in first_base:
                binds.setdefault(first_base[loc], []).append((loc, True))
            else:
                self.ok = False
        return binds


class Templates:
    """A patched model's first calls, by input signature: each one's record (with the
    fingerprint it was made with) until its backward ran, then its `Template` (False: none
    can be made); `hot`: a later call's key -> (plan, signature, template), the one lookup a
    steady call makes; `superseded`: the first call's record at a signature whose plan was
    since made again along its branches (a new length may follow it:
    `signatures.SignaturePlans._borrow`)."""

    def __init__(self):
        self.by_sig: dict[tuple, object] = {}
        self.hot: dict[tuple, tuple] = {}
        self.superseded: dict[tuple, object] = {}

    def note(self, sig, run: PlanRun, fingerprint: "Fingerprint") -> None:
        """`run` is the first call at `sig` (its template is made once its backward ran)."""
        self.by_sig[sig] = (run, fingerprint)

    def supersede(self, sig, run: PlanRun) -> None:
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
            self.drop(sig)                     # parameters replaced, or autocast changed
            return None
        run, made_with = got
        if not made_with.holds() or not set(run.deferred) <= run.done_chains:
            return None                          # (the first call's backward has not run)
        tpl = Template(run, made_with)
        self.by_sig[sig] = tpl if tpl.ok else False
        return tpl if tpl.ok else None

    def superseded_of(self, sig):
        """(template, the plan it ran) of `sig`'s first call, recorded on a plan since made
        again, once its backward ran; None if there is none, it keeps everything (nothing
        to follow pack by pack) or the parameters were replaced since."""
        got = self.superseded.get(sig)
        if got is None:
            return None
        if type(got[0]) is PlanRun:
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

    def drop(self, sig) -> None:
        """Forget `sig`'s template: the next call at it records again."""
        self.by_sig.pop(sig, None)
        self.hot = {k: v for k, v in self.hot.items() if v.sig != sig}


def _autocast_state() -> tuple:
    return (torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu"),
            torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda"))


class Fingerprint:
    """What a template is valid for besides the signature: the very parameter and buffer
    tensors in each module's slots (its records hold them) and the autocast state. `holds()`
    checks it without walking the module tree (three flat lists, compared at C level)."""

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


def _same(x):
    return x


# autograd nodes that record the same thing under another name: `reshape` is `_reshape_alias`
# in plain eager and `view` under a Python dispatch mode (the first call's recorder)
_ALIKE = ({"ViewBackward0", "ReshapeAliasBackward0"},)


def _same_node(got, want) -> bool:
    names = {getattr(got, "__name__", None), getattr(want, "__name__", None)}
    return any(names <= alike for alike in _ALIKE)


class SteadyRun(PlanRun):
    """A later call at a signature whose first call made a `Template`: no recorder, no module
    hooks; the pack hook follows the template's decisions by position (see the module's
    docstring for what it checks). Chains replay the template's records on the values this
    call's packs handed over."""
    noting = False
    recorded = False

    def __init__(self, patched, plan, tpl: Template, inputs: list):
        # (PlanRun's per-call state, without what only recording needs)
        self.p, self.t, self.table = patched, plan, plan.table
        self.__dict__.update(tpl.shared)
        self.measuring = measuring = patched.measure_held
        self.tpl, self.records, self.n = tpl, tpl.records, tpl.n
        self.seq = tpl.seq if measuring else tpl.seq_quiet
        self.kept_refs = []
        self.i = 0
        self.broken = False
        self.call_inputs = inputs
        self.chain = None
        self.bound = {}
        self.bound_version = {}        # loc -> its version when its pack handed it over
        self.swaps = []
        self.rerun_ops = 0
        self.made_by = plan.table.made_by
        self.pinned, self.by_storage, self.root_swap, self.made = {}, {}, {}, {}
        self.chain_uses = plan.chain_uses.copy()
        self.packs, self.deferred, self.done_chains = {}, {}, set()
        self.progress, self.next_prefetch = self.table.n_forward, 0
        self.bound_uses = tpl.uses.copy()
        self.guard = None              # counting starts where a call leaves the template

    def held_device_bytes(self) -> int:
        if not self.measuring:
            raise RuntimeError(
                "slackswap: this later call did not note what autograd holds (it costs a weak "
                "reference per saved tensor); set model.forward.__slackswap__.measure_held = "
                "True before the call to measure held_device_bytes()")
        return super().held_device_bytes()

    @property
    def external(self) -> "Storages":
        """Storages the forward read but did not make (for `held_device_bytes`)."""
        got = self.__dict__.get("_external")
        if got is None:
            got = self._external = self.tpl.external.with_tensors(self.call_inputs)
        return got

    def pack(self, x: torch.Tensor):
        i = self.i
        self.i = i + 1
        if i >= self.n or self.broken:
            return self._differs(x)
        p = self.seq[i]
        if x.shape != p.shape or x.dtype is not p.dtype or (
                type(x.grad_fn) is not p.node and not _same_node(type(x.grad_fn), p.node)):
            return self._differs(x)
        binds = p.binds
        if binds is not None:
            bound = self.bound
            for bloc, via_base in binds:
                v = x._base if via_base else x
                if v is None:
                    return self._differs(x)
                bound[bloc] = v.detach()     # (an alias: see `packing.Packing._kept`)
                self.bound_version[bloc] = v._version
        kind = p.action
        if kind is _KEEP:
            if p.tracked:
                return self._kept(x)
            return x.detach()          # (never `x` itself: see `packing.Packing._kept`)
        r = p.root
        if kind is _SWAP:
            return self._swap(x, r, p.own)
        packs = self.packs
        packs[r] = packs.get(r, 0) + 1
        owner = self.made_by[r]
        got = self.deferred.get(owner)
        if got is None:
            self.deferred[owner] = {r}
        else:
            got.add(r)
        return RecomputedRef(r, p.loc)

    def _differs(self, x: torch.Tensor):
        """A pack that left the template (other control flow at the same shapes): from here
        on what autograd saves is the plan's no longer, so the guard decides (`guard.py`),
        counting on from where the first call's count stood at this pack."""
        if not self.broken:
            self.broken = True
            self.guard = Guard(self.t.limit)
            self.guard.held = self.tpl.held_at[min(self.i - 1, self.n)]
        return self._unplaced(x, None, None)

    def held_at_end(self) -> int:
        return self.tpl.held_at[-1] if self.guard is None else self.guard.held

    def guarded(self) -> tuple[int, int]:
        """The first call's guard swaps this call followed, then its own after it left the
        template."""
        swaps, swapped = self.tpl.guarded
        if self.guard is not None:
            return swaps + self.guard.swaps, swapped + self.guard.swapped_bytes
        return swaps, swapped

    def finish(self) -> bool:
        """After forward: did every pack line up with the template?"""
        if self.i != self.n:
            self.broken = True
        return not self.broken

    def _live(self, loc: tuple[int, int]):
        return self.bound.get(loc)

    def _version_of(self, loc: tuple[int, int]) -> int:
        """A handed-over value's version at its pack, not the first call's: a call without
        the recorder may take another eager path to the same value. C++ `linear` adds the
        bias in place (`add_`) on an input that is not 2-d and contiguous, but out of place
        under a dispatch mode (`isTensorSubclassLike`), so the first call recorded `add`
        (version 0) where this one packs `add_`'s result (version 1)."""
        return self.bound_version.get(loc, -1)

    def _chain_records(self, owner: int) -> list[int]:
        if self.broken:        # (a call that left the template: its own deferred roots)
            return super()._chain_records(owner)
        ks = self.tpl.chain_records.get(owner)
        if ks is None:
            ks = self.tpl.chain_records[owner] = super()._chain_records(owner)
        return ks

    def _chain_made(self, owner: int, local: dict) -> list:
        if self.broken:
            return super()._chain_made(owner, local)
        got = self.tpl.chain_made.get(owner)
        if got is None:
            got = self.tpl.chain_made[owner] = super()._chain_made(owner, local)
        return got

    def _chain_ran(self, owner: int) -> None:
        for loc in self.tpl.chain_reads.get(owner, ()):
            self.bound_uses[loc] -= 1
            if self.bound_uses[loc] <= 0:
                self.bound.pop(loc, None)


class KeepRun(SteadyRun):
    """A later call of a keep-all plan: nothing to do per saved tensor, so no saved-tensor
    hooks at all (`pack` is None): autograd saves as in eager. Nothing depends on which tensor
    is which (no counter, no checks) and no parameter is read (no fingerprint either).
    Measuring (`measure_held`), the hooks are on: the pack notes an alias of each tensor (see
    `packing.Packing._kept`). What a `SteadyRun` holds per call is empty here, at class level; what
    only reports read (records, `rec_of_op`, ...) is the template's."""
    pinned = made = bound = root_swap = by_storage = MappingProxyType({})
    swaps = ()
    pack = None
    unpack = staticmethod(_same)
    rerun_ops = 0
    broken = False
    chain = None
    guard = None
    i = 0

    def __init__(self, patched, plan, tpl: Template, inputs: list):
        self.p, self.t, self.tpl, self.call_inputs = patched, plan, tpl, inputs
        self.measuring = patched.measure_held
        self.kept_refs = []
        if self.measuring:
            self.pack = self._kept

    def finish(self) -> bool:
        """After forward: nothing to line up (every pack is kept as it is)."""
        return True

    def __getattr__(self, name: str):
        tpl = self.__dict__.get("tpl")
        if tpl is not None:
            if name in tpl.shared:
                return tpl.shared[name]
            if name in ("records", "seq", "n"):
                return getattr(tpl, name)
            if name == "table":
                return self.t.table
        raise AttributeError(name)
