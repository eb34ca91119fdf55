"""Pipeline parallelism from torch's schedules: each rank's order of actions, and a plan per
stage (the arithmetic is the torch-free `slackswap_cli.pipeline.stages`).

    order = schedule_order("1F1B", pp=4, microbatches=8)      # no process group needed
    held_microbatches(order)                                   # {0: 4, 1: 3, 2: 2, 3: 1}
    planned = plan_pipeline({0: (stage0, (x0,), loss0), 1: (stage1, (x1,), loss1)},
                            "1F1B", pp=2, microbatches=8, budget="2GiB")
    planned.patch({0: stage0})                                 # on rank 0, before PipelineStage

Where the order comes from: a schedule that torch runs from its `pipeline_order`
(`_PipelineScheduleRuntime`: Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble,
DualPipeV) is read from it, built without a process group as torch's schedule visualizer does
(stages mocked). The two single-stage schedules run their own loop instead
(`_step_microbatches`): GPipe's representation is what that loop runs (every forward, then
every backward); 1F1B's is not on the last rank (its `_get_pipeline_order` numbers that rank's
forwards from 1, holding 2 where the loop, forward then backward, holds 1), so 1F1B's order is
written here from the loop: `min(microbatches, pp - rank)` forwards, then one backward and one
forward in turn, then the remaining backwards. An OVERLAP_F_B action runs its sub-actions in
their order; communication, FSDP and gradient-reduction actions hold no activations.

A stage is planned as a model whose loss is `loss_fn(out, inputs)`: the last stage's real
loss, a stand-in (`out.sum()`) on the others, whose backward saves the same tensors as the
gradient a pipeline sends back does. The stage's inputs are traced as given (an intermediate
stage's input should `requires_grad`, as PipelineStage's received inputs do).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from ...budget import parse_budget
from ...errors import InputError
from ...pipeline.orders import one_f_one_b
from ...pipeline.stages import (
    PipelinePlan,
    Step,
    boundary_bytes,
    format_rows,
    held_microbatches,
    output_held,
    plan_stages,
    recv_buffer_bytes,
)
from ...pipeline.step import buffers_of
from ...planning import plan_inputs, plan_profile
from .. import api
from ..verify.excess import settle_stages
from .pipe_stages import check_stage_count, is_pipe, pipe_stages
from .split_backward import split_held_bytes

__all__ = ["schedule_order", "held_microbatches", "plan_pipeline", "PlannedPipeline"]

_COMPUTE = {"F": "F", "B": "B", "I": "I", "W": "W"}


def _schedule_class(schedule):
    from torch.distributed.pipelining.schedules import _PipelineSchedule, get_schedule_class
    if isinstance(schedule, str):
        try:
            return get_schedule_class(schedule)
        except ValueError as exc:
            raise InputError(f"torch has no pipeline schedule {schedule!r}: {exc}",
                             hint="one of GPipe, 1F1B, Interleaved1F1B, LoopedBFS, "
                                  "InterleavedZeroBubble, ZBVZeroBubble, DualPipeV") from None
    if isinstance(schedule, type) and issubclass(schedule, _PipelineSchedule):
        return schedule
    if isinstance(schedule, _PipelineSchedule):
        return type(schedule)
    raise InputError(f"{schedule!r} is not a pipeline schedule",
                     hint="pass a schedule name ('1F1B'), class or instance")


def _steps(actions) -> tuple[Step, ...]:
    out: list[Step] = []
    for a in actions:
        if a is None:
            continue
        for sub in (a.sub_actions or (a,)):
            kind = _COMPUTE.get(sub.computation_type.value)
            if kind is not None:
                out.append((kind, sub.stage_index, sub.microbatch_index))
    return tuple(out)


def _holds_least(schedule) -> bool:
    """Whether `schedule` is 1F1B (or built on it): no one-stage schedule holds fewer."""
    from torch.distributed.pipelining.schedules import Schedule1F1B
    return issubclass(_schedule_class(schedule), Schedule1F1B)


def schedule_order(schedule, pp: int, microbatches: int,
                   stages_per_rank: int | None = None) -> dict[int, tuple[Step, ...]]:
    """rank -> its compute steps (kind, stage, microbatch) in the order the schedule runs
    them. `schedule`: a name as torch's `get_schedule_class` takes it, a class or an
    instance; `stages_per_rank`: for the multi-stage schedules (default 2)."""
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, Schedule1F1B
    cls = _schedule_class(schedule)
    if pp < 1 or microbatches < 1:
        raise InputError(f"pp={pp} and microbatches={microbatches}: both must be at least 1",
                         hint="pp: the pipeline ranks; microbatches: per step")
    if issubclass(cls, Schedule1F1B):
        if microbatches < pp:        # (torch's Schedule1F1B refuses it when it is built)
            raise InputError(f"torch's {cls.__name__} needs at least as many microbatches "
                             f"as stages: microbatches={microbatches} on pp={pp}",
                             hint=f"microbatches={pp} or more (a batch split finer), or "
                                  "schedule='GPipe'")
        return one_f_one_b(pp, microbatches)    # torch's action list holds more: the test pins it
    single = issubclass(cls, PipelineScheduleSingle)
    try:
        ops = get_schedule_ops(cls, pp, microbatches,
                               num_stages_per_rank=1 if single else stages_per_rank)
    except (ValueError, AssertionError, RuntimeError) as exc:
        raise InputError(f"torch's {cls.__name__} with pp={pp}, microbatches={microbatches}"
                         f"{'' if single else f', stages_per_rank={stages_per_rank}'}: {exc}",
                         hint="the schedule's own constraints apply (e.g. microbatches a "
                              "multiple of pp for the interleaved schedules)") from None
    return {rank: _steps(actions) for rank, actions in enumerate(ops)}


def sends_kept(schedule) -> str:
    """How long `schedule` keeps what it sends (`slackswap_cli.pipeline.stages.SENDS`): torch's
    `_PipelineScheduleRuntime` waits for its sends when the step ends, GPipe for its backward
    sends after the last backward, 1F1B for each before the next."""
    from torch.distributed.pipelining.schedules import (
        Schedule1F1B,
        ScheduleGPipe,
        _PipelineScheduleRuntime,
    )
    cls = _schedule_class(schedule)
    if issubclass(cls, _PipelineScheduleRuntime):
        return "runtime"
    if issubclass(cls, ScheduleGPipe):
        return "gpipe"
    if issubclass(cls, Schedule1F1B):
        return "none"
    raise InputError(f"{cls.__name__}: how long it keeps what it sends is not known here",
                     hint="use GPipe, 1F1B or a schedule torch runs from its action list "
                          "(Interleaved1F1B, ZBVZeroBubble, DualPipeV, ...)")


def stage_buffers(version: str | None = None) -> str:
    """How this torch's PipelineStage holds its buffers (`slackswap_cli.pipeline.stages.BUFFERS`):
    from 2.15 on, "per-step" (each receive allocates its buffer in every step,
    `_RecvInfo.allocate_buffer`; a sent output is dropped once its send is waited,
    `release_fwd_send_outputs`); before, "reused" (buffers allocated once, outputs kept to
    their backward). `version`: torch's, as `torch.__version__` writes it (the rule:
    `pipeline.step.buffers_of`)."""
    return buffers_of(version or torch.__version__)


StageSpec = tuple  # (module, inputs, loss_fn or None)


@dataclass
class PlannedPipeline:
    """What `plan_pipeline` returns: per stage index the `api.Plan` (None: the stage keeps
    everything), per rank its row (`table.rows`) and the order read from the schedule."""
    plans: dict[int, Any]
    table: PipelinePlan
    profiles: dict[int, Any]           # stage index -> its Profile (one microbatch)

    @property
    def rows(self):
        return self.table.rows

    def __str__(self) -> str:
        return format_rows(self.table.rows)

    @property
    def held(self) -> dict[int, int]:
        return {row.rank: row.held for row in self.table.rows}

    def patch(self, modules) -> None:
        """Patch each given stage module (stage index -> module: the ones on this rank) with
        its plan; a stage that keeps everything is left as it is. A pipe from `pipeline()`:
        the stage modules of the stages planned."""
        if is_pipe(modules):
            modules = {s: modules.get_stage_module(s) for s in self.plans}
        for stage, module in modules.items():
            if stage not in self.plans:
                raise InputError(f"stage {stage} was not planned",
                                 hint=f"planned stages: {sorted(self.plans)}")
            if self.plans[stage] is not None:
                api.patch(module, self.plans[stage])


def _stage_loss(out, inputs):
    return sum(t.float().sum() for t in torch.utils._pytree.tree_leaves(out)
               if isinstance(t, torch.Tensor) and t.requires_grad)


def _output_shapes(module: torch.nn.Module, inputs) -> list[tuple[tuple, int]]:
    """(shape, bytes) of each tensor of the stage's output for one microbatch, from a fake run
    (nothing allocated)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ..eager.replan import fake_copy
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    shadow = fake_copy(module, mode)
    args = inputs if isinstance(inputs, tuple) else (inputs,)
    fake = torch.utils._pytree.tree_map(
        lambda x: mode.from_tensor(x) if isinstance(x, torch.Tensor) else x, args)
    with mode, torch.no_grad():
        out = shadow(*fake)
    return [(tuple(t.shape), t.numel() * t.element_size())
            for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


def _output_roots(prof, outputs) -> frozenset:
    """The profile's activation roots that are the stage's output: read by the loss's ops (the
    forward ops after the stage module's last one, which belong to no module) and of an
    output's size (a root may be the output before a view)."""
    fwd = prof.ops[:prof.n_forward]
    last = max((op.id for op in fwd if op.module), default=-1)
    sizes = {n for _, n in outputs}
    roots = set()
    for op in fwd[last + 1:]:
        for tid in op.inputs:
            t = prof.tensors[prof.root(tid)]
            if t.kind == "activation" and t.producer is not None and t.producer <= last \
                    and t.size_bytes in sizes:
                roots.add(t.id)
    return frozenset(roots)


def _grad_bytes(inputs) -> int:
    """Bytes of the inputs that take a gradient (what a stage sends back per microbatch)."""
    return sum(t.numel() * t.element_size() for t in torch.utils._pytree.tree_leaves(inputs)
               if isinstance(t, torch.Tensor) and t.requires_grad)


def _stage_specs(stages, full, schedule, pp, ranks, inputs, loss_fn, target):
    """The stages as plan_pipeline plans them: given by hand, or read from a `pipeline()`
    pipe (the stages of the ranks planned)."""
    if not is_pipe(stages):
        if inputs is not None or loss_fn is not None or target is not None:
            raise InputError("inputs, loss_fn and target are for a pipe from pipeline(); "
                             "stages given by hand carry their own",
                             hint="stages={index: (module, inputs, loss_fn or None)}")
        return stages
    check_stage_count(stages, 1 + max(s for steps in full.values() for _, s, _ in steps),
                      schedule, pp)
    if inputs is None:
        raise InputError("plan_pipeline(pipe, ...) needs one microbatch's inputs",
                         hint="plan_pipeline(pipe, ..., inputs=mb_args, loss_fn=loss_fn, "
                              "target=mb_target): mb_args as given to pipeline()")
    mine = {s for r, steps in full.items() if ranks is None or r in ranks for _, s, _ in steps}
    return pipe_stages(stages, inputs, loss_fn=loss_fn, target=target, stages=mine)


def _runs_every(stages, rank_of: dict, schedule, pp: int) -> None:
    """Refuse a stage index the schedule does not run."""
    extra = sorted(set(stages) - set(rank_of))
    if extra:
        name = getattr(_schedule_class(schedule), "__name__", schedule)
        raise InputError(f"stage(s) {extra} given, but {name} on pp={pp} runs stages "
                         f"0 to {max(rank_of)}",
                         hint=f"give stages 0 to {max(rank_of)} only (or a pp, "
                              "stages_per_rank or schedule that runs as many stages as "
                              "the model is split into)")


def _recv_bytes(order, microbatches: int, stages, outputs, n_stages: int) -> dict[int, int]:
    """rank -> its stages' receive buffers (`recv_buffer_bytes`): per microbatch, a stage's
    inputs (one microbatch's, as given) and its output's gradient (`outputs`)."""
    ins = {s: sum(t.numel() * t.element_size() for t in torch.utils._pytree.tree_leaves(spec[1])
                  if isinstance(t, torch.Tensor)) for s, spec in stages.items()}
    return recv_buffer_bytes(order, microbatches, ins,
                             {s: sum(n for _, n in o) for s, o in outputs.items()}, n_stages)


def _rank_bytes(budget, prof) -> int | float:
    """A rank's budget: bytes, or a fraction (0.5, "50%") of its keep-all peak, its held
    microbatches counted (`plan_stages` reads it per rank)."""
    size, fraction = parse_budget(budget, prof)
    return size if fraction is None else fraction


def plan_pipeline(stages: Mapping[int, StageSpec], schedule, *, pp: int, microbatches: int,
                  budget, stages_per_rank: int | None = None, hardware=None,
                  planner: str = "slackswap", device: str = "cpu", ranks=None,
                  progress: Callable[[str], None] | None = None,
                  measure: bool = True, inputs=None, loss_fn=None,
                  target=None) -> PlannedPipeline:
    """Profile each stage (stage index -> (module, one microbatch's inputs, loss_fn or None:
    `out.sum()`)) and plan it for its rank's budget knowing how many microbatches the
    schedule holds there. `budget`: per rank, a size ("2GiB", bytes), a fraction (0.5, "50%")
    of the rank's keep-all peak (its held microbatches of its stages and their boundary
    buffers), or a mapping rank -> either: the stages' receive buffers (`recv_buffer_bytes`,
    a row's `recv_bytes`) are taken off it, the rest is the activations'. `ranks`: plan only these ranks' stages (each rank its own, say:
    `ranks=[dist.get_rank()]`), the stages given those ranks run. `measure` (not on the fake
    device): run each planned stage's plan once on its inputs and plan again where eager
    peaks above the simulator (run/verify/excess.py: `eager_excess`, `settle_stages`). `stages` may
    be the pipe torch's `pipeline()` returns, with `inputs` one microbatch's inputs to the model
    and the schedule's `loss_fn(output, target)` with one microbatch's `target`
    (run/parallel/pipe_stages.py)."""
    order = schedule_order(schedule, pp, microbatches, stages_per_rank)
    full = order
    if ranks is not None:
        unknown = sorted(set(ranks) - set(order))
        if unknown:
            raise InputError(f"ranks {unknown} are not in a pipeline of {pp} ranks",
                             hint=f"ranks from 0 to {pp - 1}")
        order = {r: order[r] for r in ranks}
    stages = _stage_specs(stages, full, schedule, pp, ranks, inputs, loss_fn, target)
    profiles, traced, boundary, outputs = {}, {}, {}, {}
    hw = api.hardware_of(hardware)
    n_stages = 1 + max(s for steps in full.values() for _, s, _ in steps)
    rank_of = {s: r for r, steps in full.items() for _, s, _ in steps}
    _runs_every(stages, rank_of, schedule, pp)
    sends = sends_kept(schedule)
    for index, (module, inputs, loss_fn) in sorted(stages.items()):
        outputs[index] = _output_shapes(module, inputs)
        local = (rank_of.get(index - 1) == rank_of[index], rank_of.get(index + 1) == rank_of[index])
        boundary[index] = boundary_bytes(sum(n for _, n in outputs[index]), _grad_bytes(inputs),
                                         index == 0, index == n_stages - 1, sends, local,
                                         stage_buffers())
        loss_fn = loss_fn or _stage_loss
        work = api.checked_workload(module, inputs, loss_fn)
        how, target = api.where_traced(module, device)
        with api.left_untouched(module):
            prof, joint, tr = api.profile_step(work, how, target, hw, None, progress,
                                              time.perf_counter())
        prof, hw, _, _ = plan_inputs(prof, 1.0, hw, "plan_pipeline")
        profiles[index], traced[index] = prof, (joint, tr, loss_fn)
        pinned = _output_roots(prof, outputs[index])
        held = output_held(prof, pinned, sum(n for _, n in outputs[index]))
        split = (split_held_bytes(module, inputs, loss_fn, index == 0, index == n_stages - 1)
                 if any(k == "I" for steps in full.values() for k, _, _ in steps) else 0)
        boundary[index] = boundary[index]._replace(pinned=pinned, held=held, split=split)

    def planner_fn(prof, budget_bytes):
        return plan_profile(prof, hw, budget_bytes, None, planner)[0]

    some = next(iter(profiles.values()))
    per_rank = ({r: _rank_bytes(b, some) for r, b in budget.items()}
                if isinstance(budget, Mapping) else _rank_bytes(budget, some))
    # the receive buffers kept from step to step (torch 2.13, 2.14); torch 2.15 allocates
    # them each step, counted with each microbatch in the stage's boundary (`received`)
    kw = dict(fewer=None if _holds_least(schedule) else "1F1B",
              recv_bytes=(_recv_bytes(order, microbatches, stages, outputs, n_stages)
                          if stage_buffers() == "reused" else None))
    table = plan_stages(order, profiles, per_rank, planner_fn, boundary, **kw)
    plans = {s: (None if p is None else api.plan_of(profiles[s], p, *traced[s]))
             for s, p in table.plans.items()}
    if measure and not device.startswith("fake"):
        table, plans = settle_stages(stages, order, profiles, per_rank, planner_fn, boundary,
                                     table, plans, traced,
                                     lambda s, p: api.plan_of(profiles[s], p, *traced[s]), **kw)
    return PlannedPipeline(plans, table, profiles)

