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
import multiprocessing
import os
from pathlib import Path
from typing import Callable

import torch
import torch.utils._pytree as pytree

from ..errors import InputError, SlackswapError
from ..fit import ModelFacts, ParamFact
from . import profile_workload
from .storage import storage_nbytes, storage_object_key
from .workload import import_file


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
    key = storage_object_key(t)       # (the model's tensors live while this counts)
    if key in seen:
        return 0
    seen.add(key)
    return storage_nbytes(t)


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
    fn = getattr(import_file(Path(path)), entry, None)
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
    """`profiler(batch)` -> (profile, facts) of the workload at that batch (see the docstring).

    With `workers` > 1 (and fork available) it also has `submit(batch)`: the same call in a
    forked child process (`_Traced`), so `fit.profiles` traces the next batches while this
    process plans the last one; at most two traces are in flight there. `close()` stops the
    children still running (a sweep ended by an error). A child that cannot run autograd
    (torch refuses autograd in a fork of a process whose autograd engine started device
    threads: on a CUDA build without a GPU, torch 2.15, any backward after a FakeTensorMode
    was entered) is traced again here, and later batches are traced here too."""

    def __init__(self, path: str, *, entry: str, args: dict, batch_arg: str, device: str,
                 hardware, progress: Callable[[str], None] | None = None,
                 on_facts: Callable[[ModelFacts], None] | None = None, workers: int = 1):
        self.path, self.entry, self.args, self.batch_arg = path, entry, dict(args), batch_arg
        self.device, self.hardware, self.progress = device, hardware, progress
        self.on_facts = on_facts
        self.children: list[_Traced] = []
        self.fork_failed = False
        fork = "fork" in multiprocessing.get_all_start_methods()
        self.submit = self._submit if workers > 1 and fork else None

    def _read(self, work, facts: list) -> None:
        facts.append(model_facts(work.model, work.inputs))
        if self.on_facts is not None:      # may refuse the model before it is traced
            self.on_facts(facts[0])

    def __call__(self, batch: int):
        facts = []
        prof = profile_workload(self.path, entry=self.entry,
                                args={**self.args, self.batch_arg: batch}, device=self.device,
                                hardware=self.hardware, progress=self.progress,
                                on_load=lambda work: self._read(work, facts))
        return prof, facts[0]

    def _submit(self, batch: int) -> "_Traced | _Here":
        if self.fork_failed:
            return _Here(self, batch)
        child = _Traced(self, batch)
        self.children.append(child)
        return child

    def close(self) -> None:
        for child in self.children:
            child.stop()


# in torch's error when autograd runs in a forked child it cannot run in
_AUTOGRAD_FORK = "Autograd-and-Fork"


class _Here:
    """`profiler(batch)` run in this process when `result()` is called (forks fail here)."""

    def __init__(self, profiler: Profiler, batch: int):
        self.profiler, self.batch = profiler, batch

    def result(self):
        return self.profiler(self.batch)

    def stop(self) -> None:
        pass


class _Traced:
    """`profiler(batch)` running in a forked child; `result()` returns what it returned or
    raises what it raised (an error that does not pickle comes back as a SlackswapError with
    the same "Type: message" text `fit.profiles` would have written). Where torch refused
    autograd in the child, the batch is traced in this process instead."""

    def __init__(self, profiler: Profiler, batch: int):
        self.profiler, self.batch = profiler, batch
        ctx = multiprocessing.get_context("fork")
        self.recv, send = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=_child, args=(profiler, batch, send), daemon=True)
        self.proc.start()
        send.close()

    def result(self):
        try:
            ok, value = self.recv.recv()
        except EOFError:
            self.proc.join()
            raise SlackswapError(f"the tracing process ended with exit code "
                                 f"{self.proc.exitcode} (out of memory?)") from None
        self.proc.join()
        if not ok and _AUTOGRAD_FORK in str(value):
            self.profiler.fork_failed = True
            return self.profiler(self.batch)
        if not ok:
            raise value
        return value

    def stop(self) -> None:
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join()


def _child(profiler: Profiler, batch: int, send) -> None:
    try:
        out = (True, profiler(batch))
    except BaseException as exc:
        out = (False, exc)
    try:
        send.send(out)
    except Exception:
        exc = out[1]
        why = exc.message if isinstance(exc, SlackswapError) else f"{type(exc).__name__}: {exc}"
        send.send((False, SlackswapError(why)))
    send.close()
    os._exit(0)
