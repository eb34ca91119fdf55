"""A patched tensor parallel model (DTensor): the plan carried out on each rank's local shards.

The profile of a DTensor model is traced on the local shards (trace/dtensor.py): its ops are
the local ops DTensor runs, its collectives spelled out. In eager, autograd works one level
up: it records DTensor ops and saves DTensors, whose reported shape is the global one and whose
storage is no real storage. These adapters bring the run down to the profile's level:

- the recorder (a dispatch mode, run/eager/first_call.py) does not record an op on DTensors
  (`takes_dtensor`): it returns NotImplemented, so DTensor's own dispatch runs the op, and the
  local ops it runs (and the collectives its redistributions call) come back to the mode,
  which records and lines them up with the profile's, on local shapes.
- a functional collective's result (an AsyncCollectiveTensor, which waits when an op reads it)
  is waited for as the traced step does, right after the collective, and the recorder records
  that `wait_tensor` and then the op on the waited value (`waited`);
- a module `parallelize_module` gave input and output hooks (a ColwiseParallel linear) has
  our body hooks first, before those (`hooks_first_on_tp`): its input hook's ops (the
  `from_local` of its input) are its own ops, and its output hook's (the `to_local`, a
  RowwiseParallel's all-reduce) its parent's, as the traced step attributes them;
- `hooks`: a saved DTensor is packed as its local shard (`_local_tensor`, the very tensor the
  recorder saw made), so keep, swap and recompute, the guard and the memory counted all work
  on the bytes this rank holds; on unpack the local shard (kept, fetched back or recomputed)
  is wrapped again as a DTensor of the same mesh, placements, shape and stride;
- the local shards of DTensor parameters count as held by the model (`shard_ids`), as
  parameters do, so a recompute chain may read them.

Collectives are never replayed (`trace.dtensor.is_collective`: the profile marks what they make
as not recomputable, and a recorded collective makes a chain unusable).
"""
from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

from ...trace.dtensor import is_collective, is_dtensor, wrapper_types

__all__ = ["hooks", "hooks_first_on_tp", "shard_ids", "takes_dtensor", "distributed_wrapper",
           "is_async", "waited", "uses_dtensor", "is_collective"]

_USES: "weakref.WeakKeyDictionary[torch.nn.Module, bool]" = weakref.WeakKeyDictionary()


def uses_dtensor(model: torch.nn.Module) -> bool:
    """Does `model` hold a DTensor parameter (parallelised with `parallelize_module`, or
    sharded by FSDP2)? Asked once per model: the answer decides whether the run adapts."""
    got = _USES.get(model)
    if got is None:
        got = _USES[model] = any(is_dtensor(p) for p in model.parameters())
    return got


def shard_ids(model: torch.nn.Module) -> set[int]:
    """The ids of the local shards of `model`'s DTensor parameters: held by the model as its
    parameters are, so a recompute chain may read them (the recorder holds an outside value
    only weakly)."""
    if not uses_dtensor(model):
        return set()
    return {id(p._local_tensor) for p in model.parameters() if is_dtensor(p)}


def takes_dtensor(types) -> bool:
    """Does a call whose tensor types (a dispatch mode's `types`) are these take a DTensor?"""
    cls = wrapper_types()
    return bool(cls) and any(issubclass(t, cls[0]) for t in types)


def distributed_wrapper(types) -> bool:
    """Does a call whose tensor types are these take a DTensor or a collective's result not
    waited for yet (tensors with no storage of their own: a dispatch mode that reads storages
    lets their own dispatch run the call, and sees the local ops it runs)?"""
    cls = wrapper_types()
    return bool(cls) and any(issubclass(t, cls) for t in types)


def is_async(x: Any) -> bool:
    """Is `x` a functional collective's result (AsyncCollectiveTensor), waited for on use?"""
    cls = wrapper_types()
    return bool(cls) and isinstance(x, cls[1])


def waited(args: Any, kwargs: Any, wait: Callable) -> tuple[Any, Any]:
    """(args, kwargs) with each AsyncCollectiveTensor replaced by its value, waited for by
    `wait(value)` (the recorder records that `wait_tensor` as the traced step has it: right
    after the collective, before any view of its result) when not waited for yet."""
    def unwrap(x):
        if not x.completed:
            wait(x.elem)
            x.completed = True
        return x.elem
    leaves = pytree.tree_leaves((args, kwargs))
    if not any(is_async(x) for x in leaves):
        return args, kwargs
    return pytree.tree_map_only(wrapper_types()[1], unwrap, (args, kwargs))


def hooks_first_on_tp(mod: torch.nn.Module, mine: tuple) -> None:
    """On a module `distribute_module` gave hooks, move our body-entry pre-hook and body-exit
    forward hook (`mine`: their handles) first, the other hooks keeping their order."""
    if not getattr(mod, "_distribute_module_applied", False):
        return
    for hooks, handle in ((mod._forward_pre_hooks, mine[0]), (mod._forward_hooks, mine[1])):
        if next(iter(hooks), None) == handle.id:
            continue
        ours = hooks.pop(handle.id)
        rest = list(hooks.items())
        hooks.clear()
        hooks[handle.id] = ours
        hooks.update(rest)


class _Packed:
    """What autograd holds for a saved DTensor: the pack of its local shard and its layout."""
    __slots__ = ("inner", "mesh", "placements", "shape", "stride")

    def __init__(self, inner, x):
        self.inner = inner
        self.mesh, self.placements = x.device_mesh, tuple(x.placements)
        self.shape, self.stride = x.shape, x.stride()


def hooks(pack: Callable, unpack: Callable, model: torch.nn.Module) -> tuple[Callable, Callable]:
    """Saved-tensor hooks that hand `pack` and `unpack` the local shard of a saved DTensor and
    wrap it again on the way back; other tensors pass as they are. A model without DTensor
    parameters gets `pack` and `unpack` themselves."""
    if not uses_dtensor(model):
        return pack, unpack

    def pack_local(x):
        if is_dtensor(x):
            return _Packed(pack(x._local_tensor), x)
        if is_async(x):                  # a collective's result not waited for yet
            x = x.trigger_wait()         # (the wait the op saving it would run next)
        return pack(x)

    def unpack_local(packed):
        if type(packed) is _Packed:
            from torch.distributed.tensor import DTensor
            local = unpack(packed.inner)
            with torch.no_grad():
                return DTensor.from_local(local, packed.mesh, packed.placements,
                                          run_check=False, shape=packed.shape,
                                          stride=packed.stride)
        return unpack(packed)
    return pack_local, unpack_local
