"""What autograd holds for a saved tensor, for every kind of call: plain functions over a
`call_state.CallState`.

- `keep`: an alias of the tensor (`x.detach()`), counted by the guard;
- `swap`: a `packs.SwappedRef` to a host copy of the tensor's whole storage (one copy per
  storage, shared by every view saved of it);
- `guard_decision`: a saved tensor the plan cannot place, kept while the guard admits it,
  else swapped (`guard.py`'s rule): the one decision every kind of call makes this way;
- `count_fresh`: what a keep-all run holds (each storage autograd saves, once);
- `held_device_bytes`: what a call holds on the device for backward right now.
"""
from __future__ import annotations

import weakref

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ...errors import InputError
from ...schema import Action
from ...trace.storage import storage_key, storage_nbytes
from .. import swap as swap_engine
from .packs import SwappedRef

__all__ = ["keep", "swap", "guard_decision", "plan_reserve", "count", "count_fresh",
           "held_device_bytes"]


def keep(s, x: torch.Tensor, loc=None) -> torch.Tensor:
    """What autograd holds for a kept tensor: `x.detach()` (same storage, same version
    counter), never `x` itself. A node that saves its own output would hold that output,
    whose `grad_fn` is the node: a cycle through C++ that Python's collector cannot see,
    so a graph dropped without backward (a skipped step, an OOM retry) would keep every
    saved tensor alive for good. For the same reason, what a call holds for its chains
    (pinned roots, handed-over values, what a chain reads live) are such aliases: the
    graph holds the call (its unpack hook), so the call must not hold the graph. The weak
    references (for `held_device_bytes`, and for a chain that reads output `loc` while
    autograd holds it: `backward.live`) are to what autograd holds."""
    kept = x.detach()
    count(s, x)
    ref = weakref.ref(kept)
    s.kept_refs.append(ref)
    if loc is not None:
        s.kept_alias.setdefault(loc, ref)
    return kept


def count(s, x: torch.Tensor) -> None:
    """Count a storage this forward holds for backward as planned (`Guard.hold`)."""
    guard = s.guard
    if guard is not None and x.device.type != "meta":
        key = storage_key(x)
        if key not in s.externals():
            guard.hold(key, storage_nbytes(x))


def swap(s, x: torch.Tensor, r, own: bool) -> SwappedRef:
    """Pack `x` (root `r` or a view of it) as a host copy of its storage. `own`: x's
    storage is root r's own (so a chain reading r fetches this copy): found out on the
    first call, followed later. A tensor that covers its storage exactly (contiguous from
    offset 0, as most saved tensors are) is copied as it is, not as bytes: one copy each
    way and no view to make (`swap.offload_whole`); its unpack hands back the fetched tensor
    (`SwappedRef.whole`)."""
    # one copy per storage (a root and its views), found by the storage itself: an
    # address alone may be a new tensor's, once a swapped one's memory was freed
    st, dev = x.untyped_storage(), x.device
    key = (dev.type, dev.index, st.data_ptr())          # (`storage_key`)
    geo = (x.dtype, tuple(x.shape), tuple(x.stride()), x.storage_offset())
    sw = s.by_storage.get(key)
    if sw is None or sw.ref.expired() or sw.version != x._version:
        # (a storage written since its copy, say a buffer filled step by step, is
        # copied again: a copy serves only the contents it saw)
        ref = StorageWeakRef(st)
        if geo[3] == 0 and x.is_contiguous() and x.nbytes == st.nbytes():
            copy, whole = swap_engine.offload_whole(x, geo[1], geo[2]), geo
        else:
            copy, whole = swap_engine.offload_storage(st, dev, ref), None
        sw = s.by_storage[key] = swap_engine.StorageCopy(ref, copy, x._version, whole)
        s.swaps.append(sw)
        host = swap_engine.HostCopy(copy)     # (held by the saved references alone)
        sw.host = weakref.ref(host)
    else:
        host = sw.host()
        if host is None:                      # (the references made so far are gone)
            host = swap_engine.HostCopy(sw.handle)
            sw.host = weakref.ref(host)
    if own:
        s.root_swap[r] = sw
        held = s.pinned.pop(r, None)      # the host copy serves a chain that reads it
        if held is not None and s.guard is not None:
            s.guard.drop(key, storage_nbytes(held))
    sw.packs += 1
    s.packs[r] = s.packs.get(r, 0) + 1
    return SwappedRef(r, sw, host, *geo, sw.geo == geo)


def guard_decision(s, x: torch.Tensor, loc, note, reserve: int, tracked: bool = True):
    """A saved tensor the plan cannot place: kept while the guard admits it, leaving
    `reserve` bytes for what the plan keeps later in forward, else swapped (`guard.py`'s
    rule); `note` (a `packs.PackNote`, or None) tells later calls at this signature which.
    `tracked`: a kept one is weakly tracked (`keep`)."""
    if x.device.type == "meta":
        return keep(s, x, loc) if tracked else x.detach()
    key = storage_key(x)
    if key in s.externals():           # a parameter, buffer or input: not held for it
        return x.detach()
    if s.guard.admit(key, storage_nbytes(x), reserve):
        return keep(s, x, loc) if tracked else x.detach()
    if note is not None:
        note.action = Action.SWAP
    return swap(s, x, None, False)


def plan_reserve(s) -> int:
    """Bytes the plan keeps from the next expected op on (`keep_after`): room the guard
    leaves. (0 for a table written before it was kept, and after the last op.) A plan
    borrowed from other shapes has them per pack, as the first call at these shapes saw
    them (`pack_reserve`), or `keep_after` scaled."""
    t = s.t
    if t.pack_reserve is not None:
        return t.pack_reserve[min(len(s.seq), len(t.pack_reserve) - 1)]
    after = s.table.keep_after
    return int(after[min(s.lineup.ptr, len(after) - 1)] * t.scale) if after else 0


def count_fresh(s, x: torch.Tensor) -> int:
    """Add `x`'s storage to what a keep-all run holds (`saved_bytes`), the first time it
    is saved and not a parameter, buffer or input; the bytes added."""
    if x.device.type == "meta":
        return 0
    key = storage_key(x)
    if key in s.saved_keys or key in s.externals():
        return 0
    s.saved_keys.add(x)
    n = storage_nbytes(x)
    s.saved_bytes += n
    return n


def held_device_bytes(s) -> int:
    """Activation bytes call `s` holds on the device for backward right now: storages of
    forward-produced tensors autograd holds as they are, plus what the plan holds (tensors
    kept for a chain, made by one, fetched back, or still being copied to the host).
    Parameters, buffers and inputs are not counted; each storage counts once. A call that
    follows a template notes what autograd holds only when asked to (`measure_held`)."""
    if not s.measuring:
        raise InputError(
            "this later call did not note what autograd holds (it costs a weak reference per "
            "saved tensor), so held_device_bytes() cannot count it",
            hint="set model.forward.__slackswap__.measure_held = True before the call")
    seen, total, external = set(), 0, s.externals()
    tensors = [r() for r in s.kept_refs]
    tensors += [*s.pinned.values(), *s.made.values(), *s.bound.values(),
                *(sw.dev for sw in s.swaps if sw.dev is not None)]
    for t in tensors:
        if t is None or t.device.type == "meta":
            continue
        key = storage_key(t)
        if key not in seen and key not in external:
            seen.add(key)
            total += storage_nbytes(t)
    for sw in s.swaps:
        h = sw.handle
        if h is not None and h.d2h_done is not None and not h.d2h_done.query():
            total += h.nbytes
    return total
