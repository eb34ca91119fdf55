"""The bytes a step's own ops keep alive, measured apart from slackswap's count."""
from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["AliveStorages"]


class AliveStorages(TorchDispatchMode):
    """Every storage the ops under it make, weakly: after a forward, `held` is the bytes still
    alive (what autograd, the checkpoints and the patch hold for backward)."""

    def __init__(self):
        super().__init__()
        self.refs = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                ref = StorageWeakRef(t.untyped_storage())
                self.refs[ref.cdata] = (ref, t.untyped_storage().nbytes())
        return out

    def held(self, out, model, x) -> int:
        """The bytes alive of what the ops made, less `out`, `x` and the model's parameters
        and buffers."""
        skip = {t.untyped_storage()._cdata for t in [out, x, *model.parameters(),
                                                       *model.buffers()]}
        return sum(n for k, (r, n) in self.refs.items() if not r.expired() and k not in skip)
