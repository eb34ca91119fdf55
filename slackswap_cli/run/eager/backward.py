"""The one backward path of every kind of call: saved tensors handed back, chains replayed.

`unpack(s, packed)` gives autograd what a pack stood in for: a kept tensor as it is; a swapped
one (`packs.SwappedRef`) viewed from its storage fetched back (`swap.wait_kept`), its copy back
issued ahead of need as backward progresses (the plan's prefetch points: `issue_prefetches`);
a recomputed one (`packs.RecomputedRef`) after its chain ran (`run_chain`: the records the
chain needs replayed under `no_grad` with autocast off, chains laid out earlier first, as
simulated). What the call holds for a root (made by a chain, fetched back) is let go once
autograd took every saved reference to it and no later chain reads it (`release`). A later
backward through a graph the first retained (`backward(retain_graph=True)` twice, a split
backward's weight pass) unpacks again (`unpack_again`): a swapped tensor fetched again from
the host copy its saved references hold, a recomputed one made again (`remake`), neither kept.

Re-running recorded ops: `resolve(s, loc, local)` gives the value recorded output `loc` had
when the forward made it (or last read it: `version_of`): made in this replay (`local`) or by
an earlier chain, still alive and unchanged (held by autograd or pinned for a chain; in a call
that follows a template, handed over by its pack: `live`), fetched back from its host copy, or re-derived: a view from its
(resident) input, an in-place result from what it wrote into. `replay(s, k, local)` re-runs
record k on resolved arguments (the very function and arguments the forward ran, side-effect
writes sent to copies); a view whose geometry is known is one `as_strided` from the nearest
value at hand (`view_base`). `chain_records` / `chain_made` say what a chain replays and
which of its results are roots (a followed call reads them from its template, worked out once).

Correctness never depends on the line-up being right: a replay runs the very functions and
arguments the forward ran, on the same values.
"""
from __future__ import annotations

import weakref

import torch
import torch.utils._pytree as pytree

from ...errors import InputError
from .packs import STATE, SwappedRef
from .recorded import InputRef, OpRecord, OutRef, prepare_replay, view_geometry, view_of

__all__ = ["unpack", "run_chain", "resolve", "replay", "AutocastOff"]

_as_strided = torch.Tensor.as_strided


def unpack(s, packed):
    """The unpack hook of call `s` (see the module docstring)."""
    if isinstance(packed, torch.Tensor):
        return packed
    if torch.is_grad_enabled():           # (only under create_graph=True)
        raise InputError("a backward with create_graph=True (double backward) through a step "
                         "whose saved tensors slackswap swapped or recomputed: they come "
                         "back without the graph that made them, so higher-order gradients "
                         "would be wrong",
                         hint="unpatch(model) for a step that needs create_graph=True")
    if packed.taken:                      # a later backward through a retained graph
        return unpack_again(s, packed)
    packed.taken = True
    r = packed.root
    first = s.table.bwd_use.get(r)
    if first is not None and first > s.progress:
        s.progress = first
    order = s.prefetch_order
    if s.next_prefetch < len(order) and s.table.prefetch_at[order[s.next_prefetch]] <= s.progress:
        issue_prefetches(s)
    if type(packed) is SwappedRef:
        sw = packed.copy
        out = sw.fetch().detach() if packed.whole else view_of(
            sw.fetch(), packed.dtype, packed.shape, packed.stride, packed.offset)
        sw.packs -= 1
        if sw.packs <= 0 and s.chain_uses.get(r, 0) <= 0:
            sw.dev = None                 # autograd holds what it took
    else:
        owner = s.table.made_by[r]
        if owner not in s.done_chains:
            # autograd unpacks a node's saved tensors in its own order: chains laid out
            # before this one (whose roots it may read) run first, as simulated
            for o in sorted(x for x in s.deferred if x < owner and x not in s.done_chains):
                run_chain(s, o)
            run_chain(s, owner)
        out = resolve(s, packed.loc, {})
    n = s.packs[r] = s.packs.get(r, 0) - 1
    if n <= 0:
        release(s, r)
    return out


