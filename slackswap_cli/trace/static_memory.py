"""The torch side of `slackswap fit`: the facts of a model's parameters, and each batch profiled.

`model_facts` reads what `fit.static_memory` needs from a built model (real or fake tensors:
shapes, dtypes and storages are all it looks at): every Parameter once (as
`model.parameters()` yields them, so a weight tied by sharing one Parameter is one), the bytes
of each storage once (two Parameters viewing one storage count it once), whether it trains,
the repeated block it belongs to (a child of an `nn.ModuleList`, what FSDP2 is applied to),
the buffers' bytes and the input tensors' bytes.

`Profiler` profiles the workload at each batch of the sweep (`--batch-arg` set to the batch)
and reads the facts of the model it built on the way (`profile_workload(on_load=...)`), so the
model is built once per batch; `on_facts(facts)` may refuse them before the trace starts.
"""
from __future__ import annotations

import inspect
from pathlib import Path
from typing import Callable

import torch
import torch.utils._pytree as pytree
from torch.multiprocessing.reductions import StorageWeakRef

from ..errors import InputError
from ..fit import ModelFacts, ParamFact


def _blocks(model: torch.nn.Module) -> list[str]:
    """The repeated blocks: the children of every ModuleList with more than one child."""
    out = []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.ModuleList) and len(mod) > 1:
            out.extend(f"{name}.{i}" if name else str(i) for i in range(len(mod)))
    return out


def _block_of(name: str, blocks: list[str]) -> str | None:
    hits = [b for b in blocks if name.startswith(b + ".")]
    return max(hits, key=len) if hits else None


def _storage_bytes(t: torch.Tensor, seen: set) -> int:
    """The bytes of `t`'s storage the first time it is seen, else 0."""
    ref = StorageWeakRef(t.untyped_storage())
    if ref in seen:
        return 0
    seen.add(ref)
    return t.untyped_storage().nbytes()


def model_facts(model: torch.nn.Module, inputs=None) -> ModelFacts:
    blocks = _blocks(model)
    seen: set = set()
    params = []
    for name, p in model.named_parameters():
        params.append(ParamFact(numel=p.numel(), itemsize=p.element_size(),
                                dim0=p.shape[0] if p.dim() else None,
                                trainable=p.requires_grad, storage_bytes=_storage_bytes(p, seen),
                                block=_block_of(name, blocks)))
    buffers = sum(_storage_bytes(b, seen) for b in model.buffers())
    leaves = [x for x in pytree.tree_leaves(inputs) if isinstance(x, torch.Tensor)]
    inputs_bytes = sum(_storage_bytes(x, seen) for x in leaves)
    return ModelFacts(params=tuple(params), buffers_bytes=buffers, inputs_bytes=inputs_bytes)


def check_batch_arg(path: str, entry: str, batch_arg: str) -> None:
    """InputError unless the workload's entry function takes `batch_arg`."""
    from .workload import _import_file
    fn = getattr(_import_file(Path(path)), entry, None)
    if fn is None or not callable(fn):
        return                      # profiling says what is missing, with its own hint
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    params = sig.parameters.values()
    if batch_arg in sig.parameters or any(p.kind is p.VAR_KEYWORD for p in params):
        return
    raise InputError(f"{entry}() in {Path(path).name} takes no argument '{batch_arg}' to set "
                     "the batch size",
                     hint=f"name the argument that sets the batch with --batch-arg NAME "
                          f"({entry}{sig}), or add a `{batch_arg}` argument")


class Profiler:
    """`profiler(batch)` -> (profile, facts) of the workload at that batch (see the docstring)."""

    def __init__(self, path: str, *, entry: str, args: dict, batch_arg: str, device: str,
                 hardware, progress: Callable[[str], None] | None = None,
                 on_facts: Callable[[ModelFacts], None] | None = None):
        self.path, self.entry, self.args, self.batch_arg = path, entry, dict(args), batch_arg
        self.device, self.hardware, self.progress = device, hardware, progress
        self.on_facts = on_facts

    def _read(self, work, facts: list) -> None:
        facts.append(model_facts(work.model, work.inputs))
        if self.on_facts is not None:      # may refuse the model before it is traced
            self.on_facts(facts[0])

    def __call__(self, batch: int):
        from . import profile_workload
        facts = []
        prof = profile_workload(self.path, entry=self.entry,
                                args={**self.args, self.batch_arg: batch}, device=self.device,
                                hardware=self.hardware, progress=self.progress,
                                on_load=lambda work: self._read(work, facts))
        return prof, facts[0]
