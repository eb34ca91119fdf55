"""Tensor parallelism (DTensor) in a trace: the step traced on each rank's local shards, and
the collectives that must never be re-run.

A model parallelised with `parallelize_module` (ColwiseParallel, RowwiseParallel,
SequenceParallel) holds DTensor parameters. `make_fx` does not see through a DTensor that is a
placeholder (its local shard becomes a constant, its gradient is lost), so the traced step
takes each DTensor parameter's LOCAL shard as its placeholder and wraps it back with
`DTensor.from_local` inside (`local_params`, `as_dtensors`): every op of the graph is then a
local op on local shapes, with the communication DTensor does spelled out as
`_c10d_functional` ops (all_reduce, all_gather_into_tensor, reduce_scatter_tensor,
wait_tensor, ...). Sizes in the profile are the local ones, what a rank holds.

Collectives are not replayed by a recompute chain (`is_collective`): re-running one would
communicate again (every rank has to join it, in the same order) and its result is another
rank's data. The profile marks their results as not recomputable, like a random op's: they
may be kept or swapped, and the ops after them recompute from them.
"""
from __future__ import annotations

import functools
from typing import Any

import torch

__all__ = ["wrapper_types", "is_dtensor", "is_collective", "local_params", "as_dtensors", "COLLECTIVE_NAMESPACES"]

# the op namespaces of communication: functional collectives (what DTensor's redistribute and
# the TP styles call), their autograd variants, and the c10d process-group ops
COLLECTIVE_NAMESPACES = frozenset({"_c10d_functional", "_c10d_functional_autograd", "c10d",
                                   "_dtensor"})


@functools.cache
def wrapper_types() -> tuple[type, ...]:
    """(DTensor, AsyncCollectiveTensor): the tensors of a distributed step that have no storage
    of their own; () when torch is built without distributed."""
    try:
        from torch.distributed._functional_collectives import AsyncCollectiveTensor
        from torch.distributed.tensor import DTensor
    except ImportError:          # pragma: no cover - torch built without distributed
        return ()
    return DTensor, AsyncCollectiveTensor


def is_dtensor(x: Any) -> bool:
    """Is `x` a DTensor (a tensor parallel model's parameter or activation)?"""
    types = wrapper_types()
    return bool(types) and isinstance(x, types[0])


def is_collective(target: Any) -> bool:
    """Is this op (a graph node's target or a recorded call's function) a collective or the
    wait for one? Such an op is never re-run by a recompute chain."""
    ns = getattr(target, "namespace", None)
    return ns in COLLECTIVE_NAMESPACES


def local_params(params: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict]:
    """(the parameters with each DTensor replaced by a leaf of its local shard, the DTensor
    layout of each replaced name: mesh, placements, global shape and stride). The leaf
    requires grad as the parameter does: its gradient is the local shard's."""
    layouts: dict[str, tuple] = {}
    out: dict[str, torch.Tensor] = {}
    for name, p in params.items():
        if is_dtensor(p):
            layouts[name] = (p.device_mesh, tuple(p.placements), p.shape, p.stride())
            out[name] = p.to_local().detach().requires_grad_(p.requires_grad)
        else:
            out[name] = p
    return out, layouts


def as_dtensors(state: dict[str, torch.Tensor], layouts: dict) -> dict[str, torch.Tensor]:
    """`state` with each local shard named in `layouts` wrapped as its DTensor again
    (`DTensor.from_local`, differentiable: the gradient flows to the local shard)."""
    if not layouts:
        return state
    from torch.distributed.tensor import DTensor
    out = dict(state)
    for name, (mesh, placements, shape, stride) in layouts.items():
        out[name] = DTensor.from_local(state[name], mesh, placements, run_check=False,
                                       shape=shape, stride=stride)
    return out