def unpack_again(s, packed):
    """A saved tensor unpacked again, by a later backward through a graph retained by the
    first (`backward(retain_graph=True)` and another backward; a split backward's weight
    pass): a swapped one fetched again from its host copy, a recomputed one made again
    (`remake`). Neither is kept here: between backwards the call holds what it held after
    the first, what autograd keeps as it is (a microbatch's kept activations, until its
    weight pass: `stages.ENDS`)."""
    if type(packed) is SwappedRef:
        got = packed.host.fetch()
        return got if packed.whole else view_of(got, packed.dtype, packed.shape,
                                                 packed.stride, packed.offset)
    return remake(s, packed.loc)


def remake(s, loc: tuple[int, int]) -> torch.Tensor:
    """Recorded output `loc` made again after its chain ran (see `unpack_again`): what is
    at hand is read (kept activations autograd still holds, host copies fetched again, the
    call's inputs, parameters), what is not is re-run from its own arguments (`resolve`),
    under `no_grad` with autocast off, as a chain runs."""
    grad = torch.is_grad_enabled()
    torch.set_grad_enabled(False)
    prev, STATE.run = getattr(STATE, "run", None), None      # (no recording)
    again, s.again = s.again, True
    autocast = AutocastOff(s.device)
    try:
        with autocast:
            out = resolve(s, loc, {})
    finally:
        torch.set_grad_enabled(grad)
        STATE.run = prev
        s.again = again
    return out


def release(s, r: int) -> None:
    """Drop our reference to a made or fetched root once autograd took all its saved
    references and no later chain reads it (then it lives as long as autograd holds it)."""
    if s.packs.get(r, 0) <= 0 and s.chain_uses.get(r, 0) <= 0:
        s.made.pop(r, None)
        sw = s.root_swap.get(r)
        if sw is not None and sw.packs <= 0:
            sw.dev = None


def issue_prefetches(s) -> None:
    order, pf = s.prefetch_order, s.table.prefetch_at
    while s.next_prefetch < len(order) and pf[order[s.next_prefetch]] <= s.progress:
        r = order[s.next_prefetch]
        s.next_prefetch += 1
        sw = s.root_swap.get(r)
        h = None if sw is None else sw.handle
        if h is not None and h.device_copy is None:
            h.engine.prefetch(h)               # (`swap.prefetch`)


def run_chain(s, owner: int) -> None:
    """Replay chain `owner`'s records; keep the roots it made until autograd took them."""
    local: dict[tuple[int, int], torch.Tensor] = {}
    ks = chain_records(s, owner)
    s.chain = owner
    grad = torch.is_grad_enabled()
    torch.set_grad_enabled(False)
    prev, STATE.run = getattr(STATE, "run", None), None      # (no recording)
    autocast = AutocastOff(s.device)
    try:
        with autocast:
            for k in ks:
                replay(s, k, local)
        s.rerun_ops += len(ks)
    finally:
        torch.set_grad_enabled(grad)
        STATE.run = prev
        s.chain = None
    s.done_chains.add(owner)
    if s.tpl is not None:           # let go of the handed-over values only this chain needed
        for loc in s.tpl.chain_reads.get(owner, ()):
            s.bound_uses[loc] -= 1
            if s.bound_uses[loc] <= 0:
                x = s.bound.pop(loc, None)
                if x is not None:     # (for a later backward: `live`)
                    s.gone[loc] = weakref.ref(x)
    for loc, tid in chain_made(s, owner, local):
        t = local.get(loc)
        if t is not None:
            s.made[tid] = t
    for r in s.table.chain_inputs.get(owner, ()):
        s.chain_uses[r] = s.chain_uses.get(r, 0) - 1
        if s.chain_uses[r] <= 0:
            s.pinned.pop(r, None)
            release(s, r)


