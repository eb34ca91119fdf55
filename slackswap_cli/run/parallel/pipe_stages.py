"""A model split by torch's `pipeline()` (`pipe_split()` or a `split_spec` of SplitPoints): its
stage modules, each with one microbatch's inputs, as `plan_pipeline` plans stages.

`pipeline(module, mb_args, split_spec=...)` traces the model with torch.export and splits the
graph: stage i is `pipe.get_stage_module(i)`, an fx GraphModule whose inputs are the values
the stages before it send (flattened: one positional argument per tensor) and which
`pipe.build_stage(i, device)` wraps. What each stage receives is read by running the pipe once
on one microbatch (its forward only, no gradient), a hook on each stage module keeping its
arguments (the buffers' values and the random generators are restored after it, as after a
profile); a received float tensor then takes a gradient, as the stage's receive buffer does
(`_PipelineStage` makes every floating received activation `requires_grad`).

    stages = pipe_stages(pipe, (x_mb,), loss_fn=loss_fn, target=y_mb)
    # {0: (submod_0, (x_mb,), None), 1: (submod_1, (h,), loss on y_mb)}

`plan_pipeline(pipe, ..., inputs=(x_mb,), loss_fn=loss_fn, target=y_mb)` does this itself.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

from ...errors import InputError
from .. import api

__all__ = ["is_pipe", "pipe_stages", "check_stage_count"]


def is_pipe(obj) -> bool:
    """Whether `obj` is what torch's `pipeline()` returns (a `Pipe`)."""
    try:
        from torch.distributed.pipelining import Pipe
    except ImportError:                                    # pragma: no cover - no distributed
        return False
    return isinstance(obj, Pipe)


def check_stage_count(pipe, n_stages: int, schedule, pp: int) -> None:
    """Refuse a pipe whose stage count is not the schedule's (pp ranks x stages per rank)."""
    if pipe.num_stages != n_stages:
        name = schedule if isinstance(schedule, str) else getattr(schedule, "__name__", schedule)
        raise InputError(f"the pipe has {pipe.num_stages} stages, but {name} on pp={pp} ranks "
                         f"runs {n_stages}",
                         hint=_stage_count_hint(pipe.num_stages, n_stages, pp))


def _stage_count_hint(have: int, runs: int, pp: int) -> str:
    """What to pass for a pipe of `have` stages where the schedule on `pp` ranks runs `runs`:
    a one-stage schedule where there is one stage a rank, else a multi-stage schedule with
    the stages a rank that split gives (torch's multi-stage schedules run 2 or more)."""
    split = "or split the model into as many stages as the schedule runs"
    if have == pp:
        return f"schedule='1F1B' (or 'GPipe'): one stage per rank; {split}"
    if have % pp == 0 and have // pp >= 2:
        return (f"stages_per_rank={have // pp} with a multi-stage schedule "
                f"(Interleaved1F1B, LoopedBFS); {split}")
    return f"pp={have} with schedule='1F1B' (one stage per rank); {split}"


def _root_placeholders(pipe) -> list:
    return [n for n in pipe.split_gm.graph.nodes if n.op == "placeholder"]


def _check_microbatch(pipe, args: tuple, kwargs: dict) -> None:
    """The inputs must be one microbatch's, as the pipe was traced at (torch.export writes
    the traced shapes into the stages' code: a view to (2, 16, 2, 16) fails or misreads at
    another batch)."""
    given = [*args, *kwargs.values()]
    for node, value in zip(_root_placeholders(pipe), given):
        traced = node.meta.get("val")
        if not (isinstance(value, torch.Tensor) and isinstance(traced, torch.Tensor)):
            continue
        if tuple(value.shape) != tuple(traced.shape) or value.dtype != traced.dtype:
            raise InputError(
                f"inputs: {node.name} is {tuple(value.shape)} {value.dtype}, but the pipe was "
                f"traced at {tuple(traced.shape)} {traced.dtype}",
                hint="pass one microbatch's inputs, shaped as the mb_args given to pipeline() "
                     "(e.g. x[:batch // microbatches])")


