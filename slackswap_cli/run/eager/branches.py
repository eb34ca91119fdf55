"""A fake trace that takes the branches the eager run took.

A library may branch on "am I being traced?": Hugging Face transformers asks whether a tensor is
a `FakeTensor` (`transformers.utils.import_utils.is_fake_tensor`) and, when it is, skips the
questions it would ask of the values (is there any padding? are sequences packed?) and takes
the general branch: it builds an attention mask and repeats grouped-query keys and values. In
eager, with no padding, it asks, gets "no", and calls attention with neither. A profile traced
with fake tensors then lists ops the eager step never runs, and misses the ones it does.

The first eager call at a signature (`first_call.FirstCall`) notes every value Python read of a
tensor (`aten._local_scalar_dense`: `bool(t)`, `t.item()`, in order). `eager_branches` traces a
fake copy of the model with those answers: libraries are told their tensors are not fake (for
the trace only, undone after it, even on an exception), and each value read is answered with
the value eager read at the same point, so the trace follows eager's branches. Should the
trace read more values than eager did, or of another kind, the branches differ after all:
`BranchesDiffer`, and the caller keeps the plan it has.

Private torch API used: `torch.utils._python_dispatch.TorchDispatchMode` (as the recorder).
"""
from __future__ import annotations

import contextlib
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["LOCAL_SCALAR", "BranchesDiffer", "eager_branches"]

LOCAL_SCALAR = torch.ops.aten._local_scalar_dense.default
# libraries that ask whether a tensor is fake, and where they ask it: (module, function)
_ASKS_IF_FAKE = (("transformers.utils.import_utils", "is_fake_tensor"),)


class BranchesDiffer(RuntimeError):
    """The fake trace read values eager did not (another branch after all)."""


class _Answers(TorchDispatchMode):
    """Answers each value read (`_local_scalar_dense`) with eager's, in order."""

    def __init__(self, values: list):
        super().__init__()
        self.values, self.i = values, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is not LOCAL_SCALAR:
            return func(*args, **(kwargs or {}))
        if self.i >= len(self.values):
            raise BranchesDiffer("the trace read more values than the eager call did")
        got = self.values[self.i]
        self.i += 1
        want = bool if args[0].dtype == torch.bool else (
            float if args[0].dtype.is_floating_point else int)
        if type(got) is not want:
            raise BranchesDiffer(f"value {self.i}: eager read a {type(got).__name__}, the trace "
                                 f"a {want.__name__}")
        return got


@contextlib.contextmanager
def _not_fake_to_libraries():
    saved = []
    try:
        for module, name in _ASKS_IF_FAKE:
            mod = sys.modules.get(module)
            if mod is not None and hasattr(mod, name):
                saved.append((mod, name, getattr(mod, name)))
                setattr(mod, name, lambda x: False)
        yield
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)


@contextlib.contextmanager
def eager_branches(shadow: torch.nn.Module, values: list):
    """Within: `shadow` (a fake copy of the model) forwards along the branches of the eager
    call that read `values`. Raises `BranchesDiffer` at exit if the trace read fewer."""
    forward = type(shadow).forward
    answers = _Answers(list(values))

    def answered(*args, **kwargs):
        with answers:
            return forward(shadow, *args, **kwargs)
    shadow.forward = answered
    try:
        with _not_fake_to_libraries():
            yield
    finally:
        del shadow.forward
    if answers.i != len(answers.values):
        raise BranchesDiffer(f"the trace read {answers.i} of the eager call's "
                             f"{len(answers.values)} values")