def chain_records(s, owner: int) -> list[int]:
    """The records chain `owner` replays, in order: the ops the roots it deferred need (a
    call following its template unchanged: the template's, worked out once)."""
    cache = s.tpl.chain_records if s.tpl is not None and not s.broken else None
    ks = cache.get(owner) if cache is not None else None
    if ks is None:
        needs = s.table.needs
        ks = [s.rec_of_op[p] for p in sorted({p for r in s.deferred.get(owner, ())
                                              for p in needs[r]})]
        if cache is not None:
            cache[owner] = ks
    return ks


def chain_made(s, owner: int, local: dict) -> list[tuple[tuple[int, int], int]]:
    """(location, root) of the values chain `owner` made that are its own roots."""
    cache = s.tpl.chain_made if s.tpl is not None and not s.broken else None
    got = cache.get(owner) if cache is not None else None
    if got is None:
        made_by = s.table.made_by
        got = [(loc, tid) for loc in local
               if (tid := s.tid_of.get(loc)) is not None and made_by.get(tid) == owner]
        if cache is not None:
            cache[owner] = got
    return got


def live(s, loc: tuple[int, int]):
    """Output `loc` of this forward if it is still alive (it may since have changed): the
    tensor itself, or the alias autograd holds of it; in a call that follows a template, the
    value its pack handed over."""
    if s.tpl is not None:
        x = s.bound.get(loc)
        if x is None and s.again:     # handed over, then let go of, or kept: autograd's, if
            ref = s.gone.get(loc) or s.kept_alias.get(loc)      # it holds it
            x = ref() if ref is not None else None
        return x
    ref = s.records[loc[0]].outs[loc[1]]
    x = ref() if ref is not None else None
    if x is not None:
        return x.detach()          # (a chain's values hold no graph: see `holding.keep`)
    ref = s.kept_alias.get(loc)
    x = ref() if ref is not None else None
    if x is None:       # a root held for a chain that autograd saves only views of
        tid = s.tid_of.get(loc)
        if tid is not None and s.loc_of_tid.get(tid) == loc:
            x = s.pinned.get(tid)
    return x


def version_of(s, loc: tuple[int, int]) -> int:
    """The version output `loc` had when the forward produced it, or when it last read it
    where a write through another alias came between (`c[:, t] = r` into a `zeros_like`'s
    `c`: `CallState.read_version`): what a replayed read saw, as a chain replays only reads
    after a root's last write (trace/graph_profile.py's stale reads). In a call that follows a
    template: a handed-over value's version at its pack, not the first call's: a call without
    the recorder may take another eager path to the same value. C++ `linear` adds the bias in
    place (`add_`) on an input that is not 2-d and contiguous, but out of place under a
    dispatch mode (`isTensorSubclassLike`), so the first call recorded `add` (version 0)
    where a later one packs `add_`'s result (version 1)."""
    if s.tpl is not None:
        return s.bound_version.get(loc, -1)
    v = s.read_version.get(loc)
    return s.records[loc[0]].versions[loc[1]] if v is None else v


def replay(s, k: int, local: dict) -> None:
    """Re-run record `k` on resolved arguments; its outputs go into `local`."""
    rec = s.records[k]
    geom = rec.geom
    if geom:                  # a view, re-derived with C calls (see `view_geometry`)
        if s.chain is None:           # (an unpack's: straight from the value at hand)
            base, want = view_base(s, rec, local)
        else:
            base, want = rec.args[0], geom[0]
            if type(base) is OutRef:
                base = resolve(s, base.loc, local)
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
            flat[i] = resolve(s, a.loc, local)
        elif cls is InputRef:
            flat[i] = s.call_inputs[a.i]
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


def view_base(s, rec: OpRecord, local: dict) -> tuple:
    """For view `rec` re-derived by its geometry outside a chain (in an unpack, whose
    `local` is thrown away after): the nearest value at hand below it through views
    re-derivable by geometry, and the geometry that value must have. The same value
    `resolve` would reach level by level; one `as_strided` from it gives the same view
    (offsets count in the storage), without making the views between."""
    src, want = rec.args[0], rec.geom[0]
    while type(src) is OutRef:
        loc = src.loc
        x = at_hand(s, loc, local)
        if x is not None:
            return x, want
        below, tid = s.records[loc[0]], s.tid_of.get(loc)
        geom = below.geom
        if not geom or geom[1][loc[1]] != want or (
                tid is not None and tid in s.metas and tid in s.root_swap):
            return resolve(s, loc, local), want
        src, want = below.args[0], geom[0]
    return src, want


