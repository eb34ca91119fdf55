"""A pipeline's stages priced from their profiles: each rank's memory and the step's time
with the schedule's bubbles (`slackswap simulate --pp` and `show --pp`).

Each profile is one stage's, for one microbatch: one profile for every stage (a pipeline split
into equal stages, every stage priced as it), or one per stage (`stage_profiles`: the first
stage with its embeddings, the last with its head and loss, each priced as it is). Per rank:
the (chunk-)microbatches the schedule holds there (`pipeline.held_microbatches`), the
activation peak keeping everything and under the stages' plans (`stages.rank_peak`, with what
PipelineStage holds beyond the profile: `boundary_of`, a stage's input gradient the size of
the previous stage's output), the bytes swapped and recomputed per step.

The step's time: every rank runs its steps in the schedule's order, a forward of stage s
after the same microbatch's forward of stage s - 1, a backward after the same microbatch's
backward of stage s + 1 (`timeline`); a forward takes its stage profile's forward time, a
backward the rest of its plan's predicted step (its recomputes and stalls included), a split
backward's input pass and weight pass (ZBVZeroBubble, DualPipeV) half of it each, the previous stage's
backward waiting for the input pass. What a split backward holds from its input pass to its
weight pass beyond the saved activations (`Boundary.split`: the gradients its weight pass
starts from, measured on the stage module by `plan_pipeline`) is not in a profile, so not
counted here. How PipelineStage holds its buffers (`buffers`, one of `stages.BUFFERS`; the
torch the stages run on decides it, `buffers_of`): "reused" (torch 2.13, 2.14), each rank's
receive buffers (`recv_buffer_bytes`: a stage's input and its output's gradient, the profile's
output size, per microbatch) kept all step, counted against `--rank-budget` beside the
activation peak (a row's `recv_bytes` and `fits`); "per-step" (torch 2.15), each receive
buffer allocated in every step and held with its microbatch, a sent output dropped once its
send is waited (`boundary_bytes`: in the activation peak, a row's `recv_bytes` 0). Sends and
receives take no time here (on one node they are small against a stage's compute); a rank's
idle time (its bubbles) is the step's time less its own work.

Torch-free.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from ..errors import InputError
from ..schema import Plan, Profile
from .orders import order as schedule_steps
from .stages import (
    Boundary,
    RankRow,
    Step,
    boundary_bytes,
    held_microbatches,
    output_held,
    rank_peak,
    recv_buffer_bytes,
    stage_cost,
)

__all__ = ["SENDS_OF", "buffers_of", "output_roots", "output_bytes", "boundary_of", "stage_profiles",
           "boundaries", "timeline", "PipelineFigures", "pipeline_figures"]

SENDS_OF = {"GPipe": "gpipe", "1F1B": "none", "Interleaved1F1B": "runtime",
            "ZBVZeroBubble": "runtime", "DualPipeV": "runtime"}


def buffers_of(torch_version: str) -> str:
    """How PipelineStage holds its buffers under this torch (`stages.BUFFERS`, as torch's
    `__version__` writes it, "2.15.0+cpu"): "per-step" from 2.15 on, "reused" before."""
    try:
        major, minor = (int(x) for x in torch_version.split("+")[0].split(".")[:2])
    except ValueError:
        raise InputError(f"torch version {torch_version!r} is not MAJOR.MINOR[.PATCH]",
                         hint="give a version as torch writes it, e.g. 2.15.0") from None
    return "per-step" if (major, minor) >= (2, 15) else "reused"


def output_roots(prof: Profile) -> frozenset:
    """The stage's output in the profile: the activation roots made by a module's op and read
    by the loss (the forward ops after the last one of a module)."""
    fwd = prof.ops[:prof.n_forward]
    last = max((op.id for op in fwd if op.module), default=-1)
    roots = set()
    for op in fwd[last + 1:]:
        for tid in op.inputs:
            t = prof.tensors[prof.root(tid)]
            if t.kind == "activation" and t.producer is not None and t.producer <= last:
                roots.add(t.id)
    return frozenset(roots)


def output_bytes(prof: Profile) -> int:
    """Bytes of the stage's output in the profile (`output_roots`)."""
    return sum(prof.tensors[r].size_bytes for r in output_roots(prof))


def boundary_of(prof: Profile, stage: int, n_stages: int, sends: str,
                local: tuple[bool, bool] = (False, False),
                input_bytes: int | None = None, buffers: str = "reused") -> Boundary:
    """What stage `stage` of `n_stages` holds beyond its profile `prof`: its output (as the
    profile reads it), its input's gradient (`input_bytes`: the previous stage's output;
    None: the size of this stage's output, as for equal stages); `buffers` as
    `boundary_bytes` takes it."""
    pinned = output_roots(prof)
    out = sum(prof.tensors[r].size_bytes for r in pinned)
    b = boundary_bytes(out, out if input_bytes is None else input_bytes, stage == 0,
                       stage == n_stages - 1, sends, local, buffers)
    return b._replace(pinned=pinned, held=output_held(prof, pinned, out))


