"""What slackswap needs to know about aten ops' aliasing and writes: one place, used by the
profile (`graph_profile`), the written-out step (`run/written/code.py`), the in-place patch
(`run/eager/first_call.py`) and the compiled plan (`run/compiled/graph_plan.py`).

- a *view* returns an alias of its input without writing it: the schema says so
  (`view`, `t`, `split`, `detach`, ...), or it is one of the views the schema does not declare
  (`UNDECLARED_VIEWS`);
- an *in-place* op writes its first argument and returns it (`relu_`, `bernoulli_`): the
  schema's `a!` (`is_inplace`; `is_inplace_target` for a profile's target name, which the
  torch-free `chains.runtime_table` is handed); BatchNorm in training also writes its running statistics without declaring it
  (`HIDDEN_WRITES`), which a re-run must send to a throwaway copy.
"""
from __future__ import annotations

import functools

# Views the schema does not declare as aliasing (autograd-invisible views), by overload packet.
UNDECLARED_VIEWS = {"_unsafe_view", "_reshape_alias", "_reshape_copy_alias"}
# Ops that update BatchNorm running statistics in place without declaring it in their schema:
# overload packet name -> positions of the mutated arguments.
HIDDEN_WRITES = {"native_batch_norm": (3, 4), "cudnn_batch_norm": (3, 4),
                 "miopen_batch_norm": (3, 4), "_native_batch_norm_legit": (3, 4),
                 "_batch_norm_with_update": (3, 4)}


def packet_name(target) -> str:
    packet = getattr(target, "overloadpacket", None)
    return packet.__name__ if packet is not None else ""


def _first_return_alias(target):
    schema = getattr(target, "_schema", None)
    if schema is None or not schema.returns:
        return None
    return schema.returns[0].alias_info


def returns_view(target) -> bool:
    """The op's first result is a view of an input (declared or not), not an in-place write."""
    info = _first_return_alias(target)
    return (info is not None and not info.is_write) or packet_name(target) in UNDECLARED_VIEWS


def writes_first(target) -> bool:
    """The op writes an argument in place and returns it."""
    info = _first_return_alias(target)
    return info is not None and info.is_write


def aliases_input(target) -> bool:
    """A view or an in-place op: its first result shares an input's storage."""
    return _first_return_alias(target) is not None or packet_name(target) in UNDECLARED_VIEWS


def is_inplace(target) -> bool:
    """An in-place op: it writes its first argument and returns it (`relu_`, `add_`,
    `bernoulli_`; not an `out=` variant, which writes another argument)."""
    schema = getattr(target, "_schema", None)
    if schema is None or not schema.arguments:
        return False
    info = schema.arguments[0].alias_info
    return info is not None and info.is_write and aliases_input(target)


@functools.lru_cache(maxsize=None)
def _overload(target: str):
    """The `torch.ops.aten` overload a profile op's target name ("aten.add_.Tensor") names, or
    None for anything else (ONNX ops, `getitem`)."""
    import torch  # only here: run/compiled/graph_plan.py and run/emit.py import this module torch-free
    parts = target.split(".")
    if len(parts) != 3 or parts[0] != "aten":
        return None
    try:
        return getattr(getattr(torch.ops.aten, parts[1]), parts[2])
    except (AttributeError, RuntimeError):
        return None


def is_inplace_target(target: str) -> bool:
    """`is_inplace` of a profile op's target name ("aten.add_.Tensor"); False for anything
    else. The torch-free `chains.runtime_table` takes it as its in-place test."""
    overload = _overload(target)
    return overload is not None and is_inplace(overload)


@functools.lru_cache(maxsize=None)
def is_view_target(target: str) -> bool:
    """`returns_view` of a profile op's target name; False for anything else."""
    overload = _overload(target)
    return overload is not None and returns_view(overload)


@functools.lru_cache(maxsize=None)
def written_returns(target) -> frozenset:
    """Positions of results that are arguments written in place."""
    schema = getattr(target, "_schema", None)
    if schema is None:
        return frozenset()
    return frozenset(j for j, r in enumerate(schema.returns)
                     if r.alias_info is not None and r.alias_info.is_write)


def written_positions(target, args, is_tensor) -> list[int]:
    """Positions of the arguments a call writes in place (schema `a!`, plus BatchNorm's hidden
    writes in training): `args` as the op gets them, `is_tensor(arg)` telling which are
    tensors (graph nodes in a graph, tensors in a recorded eager call)."""
    schema = getattr(target, "_schema", None)
    out = []
    if schema is not None:
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write and i < len(args):
                out.append(i)
    packet = packet_name(target)
    if packet in HIDDEN_WRITES:
        training = args[5] if len(args) > 5 else True
        if training:
            out += [i for i in HIDDEN_WRITES[packet] if i < len(args) and is_tensor(args[i])]
    return out
