"""Storage identity, in one place: which tensors share memory, and how much memory that is.

Two keys, for two kinds of tensor:

- `storage_key(t)`: the memory of a real tensor, (device type, device index, address). Views
  share it. An address can be reused once its storage is freed, so code that keeps keys across
  frees also holds a weak reference to tell (`storage_id`; `run/swap.py`'s `Storages`).
- `storage_object_key(t)`: the storage object itself (`UntypedStorage._cdata`, a private torch
  API: torch_api.py), for fake and meta tensors, whose storages have no address but are
  distinct objects (a view's is its base's); valid while the storage lives.

`storage_nbytes(t)`: the bytes of the storage under `t` (what allocating it costs).
"""
from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = ["storage_key", "storage_object_key", "storage_id", "storage_nbytes"]


def storage_key(t: torch.Tensor) -> tuple:
    """Identity of the memory behind real tensor `t` (views share it)."""
    return (t.device.type, t.device.index, t.untyped_storage().data_ptr())


def storage_object_key(t: torch.Tensor) -> int:
    """Identity of the storage object behind `t` (fake, meta or real), while it lives."""
    return t.untyped_storage()._cdata


def storage_id(t: torch.Tensor) -> tuple:
    """(address key, weak reference) of real tensor `t`'s storage: the key finds it, the
    reference tells whether it is still the same storage."""
    return storage_key(t), StorageWeakRef(t.untyped_storage())


def storage_nbytes(t: torch.Tensor) -> int:
    """Bytes of the storage under `t`; numel x itemsize where a tensor has no storage to ask."""
    try:
        return int(t.untyped_storage().nbytes())
    except Exception:
        return int(t.numel()) * t.element_size()
