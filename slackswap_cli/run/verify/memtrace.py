"""Measure activation memory op by op while a real training step runs.

The simulator (`simulate.py`) predicts *activation memory*, as `schema` defines it: the bytes
of live activation storages, a storage counted once however many views share it, and
parameters, buffers, inputs and gradients left out. This module measures the same quantity on
a real execution, on any device (no allocator statistics needed):

- a `TorchDispatchMode` sees every aten call of the step, in execution order;
- an output whose storage is new (not the storage of one of the call's inputs, not already
  tracked) is an allocation: the storage is recorded with a *weak* reference
  (`StorageWeakRef`), so tracking never keeps anything alive. Views and in-place results share
  an input's storage and add nothing: a view of a parameter or an input costs no activation
  bytes, exactly as in the profile;
- after every call the tracker notes which tracked storages have died since the previous call
  (their last Python or autograd reference went away), so a storage is live from the call that
  allocated it to the last call before its release was seen. A value the patched module frees
  right after its last reader (`x = None`) is therefore live through that reader, as the
  simulator counts it ("freed at the end of its last reader");
- storages that turn out to be gradients (the `.grad` of a parameter, known only once backward
  is done) are taken out afterwards with `exclude`, so they count nowhere on the timeline.

Each call gives one `Sample`: its position, aten target, a caller-chosen label (the patched
module's statement, for instance) and the live bytes *during* the call (its outputs allocated,
its inputs not yet released): the simulator's "memory during a task". Calls that `locate`
labels `SKIP` (host-side buffers of the swap engine, say) are sampled but allocate nothing.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
import torch.utils._pytree as pytree
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from ...trace.dtensor import wrapper_types
from ...trace.storage import storage_object_key
from ..parallel.dtensor import distributed_wrapper

SKIP = object()    # a `locate` result: this call's outputs are not activation memory


@dataclass
class Storage:
    """One tracked storage: its bytes and the samples it was live from (and died before)."""
    key: int
    nbytes: int
    born: int                    # sample index of the allocating call
    died: int | None = None      # first sample at which it was seen dead (None: still alive)
    label: Any = None            # the allocating call's label
    target: str = ""
    ref: Any = field(default=None, repr=False)


@dataclass
class Sample:
    index: int
    target: str                  # aten overload, e.g. "aten.mm.default"
    label: Any                   # whatever `locate` returned (None when no `locate`)
    allocated: list[int] = field(default_factory=list)   # indices into tracker.storages


def storage_of(t: torch.Tensor):
    """(key, nbytes) of the storage behind `t`, or None for a tensor without real storage."""
    if t.device.type == "meta" or t.is_sparse or t.layout != torch.strided \
            or isinstance(t, wrapper_types()):    # (a DTensor's bytes are its local shard's)
        return None
    try:
        s = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    return storage_object_key(t), s.nbytes()


class MemTracker(TorchDispatchMode):
    """Track live activation storages across the aten calls run under it.

    `locate()` (optional) is called at every aten call from inside the dispatch, so it can
    inspect the Python stack (`sys._getframe`) to say where the call came from; it returns a
    label, or `SKIP` for a call whose outputs are not activation memory.
    """

    def __init__(self, locate: Callable[[], Any] | None = None):
        super().__init__()
        self.locate = locate
        self.samples: list[Sample] = []
        self.storages: list[Storage] = []
        self._live: dict[int, int] = {}      # storage key -> index into storages (alive ones)

    # -- recording ---------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if distributed_wrapper(types):
            return NotImplemented     # a DTensor's op: its local ops come here (run/parallel/dtensor.py)
        out = func(*args, **kwargs)
        label = self.locate() if self.locate is not None else None
        index = len(self.samples)
        self._sweep(index)
        sample = Sample(index, str(func), label)
        if label is not SKIP:
            inputs = {k[0] for x in pytree.tree_leaves((args, kwargs))
                      if isinstance(x, torch.Tensor) and (k := storage_of(x)) is not None}
            for x in pytree.tree_leaves(out):
                if not isinstance(x, torch.Tensor):
                    continue
                k = storage_of(x)
                if k is None or k[1] == 0 or k[0] in inputs or k[0] in self._live:
                    continue
                st = Storage(k[0], k[1], index, None, label, str(func),
                             StorageWeakRef(x.untyped_storage()))
                self._live[k[0]] = len(self.storages)
                sample.allocated.append(len(self.storages))
                self.storages.append(st)
        self.samples.append(sample)
        return out

    def _sweep(self, index: int) -> None:
        """Mark the storages that died since the previous call."""
        dead = [k for k, i in self._live.items() if self.storages[i].ref.expired()]
        for k in dead:
            self.storages[self._live.pop(k)].died = index

    def finish(self) -> None:
        """Close the record: storages released after the last call die at its end."""
        self._sweep(len(self.samples))
        for st in self.storages:
            st.ref = None   # StorageWeakRef holds a weak count: let it go

    # -- reading -----------------------------------------------------------------------------
    def exclude(self, tensors: Iterable[torch.Tensor]) -> int:
        """Take the storages of `tensors` (gradients, say) off the timeline; returns how many."""
        keys = {k[0] for t in tensors if isinstance(t, torch.Tensor)
                and (k := storage_of(t)) is not None}
        n = 0
        for st in self.storages:
            if st.key in keys and st.died is None and st.nbytes >= 0:
                st.nbytes = -st.nbytes - 1      # marked: counts as 0, original size recoverable
                n += 1
        return n

    def timeline(self) -> list[int]:
        """Live activation bytes during each sample (call)."""
        n = len(self.samples)
        delta = [0] * (n + 1)
        for st in self.storages:
            if st.nbytes <= 0:
                continue
            delta[st.born] += st.nbytes
            end = n if st.died is None else st.died
            delta[end] -= st.nbytes
        out, cur = [], 0
        for i in range(n):
            cur += delta[i]
            out.append(cur)
        return out

    def live_at(self, index: int) -> list[Storage]:
        """The storages live during sample `index`, largest first."""
        alive = [st for st in self.storages if st.nbytes > 0 and st.born <= index
                 and (st.died is None or st.died > index)]
        return sorted(alive, key=lambda s: -s.nbytes)


def caller_line(codes: dict, outside: Any = None) -> Callable[[], Any]:
    """A `locate` that names a call after the line of the innermost frame running one of
    `codes` (code object -> name): `(name, line number)`; `SKIP` when that name is `SKIP`;
    `outside` for a call made outside them all."""
    def locate():
        f = sys._getframe(2)
        while f is not None:
            name = codes.get(f.f_code)
            if name is not None:
                return SKIP if name is SKIP else (name, f.f_lineno)
            f = f.f_back
        return outside
    return locate


def step_peaks(model, inputs) -> tuple[int, int]:
    """(forward peak, backward peak) activation bytes of one training step of `model`, whose
    call on `inputs` (positional) returns the loss: the swap engine's host buffers and the
    parameters' gradients left out; the gradients are set to None after."""
    from .. import swap
    tracker = MemTracker(caller_line({swap.HostPool.get.__code__: SKIP}, outside=None))
    with tracker:
        loss = model(*inputs)
        n_forward = len(tracker.samples)
        loss.backward()
    tracker.finish()
    tracker.exclude([p.grad for p in model.parameters() if p.grad is not None])
    model.zero_grad(set_to_none=True)
    timeline = tracker.timeline()
    return max(timeline[:n_forward]), max(timeline[n_forward:])


__all__ = ["MemTracker", "Sample", "Storage", "SKIP", "caller_line", "step_peaks",
           "storage_of"]