def at_hand(s, loc: tuple[int, int], local: dict):
    """Output `loc`'s value if this call holds it: made in `local` or by a chain, or
    still alive (held by autograd or pinned) and unchanged since the forward."""
    x = local.get(loc)
    if x is not None:
        return x
    tid = s.tid_of.get(loc)
    if tid is not None:
        x = s.made.get(tid)
        if x is not None:
            return x
    x = live(s, loc)
    if x is not None and x._version == version_of(s, loc):
        if s.recorded and s.chain is not None:     # (noted for a steady-state template)
            s.live_reads.setdefault(s.chain, set()).add(loc)
        return x
    return None


def resolve(s, loc: tuple[int, int], local: dict) -> torch.Tensor:
    """The value recorded output `loc` had when the forward produced it (read it:
    `version_of`)."""
    x = at_hand(s, loc, local)
    if x is not None:
        return x
    k, j = loc
    rec = s.records[k]
    tid = s.tid_of.get(loc)
    if tid is not None and tid in s.metas and tid in s.root_swap and (
            not s.again or s.root_swap[tid].can_fetch()):
        out = local[loc] = view_of(s.root_swap[tid].fetch(), *s.metas[tid])
        return out
    if s.again:       # made again after a first backward: from its arguments (an in-place
        if rec.wfirst and swapped_root(s, tid):   # write to a copy of what it wrote into),
            return from_host_copy(s, loc, local)  # but a write into a swapped storage is
        replay(s, k, local)                       # in its host copy (a random op's too)
        return local[loc]
    if rec.alias:
        if rec.wfirst:
            src = rec.args[0]      # in place: its effect is already in the data
            out = resolve(s, src.loc, local)
        else:
            replay(s, k, local)    # a view: re-derived from its (resident) input
            out = local[loc]
        local[loc] = out
        return out
    raise RuntimeError(
        f"slackswap: backward needs output {j} of {rec.func} (recorded op {k}, profile "
        f"tensor {tid}), which the plan neither kept "
        "nor can recompute here; this is a bug in slackswap, please report it")


def swapped_root(s, tid: int | None) -> bool:
    """Whether profile tensor `tid`'s storage root was swapped and its host copy can still
    be fetched."""
    if tid is None:
        return False
    sw = s.root_swap.get(s.root(tid))
    return sw is not None and sw.can_fetch()


def from_host_copy(s, loc: tuple[int, int], local: dict) -> torch.Tensor:
    """In a later backward (`unpack_again`): in-place result `loc` read as the first backward
    read it, from the host copy of its swapped storage, which the forward took after its
    writes (a chain never reads a value a later write overwrote: `chains.py`). Re-running the
    writes instead would draw a random op's numbers anew (dropout's `bernoulli_`) and apply
    a deterministic write twice to bytes that hold it already."""
    again, s.again = s.again, False
    try:
        return resolve(s, loc, local)
    finally:
        s.again = again


class AutocastOff:
    """Autocast off on the devices where it is on, for a replay (the records carry every cast)."""
    __slots__ = ("types", "ctx")

    def __init__(self, device):
        self.types = ("cpu",) if device is None or device.type == "cpu" else ("cpu", device.type)
        self.ctx = ()

    def __enter__(self):
        if not any(map(torch.is_autocast_enabled, self.types)):
            return                                       # (the common case: nothing to do)
        self.ctx = [torch.autocast(t, enabled=False) for t in self.types
                    if torch.is_autocast_enabled(t)]     # (making one costs: not per replay)
        for c in self.ctx:
            c.__enter__()

    def __exit__(self, *exc):
        for c in reversed(self.ctx):
            c.__exit__(*exc)