def stage_profiles(given: Sequence, n_stages: int, what: str = "stage profiles") -> dict:
    """stage -> its entry of `given` (profiles, plans, ...): one for every stage, one per
    stage, or three for more than three stages (the first, every middle one, the last);
    InputError for another count."""
    if len(given) == 1:
        return dict.fromkeys(range(n_stages), given[0])
    if len(given) == n_stages:
        return dict(enumerate(given))
    if len(given) == 3 and n_stages > 3:
        return {s: given[0 if s == 0 else 2 if s == n_stages - 1 else 1]
                for s in range(n_stages)}
    three = " or 3 (the first, the middle ones, the last)" if n_stages > 3 else ""
    raise InputError(f"{len(given)} {what} for a pipeline of {n_stages} stages",
                     hint=f"give 1 (every stage priced as it), {n_stages} (one per stage, in "
                          f"stage order){three}")


def timeline(order: Mapping[int, Sequence[Step]], fwd_us: float | Mapping[int, float],
             bwd_us: float | Mapping[int, float]) -> tuple[float, dict[int, float]]:
    """(the step's time, rank -> its busy time): each rank runs its steps in order, each
    waiting for the step it depends on (see the module docstring). `fwd_us`, `bwd_us`: a
    stage's forward and backward time, one for every stage or stage -> its own."""
    fwd_of = fwd_us if isinstance(fwd_us, Mapping) else None
    bwd_of = bwd_us if isinstance(bwd_us, Mapping) else None
    done: dict[tuple[str, int, int], float] = {}
    n_stages = 1 + max((s for steps in order.values() for _, s, _ in steps), default=0)
    pos = {r: 0 for r in order}
    free = {r: 0.0 for r in order}
    busy = {r: 0.0 for r in order}
    left = sum(len(s) for s in order.values())
    while left:
        moved = False
        for rank, steps in order.items():
            while pos[rank] < len(steps):
                kind, stage, mb = steps[pos[rank]]
                dep = (("F", stage - 1, mb) if kind == "F" and stage > 0 else
                       ("B", stage + 1, mb) if kind != "F" and stage < n_stages - 1 else None)
                if dep is not None and dep not in done:
                    break
                start = max(free[rank], done.get(dep, 0.0))
                f = fwd_of[stage] if fwd_of is not None else fwd_us
                b = bwd_of[stage] if bwd_of is not None else bwd_us
                took = f if kind == "F" else b if kind == "B" else b / 2
                # (the previous stage's backward waits for an input pass, not a weight pass)
                key = "F" if kind == "F" else "W" if kind == "W" else "B"
                free[rank] = done[(key, stage, mb)] = start + took
                busy[rank] += took
                pos[rank] += 1
                left -= 1
                moved = True
        if not moved:
            raise ValueError("the schedule's order waits on a step no rank runs: this is a bug in slackswap")
    return max(free.values(), default=0.0), busy


@dataclass(frozen=True)
class PipelineFigures:
    schedule: str
    pp: int
    microbatches: int
    rows: tuple[RankRow, ...]
    step_us: float                  # with the bubbles
    keep_all_step_us: float
    idle_us: dict[int, float]       # rank -> its bubbles under the plan
    swap_copy_us: dict[int, float]  # rank -> time its swaps' copies take per step, one way
    # with `hw`: the rank-level judge (pipeline_copies.judge), copies on each rank's engines
    judged_step_us: float | None = None
    exposed_us: dict[int, float] | None = None      # rank -> compute waiting for copies
    judged_peak_bytes: dict[int, int] | None = None  # rank -> peak with copies in flight
    # rank -> that peak and its receive buffers under its budget (`copies.RankJudged.fits`)
    judged_fits: dict[int, bool] | None = None
    buffers: str = "reused"         # how PipelineStage holds its buffers (`buffers_of`)


def _by_stage(value, n_stages: int) -> dict:
    """stage -> value: a mapping as given, a list or tuple read by `stage_profiles`, or one
    value for every stage."""
    if isinstance(value, Mapping):
        return dict(value)
    if isinstance(value, (list, tuple)):
        return stage_profiles(value, n_stages)
    return dict.fromkeys(range(n_stages), value)


def boundaries(profs: Mapping[int, Profile], steps, sends: str,
               buffers: str = "reused") -> dict[int, Boundary]:
    """stage -> its Boundary: its own output, its input's gradient the previous stage's
    output (the same profile for every stage: its own output's size, as for equal stages);
    `buffers` as `boundary_bytes` takes it."""
    n_stages = len(profs)
    rank_of = {s: r for r, st in steps.items() for _, s, _ in st}
    equal = len({id(p) for p in profs.values()}) == 1
    out = {s: output_bytes(p) for s, p in profs.items()}
    return {s: boundary_of(profs[s], s, n_stages, sends,
                           (rank_of.get(s - 1) == rank_of[s], rank_of.get(s + 1) == rank_of[s]),
                           None if equal or s == 0 else out[s - 1], buffers)
            for s in range(n_stages)}