def _as_call(inputs) -> tuple[tuple, dict]:
    if isinstance(inputs, torch.Tensor):
        return (inputs,), {}
    if isinstance(inputs, tuple):
        return inputs, {}
    if isinstance(inputs, dict):
        return (), dict(inputs)
    raise InputError(f"inputs: expected one microbatch's inputs (a tuple of positional "
                     f"arguments, a dict of keyword arguments or a tensor), got "
                     f"{type(inputs).__name__}",
                     hint="plan_pipeline(pipe, ..., inputs=(x_mb,)): the mb_args given to "
                          "pipeline()")


def _received(value):
    """A value as the stage's receive buffer holds it: a float tensor takes a gradient."""
    if isinstance(value, torch.Tensor):
        return value.detach().requires_grad_(value.is_floating_point())
    return value


def _captured_inputs(pipe, args: tuple, kwargs: dict) -> dict[int, tuple[tuple, dict]]:
    """Each stage's (args, kwargs) in one run of the pipe's forward, without gradients."""
    seen: dict[int, tuple[tuple, dict]] = {}
    hooks = []
    for i in range(pipe.num_stages):
        def keep(_mod, a, k, i=i):
            seen[i] = (a, k)
        hooks.append(pipe.get_stage_module(i).register_forward_pre_hook(keep, with_kwargs=True))
    try:
        with torch.no_grad(), api.left_untouched(pipe.split_gm):   # buffers and generators as they were
            pipe(*args, **kwargs)
    except Exception as exc:
        raise InputError(f"the pipe's forward failed on the inputs given: "
                         f"{type(exc).__name__}: {str(exc).splitlines()[0]}",
                         hint="pass one microbatch's inputs, as given to pipeline()") from None
    finally:
        for h in hooks:
            h.remove()
    return seen


def _stage_inputs(index: int, call: tuple[tuple, dict]):
    a, k = call
    if k and a:
        raise InputError(f"stage {index} is called with positional and keyword arguments, "
                         "which plan_pipeline cannot trace together",
                         hint="pass the model's inputs positionally to pipeline() and "
                              "plan_pipeline")
    if index == 0:
        return dict(k) if k else tuple(a)
    return {n: _received(v) for n, v in k.items()} if k else tuple(_received(v) for v in a)


def pipe_stages(pipe, inputs, *, loss_fn: Callable | None = None, target: Any = None,
                stages: Iterable[int] | None = None) -> dict[int, tuple]:
    """stage index -> (stage module, its inputs for one microbatch, its loss or None) for the
    stages of `pipe` (all, or `stages`), as `plan_pipeline` takes them. `inputs`: one
    microbatch's inputs to the whole model (the `mb_args` given to `pipeline()`); `loss_fn`:
    the schedule's `loss_fn(output, target)`, with `target` one microbatch's target, for the
    last stage (None: the last stage's output is summed, a stand-in)."""
    if not is_pipe(pipe):
        raise InputError(f"{type(pipe).__name__} is not a pipe from torch's pipeline()",
                         hint="pipe = torch.distributed.pipelining.pipeline(model, mb_args, "
                              "split_spec=...)")
    if target is not None and loss_fn is None:
        raise InputError("a target was given but no loss_fn",
                         hint="pass the schedule's loss_fn(output, target) too")
    args, kwargs = _as_call(inputs)
    _check_microbatch(pipe, args, kwargs)
    wanted = sorted(range(pipe.num_stages) if stages is None else set(stages))
    bad = [s for s in wanted if not 0 <= s < pipe.num_stages]
    if bad:
        raise InputError(f"stages {bad} are not in a pipe of {pipe.num_stages} stages",
                         hint=f"stages from 0 to {pipe.num_stages - 1}")
    seen = _captured_inputs(pipe, args, kwargs)
    last = pipe.num_stages - 1
    out = {}
    for s in wanted:
        loss = None
        if s == last and loss_fn is not None:
            def loss(output, _inputs, loss_fn=loss_fn, target=target):
                return loss_fn(output, target)
        out[s] = (pipe.get_stage_module(s), _stage_inputs(s, seen[s]), loss)
    return out