def _times(profs, plans) -> tuple[dict, dict, dict]:
    """stage -> forward time, backward time under its plan, backward time keeping everything."""
    fwd = {s: float(p.summary.get("forward_us", 0.0)) for s, p in profs.items()}
    keep = {s: float(p.summary.get("backward_us", 0.0)) for s, p in profs.items()}
    bwd = {s: max(0.0, plans[s].predicted.step_us - fwd[s]) if plans[s] is not None else keep[s]
           for s in profs}
    return fwd, bwd, keep


def pipeline_figures(prof: Profile | Mapping[int, Profile],
                     plan: Plan | None | Mapping[int, Plan | None], schedule: str, pp: int,
                     microbatches: int, stages_per_rank: int = 2,
                     rank_budget: int | Mapping[int, int] = 0, copy_us_per_byte: float = 0.0,
                     hw=None, buffers: str = "reused") -> PipelineFigures:
    """Per rank and for the step, a pipeline of stages priced as `prof` (one profile for every
    stage, stage -> its profile, or a list read by `stage_profiles`) under `plan` (one plan,
    or per stage as `prof`; None: keep everything). `rank_budget`: each rank's activation memory (a row's `fits`; one for every
    rank or rank -> its own);
    `copy_us_per_byte`: the host link's time per byte (for `swap_copy_us`); `hw`: the
    hardware, for the rank-level judge's figures (`judged`); `buffers`: how the torch the
    stages run on holds PipelineStage's buffers (module docstring, `buffers_of`)."""
    steps = schedule_steps(schedule, pp, microbatches, stages_per_rank)
    n_stages = 1 + max(s for st in steps.values() for _, s, _ in st)
    profs, plans = _by_stage(prof, n_stages), _by_stage(plan, n_stages)
    bound = boundaries(profs, steps, SENDS_OF[schedule], buffers)
    held = held_microbatches(steps)
    fwd, bwd, keep_bwd = _times(profs, plans)
    outs = {s: output_bytes(p) for s, p in profs.items()}
    recv = (recv_buffer_bytes(steps, microbatches, {s: outs[s - 1] for s in outs if s > 0},
                              outs, n_stages) if buffers == "reused" else dict.fromkeys(steps, 0))
    rows, idle, copy = [], {}, {}
    step_us, busy = timeline(steps, fwd, bwd)
    keep_step, _ = timeline(steps, fwd, keep_bwd)
    for rank, st in sorted(steps.items()):
        stages = tuple(sorted({s for _, s, _ in st}))
        keep = {s: stage_cost(profs[s], None, bound[s]) for s in stages}
        cost = {s: stage_cost(profs[s], plans[s], bound[s]) if plans[s] is not None
                else keep[s] for s in stages}
        n = {s: sum(1 for k, t, _ in st if k == "F" and t == s) for s in stages}
        swapped = sum(cost[s].swapped_bytes * n[s] for s in stages)
        recomputed = sum(cost[s].recomputed_bytes * n[s] for s in stages)
        fraction = min((plans[s].budget_bytes / profs[s].keep_all_peak_bytes
                        if plans[s] is not None and profs[s].keep_all_peak_bytes else 1.0)
                       for s in stages)
        budget = rank_budget[rank] if isinstance(rank_budget, Mapping) else rank_budget
        rows.append(RankRow(rank, stages, held[rank], budget, rank_peak(st, keep),
                            rank_peak(st, cost), swapped, recomputed, min(1.0, fraction),
                            recv_bytes=recv[rank]))
        idle[rank] = step_us - busy[rank]
        copy[rank] = swapped * copy_us_per_byte
    figs = PipelineFigures(schedule, pp, microbatches, tuple(rows), step_us, keep_step, idle,
                           copy, buffers=buffers)
    return figs if hw is None else judged(figs, profs, plans, steps, bound, hw, rank_budget)


def judged(figs: PipelineFigures, profs: Mapping[int, Profile],
           plans: Mapping[int, Plan | None], steps, bound, hw,
           rank_budget: int | Mapping[int, int]) -> PipelineFigures:
    """`figs` with the rank-level judge's step, exposed copy time and peaks, each stage priced
    as its profile under its plan, each rank's receive buffers kept all step off its budget."""
    from dataclasses import replace

    from .copies import judge, stage_work
    work = {s: stage_work(profs[s], plans[s], hw, b) for s, b in bound.items()}
    got = judge(steps, work, rank_budget, recv_bytes={r.rank: r.recv_bytes for r in figs.rows})
    return replace(figs, judged_step_us=got.step_us,
                   exposed_us={r: j.exposed_us for r, j in got.ranks.items()},
                   judged_peak_bytes={r: j.peak_bytes for r, j in got.ranks.items()},
                   judged_fits={r: j.fits for r, j in got.ranks.items()})
