"""Pipeline parallelism: how many microbatches each rank holds, and one plan per stage that
keeps every rank under its budget.

A pipeline schedule is, per rank, the order in which that rank runs its stages' actions:
("F", stage, microbatch) a forward, ("B", ...) a full backward, ("I", ...) the input-gradient
half of a split backward and ("W", ...) its weight half. A microbatch's activations on a stage
live from its F to its B (or W: a split backward keeps what the weight gradients need until
then). `held_microbatches` reads each rank's peak of such live (stage, microbatch) pairs from
that order; run/parallel/pipeline.py gets the order from torch's schedules.

The memory of a rank, activations only (as the profile counts them), is judged action by
action: while an action of stage s runs, every other live (stage, microbatch) pair holds what
its stage keeps between forward and backward (`StageCost.held_bytes`: the plan's kept saved
activations and what is live when forward ends), and the running one reaches at most its own
single-microbatch peak (`StageCost.peak_bytes`, the plan's simulated peak). `rank_peak` is the
largest such sum. `plan_stages` searches, rank by rank, the largest budget fraction at which
every stage of the rank planned at that fraction of its keep-all peak keeps the rank's peak
under the rank's budget: one plan per stage, which serves all its microbatches.

Torch-free, like the rest of the planning core.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, NamedTuple, Sequence

from ..budget import fraction_bytes
from ..errors import InfeasibleError, InputError
from ..schema import Action, Plan, Profile
from ..simulate import budget_floor_bytes, ideal_us
from .inflight import PEAKS, held_limit, plan_held, search

__all__ = ["STARTS", "ENDS", "StageCost", "RankRow", "held_microbatches", "stage_cost",
           "rank_peak", "Boundary", "SENDS", "BUFFERS", "boundary_bytes", "output_held",
           "recv_buffer_bytes", "plan_stages", "PipelinePlan", "format_rows"]

STARTS = ("F",)                 # the action that makes a microbatch's activations on a stage
ENDS = ("B", "W")               # the actions after which they are gone
KINDS = ("F", "B", "I", "W")

Step = tuple[str, int, int]     # (kind, stage index, microbatch index)


def _checked_order(order: Mapping[int, Sequence[Step]]) -> None:
    for rank, steps in order.items():
        for step in steps:
            if len(step) != 3 or step[0] not in KINDS:
                raise InputError(f"rank {rank}: {step!r} is not a pipeline step "
                                 "(kind, stage, microbatch) with kind one of F, B, I, W",
                                 hint="read the order with parallel.pipeline.schedule_order")


def live_steps(steps: Sequence[Step]) -> Iterable[tuple[Step, frozenset]]:
    """Each step with the (stage, microbatch) pairs live on the rank while it runs, itself
    included for a forward (its activations grow as it runs) and a backward (they are read)."""
    live: set[tuple[int, int]] = set()
    for step in steps:
        kind, stage, mb = step
        if kind in STARTS:
            live.add((stage, mb))
        yield step, frozenset(live)
        if kind in ENDS:
            live.discard((stage, mb))


def held_microbatches(order: Mapping[int, Sequence[Step]]) -> dict[int, int]:
    """rank -> the most (stage, microbatch) pairs it holds at once: microbatches on a rank with
    one stage, chunk-microbatches on a rank with several."""
    _checked_order(order)
    return {rank: max((len(live) for _, live in live_steps(steps)), default=0)
            for rank, steps in order.items()}


@dataclass(frozen=True)
class StageCost:
    """One stage under one plan, per microbatch."""
    held_bytes: int             # on the device between its forward and its backward
    peak_bytes: int             # its peak while one of its actions runs
    swapped_bytes: int = 0      # copied to host per microbatch
    recomputed_bytes: int = 0   # freed after forward, re-run in backward, per microbatch
    boundary_bytes: int = 0     # what the pipeline adds while its backward runs
    boundary_held: int = 0      # what the pipeline adds to held_bytes (counted in it)
    linger_bytes: int = 0       # left from its backward until the step ends (unwaited sends)
    split_bytes: int = 0        # added from its input pass to its weight pass (split backward)
    released: bool = False      # its output (boundary_held) is gone at the rank's next backward
    received_bytes: int = 0     # its receive buffer (counted in held_bytes), per microbatch


class Boundary(NamedTuple):
    """What a pipeline stage holds beyond its profile (`boundary_bytes`), and the activation
    roots of the profile the pipeline holds whatever the plan says (`pinned`: the stage's
    output, kept in PipelineStage's forward cache; a plan that swaps or recomputes it frees
    nothing)."""
    held: int = 0
    backward: int = 0
    pinned: frozenset = frozenset()
    linger: int = 0
    eager: int = 0      # what the eager run holds at its peak beyond the simulator's (measured)
    split: int = 0      # held from a split backward's input pass to its weight pass (measured:
    #                     the gradients its weight pass starts from, run/parallel/split_backward.py)
    received: int = 0   # a receive buffer allocated in every step, held with each microbatch
    released: bool = False  # the output is dropped at the rank's next backward (its send waited)


# What a schedule's sends keep alive after a microbatch's backward, until the step ends.
# "runtime": the schedules torch runs from their action lists (_PipelineScheduleRuntime) wait
# for every send at the end of the step, so each sent output (forward) and input gradient
# (backward) lives that long; "gpipe": GPipe waits for its backward sends after the last
# backward (its forward sends after the last forward, when the outputs are held anyway);
# "none": 1F1B waits for each send before the next.
SENDS = ("runtime", "gpipe", "none")
# How a PipelineStage holds its buffers: "reused" (torch 2.13 and 2.14: receive buffers
# allocated once, in the first step, and reused; every output kept to its microbatch's
# backward) or "per-step" (torch 2.15: each receive's buffer allocated before it, in every
# step; an output dropped once its send is waited, which GPipe and 1F1B do before the rank's
# next backward and the action-list schedules right after that microbatch's backward).
BUFFERS = ("reused", "per-step")


def boundary_bytes(output_bytes: int, input_bytes: int, first: bool, last: bool,
                   sends: str = "none", local: tuple[bool, bool] = (False, False),
                   buffers: str = "reused") -> Boundary:
    """What a pipeline stage holds beyond its profile, per microbatch held (`held`), while a
    backward of it runs (`backward`) and after it (`linger`). PipelineStage keeps each
    microbatch's output (its forward cache) until that microbatch's backward, where the
    profile lets the output die at its last reader in forward, the loss (the real one on the
    last stage, a stand-in sum on the others), before forward ends: `held` counts it
    (`output_held` takes off a part the profile keeps to the end). A stage that is not the
    last receives its output's gradient; one that is not the first makes its input's gradient
    to send back (a gradient: the profile does not count it). `sends` (one of SENDS): how
    long the schedule keeps what it sent; `local`: whether the previous and the next stage run
    on this rank (a V schedule's middle), where nothing is sent. `buffers` (one of BUFFERS):
    under "per-step" a stage that receives its input holds that buffer with each microbatch
    (`received`; the last stage's loss, kept to the step's end, holds it until then), and a
    sent output is dropped when its send is waited: before the rank's next backward under
    GPipe and 1F1B (`released`: not held then, not at its own backward), right after its own
    backward under the action-list schedules (nothing sent lingers but input gradients)."""
    if sends not in SENDS:
        raise InputError(f"sends={sends!r} is not one of {SENDS}",
                         hint="'runtime' for the schedules torch runs from action lists")
    if buffers not in BUFFERS:
        raise InputError(f"buffers={buffers!r} is not one of {BUFFERS}",
                         hint="'per-step' for torch 2.15's PipelineStage, else 'reused'")
    per_step = buffers == "per-step"
    released = per_step and sends != "runtime" and not last and not local[1]
    held = output_bytes
    backward = ((0 if released else output_bytes) + (0 if last else output_bytes)
                + (0 if first else input_bytes))
    grad_sent = 0 if first or local[0] else input_bytes
    out_sent = 0 if last or local[1] or per_step else output_bytes
    linger = {"runtime": grad_sent + out_sent, "gpipe": grad_sent,
              "none": 0}[sends]
    received = grad_sent if per_step else 0
    linger += received if last else 0
    return Boundary(held, backward, linger=linger, received=received, released=released)


def recv_buffer_bytes(order: Mapping[int, Sequence[Step]], microbatches: int,
                      input_bytes: Mapping[int, int], output_bytes: Mapping[int, int],
                      n_stages: int | None = None) -> dict[int, int]:
    """rank -> the bytes its stages' receive buffers hold for the whole step, outside the
    activation peak (`rank_peak`): PipelineStage allocates, per microbatch, one buffer for
    each input of a stage that is not the first (`input_bytes[stage]`) and one for the
    gradient of each output of a stage that is not the last (`output_bytes[stage]`), when the
    schedule is first run, and keeps them from step to step. (Between stages of one rank,
    a V schedule's middle, torch hands the tensor over in place of the buffer, which then
    keeps the last step's until it is replaced: counted the same.) What a stage sends is its
    output and its input's gradient, counted in the activation peak (`Boundary`).
    `n_stages`: the pipeline's stages (default: as many as `order` runs)."""
    if n_stages is None:
        n_stages = 1 + max((s for steps in order.values() for _, s, _ in steps), default=0)
    out = {}
    for rank, steps in order.items():
        out[rank] = microbatches * sum(
            (input_bytes.get(s, 0) if s > 0 else 0)
            + (output_bytes.get(s, 0) if s < n_stages - 1 else 0) for s in _stages_of(steps))
    return out


def output_held(prof: Profile, pinned: frozenset, output_bytes: int) -> int:
    """Of the stage's output (`output_bytes`; `pinned`: its roots in the profile), the bytes
    the profile's liveness lets die before forward ends: what `Boundary.held` adds."""
    if not pinned:
        return output_bytes
    end = prof.n_forward - 1
    last = prof.last_use
    return sum(prof.tensors[r].size_bytes for r in pinned if last.get(r, -1) < end)


def stage_cost(prof: Profile, plan: Plan | None = None,
               boundary: Boundary = Boundary()) -> StageCost:
    """A stage's per-microbatch figures under `plan` (None: keep everything). Held: what is
    live during the last forward op (the keep-all liveness) less the saved activations the
    plan swaps or recomputes; peak: the plan's simulated peak (the keep-all peak without).
    `boundary`: the pipeline's own bytes, added, and the roots it holds anyway (a plan's
    eviction of one frees nothing: its bytes count as held and at the peak)."""
    held, extra, pinned, linger, eager, split, received, released = boundary
    live_at_end = prof.live_bytes_per_op[prof.n_forward - 1] if prof.n_forward else 0
    if plan is None:
        return StageCost(live_at_end + held + received, prof.keep_all_peak_bytes,
                         boundary_bytes=extra, boundary_held=held, linger_bytes=linger,
                         split_bytes=split, released=released, received_bytes=received)
    size = {t.id: t.size_bytes for t in prof.saved_activations}
    moved = {Action.SWAP: 0, Action.RECOMPUTE: 0}
    stuck = 0
    for d in plan.decisions:
        if d.action in moved and d.tensor in size:
            moved[d.action] += size[d.tensor]
            stuck += size[d.tensor] if d.tensor in pinned else 0
    evicted = moved[Action.SWAP] + moved[Action.RECOMPUTE] - stuck
    return StageCost(max(0, live_at_end - evicted) + held + received,
                     plan.predicted.peak_bytes + stuck + eager,
                     moved[Action.SWAP], moved[Action.RECOMPUTE], extra, held, linger, split,
                     released, received)


def rank_peak(steps: Sequence[Step], cost: Mapping[int, StageCost]) -> int:
    """The rank's activation peak: the largest, over its steps, of what the other live pairs
    hold, plus the running stage's own peak, plus what the backwards done so far left behind
    until the step ends (`StageCost.linger_bytes`). A pair between its input pass and its
    weight pass (a split backward) holds its `split_bytes` too; its weight pass starts from
    them, with its output still held (`boundary_held`) but nothing received or sent. A
    `released` stage's output is held only until the rank's next backward begins; a stage's
    per-step receive buffer (`received_bytes`) is held by the running pair too."""
    best, lingering, split, sent = 0, 0, set(), set()
    for (kind, stage, mb), live in live_steps(steps):
        if kind in ("B", "I"):
            sent.clear()
        others = sum(cost[s].held_bytes + (cost[s].split_bytes if (s, m) in split else 0)
                     - (cost[s].boundary_held if cost[s].released and (s, m) not in sent
                        else 0)
                     for s, m in live if (s, m) != (stage, mb))
        c = cost[stage]
        extra = c.received_bytes + {"F": 0, "W": c.boundary_held + c.split_bytes}.get(
            kind, c.boundary_bytes)
        best = max(best, others + c.peak_bytes + extra + lingering)
        if kind == "F":
            sent.add((stage, mb))
        if kind in ("B", "I"):
            lingering += c.linger_bytes
        if kind == "I":
            split.add((stage, mb))
        elif kind == "W":
            split.discard((stage, mb))
    return best


@dataclass(frozen=True)
class RankRow:
    """One rank of a planned pipeline: the `show` table's row."""
    rank: int
    stages: tuple[int, ...]
    held: int                   # peak (chunk-)microbatches held at once
    budget_bytes: int
    keep_all_peak_bytes: int    # the rank's peak with every stage keeping everything
    planned_peak_bytes: int     # under the stages' plans
    swapped_bytes: int          # per step: every microbatch's swaps on the rank's stages
    recomputed_bytes: int
    fraction: float             # of each stage's keep-all peak its plan was made at
    exposed_copy_us: float | None = None    # judged with copies on shared engines (windows)
    link_factor: float = 1.0    # the copy link speed-up its stages were planned at (windows)
    recv_bytes: int = 0         # its receive buffers, all step (`recv_buffer_bytes`): in the
    #                             budget, beside the activation peaks
    held_fraction: float = 1.0  # the hold its stages were planned at (`inflight.held_limit`;
    #                             1: none, each plan made for its peak alone)

    @property
    def fits(self) -> bool:
        """Under the rank's budget, its receive buffers counted (a row without one, budget
        0, fits)."""
        return (self.budget_bytes <= 0
                or self.planned_peak_bytes + self.recv_bytes <= self.budget_bytes)


@dataclass(frozen=True)
class PipelinePlan:
    """Per stage the plan (None: keep everything), per rank its row."""
    plans: dict[int, Plan | None]
    rows: tuple[RankRow, ...]
    order: dict[int, tuple[Step, ...]]


Planner = Callable[[Profile, int], Plan]      # (stage profile, budget bytes) -> plan


def _stages_of(steps: Sequence[Step]) -> tuple[int, ...]:
    return tuple(sorted({s for _, s, _ in steps}))


def _counts(steps: Sequence[Step]) -> dict[int, int]:
    """stage -> forwards the rank runs of it (its microbatches)."""
    out: dict[int, int] = {}
    for kind, stage, _ in steps:
        if kind == "F":
            out[stage] = out.get(stage, 0) + 1
    return out


def plans_at(fraction: float, stages, profiles, planner: Planner, memo: dict, boundary,
             held: float = 1.0, shared: dict | None = None):
    """Each stage's plan at `fraction` of its keep-all peak (the floor at least), None for
    keeping everything at 1.0; and their costs. `held` below 1: each plan also holds at most
    its `inflight.held_limit` at the end of forward (`inflight.plan_held`). `memo`: the
    (stage, budget, limit) -> (plan, cost) already made; `shared`: (profile, budget, limit,
    pinned roots) -> (profile, plan), across the ranks whose stages share a profile."""
    plans, cost = {}, {}
    shared = {} if shared is None else shared
    for s in stages:
        prof = profiles[s]
        limit = held_limit(prof, held)
        if fraction >= 1.0 and limit is None:
            plans[s], cost[s] = None, stage_cost(prof, None, boundary.get(s, Boundary()))
            continue
        budget = max(budget_floor_bytes(prof),
                     fraction_bytes(min(fraction, 1.0), prof.keep_all_peak_bytes))
        if (s, budget, limit) not in memo:
            pinned = boundary.get(s, Boundary()).pinned
            key = (id(prof), budget, limit, pinned if limit is not None else None)
            if key not in shared:   # (the profile kept beside its plan: its id stays its own)
                shared[key] = (prof, planner(prof, budget) if limit is None
                               else plan_held(planner, prof, budget, limit, pinned))
            plan = shared[key][1]
            memo[s, budget, limit] = (plan, stage_cost(prof, plan, boundary.get(s, Boundary()))
                                      if plan.feasible else None)
        plans[s], cost[s] = memo[s, budget, limit]
        if cost[s] is None:
            return None, None
    return plans, cost


class Fit(NamedTuple):
    """A rank's stages planned at peak fraction `fraction` and hold fraction `held`
    (1: no hold), with their costs."""
    fraction: float
    plans: dict
    costs: dict
    held: float = 1.0


def step_us(steps: Sequence[Step], profiles: Mapping[int, Profile], plans) -> float:
    """The rank's compute under `plans`, its actions back to back: each stage's simulated
    step (its plan's, recomputes and waits for copies included; keeping everything, its
    ops' time) once per microbatch the rank runs of it."""
    return sum(n * (ideal_us(profiles[s]) if plans.get(s) is None
                    else plans[s].predicted.step_us) for s, n in _counts(steps).items())


def _search(steps, stages, profiles, planner, budget: int, boundary,
            shared: dict | None = None) -> Fit | None:
    """The rank's stages planned so its peak fits `budget` in the least time (`step_us`):
    `inflight.search` over the peak fraction and the hold fraction; None when nothing fits."""
    memo: dict = {}

    def attempt(fraction, held):
        plans, cost = plans_at(fraction, stages, profiles, planner, memo, boundary, held,
                               shared)
        if plans is None or rank_peak(steps, cost) > budget:
            return None
        return Fit(fraction, plans, cost, held)
    return search(attempt, lambda fit: step_us(steps, profiles, fit.plans),
                  peaks=hold_peaks(steps))


def hold_peaks(steps: Sequence[Step]) -> tuple[float, ...]:
    """The peak fractions `inflight.search` tries a hold at: none on a rank that never holds
    two (stage, microbatch) pairs at once (no other pair's held bytes meet its peak)."""
    return PEAKS if max((len(live) for _, live in live_steps(steps)), default=0) > 1 else ()


def _least(steps, stages, profiles, planner, boundary, shared=None) -> int | None:
    """The least peak a rank holds: each of its stages planned at its floor, with no hold
    and with the hold at its floor (`inflight.held_floor`), the lower (None: a stage's
    planner finds no plan there)."""
    peaks = []
    for held in (1.0, 0.0):
        plans, cost = plans_at(0.0, stages, profiles, planner, {}, boundary, held, shared)
        if plans is not None:
            peaks.append(rank_peak(steps, cost))
    return min(peaks, default=None)


def _short(short, fewer: str | None) -> InfeasibleError:
    """The error for ranks (rank, budget, least it holds, its receive buffers) that no plan
    brings under budget."""
    from ..units import fmt_bytes
    which = ", ".join(f"rank {r} (budget {fmt_bytes(b)}"
                      + (f", at least {fmt_bytes(least)} with each stage at its floor"
                         if least is not None else "")
                      + (f", its receive buffers {fmt_bytes(recv)} counted" if recv else "")
                      + ")" for r, b, least, recv in short)
    known = [least for _, _, least, _ in short if least is not None]
    raise_to = (f"raise the per-rank budget to at least {max(known)} bytes "
                f"({fmt_bytes(max(known))})" if len(known) == len(short)
                else "raise the per-rank budget")
    return InfeasibleError(f"no plan of its stages keeps {which} under its budget with the "
                           "microbatches the schedule holds there",
                           hint=f"{raise_to}, use more microbatches of a smaller size"
                                + (f", or a schedule that holds fewer ({fewer})"
                                   if fewer else ""))


def plan_stages(order: Mapping[int, Sequence[Step]], profiles: Mapping[int, Profile],
                budget_bytes: Mapping[int, int] | int, planner: Planner,
                boundary: Mapping[int, Boundary] | None = None,
                windows=None, fewer: str | None = "1F1B",
                recv_bytes: Mapping[int, int] | None = None) -> PipelinePlan:
    """One plan per stage, each rank's peak (`rank_peak`) under its budget: bytes per rank (a
    mapping rank -> bytes, or one figure for every rank; a float is a fraction of the rank's
    keep-all peak, its held microbatches and boundary buffers counted, and its receive
    buffers); `recv_bytes`: rank -> its receive buffers (`recv_buffer_bytes`), taken off its
    budget before its activations are planned. `planner(profile,
    budget_bytes)` makes a stage's plan; `boundary`: stage -> its `boundary_bytes`.
    `windows` (a `pipeline_windows.Windows`): spend the schedule's idle windows on swaps,
    each rank judged with its copies on shared engines (`pipeline_copies.judge`; the row's
    planned peak is the judge's). Raises InfeasibleError naming the ranks that no plan
    brings under their budget, each budget and the least the rank holds (`_least`); its hint
    names `fewer`, a schedule that holds fewer microbatches (None: the schedule run is it)."""
    _checked_order(order)
    boundary = dict(boundary or {})
    held = held_microbatches(order)
    shared: dict = {}       # (profile, budget, limit) -> plan, for every rank's search
    plans: dict[int, Plan | None] = {}
    rows, short = [], []
    for rank, steps in sorted(order.items()):
        stages = _stages_of(steps)
        missing = [s for s in stages if s not in profiles]
        if missing:
            raise InputError(f"rank {rank} runs stage(s) {missing}, which have no profile",
                             hint="give a profile for every stage index the schedule runs")
        budget = budget_bytes[rank] if isinstance(budget_bytes, Mapping) else budget_bytes
        keep = {s: stage_cost(profiles[s], None, boundary.get(s, Boundary())) for s in stages}
        recv = (recv_bytes or {}).get(rank, 0)
        if isinstance(budget, float):         # a fraction of the rank's keep-all peak
            budget = int(budget * (rank_peak(steps, keep) + recv))
        acts = budget - recv                  # what its activations may take
        if windows is None:
            found = _search(steps, stages, profiles, planner, acts, boundary, shared)
        else:
            found = windows.search(rank, steps, stages, profiles, acts, boundary)
        if found is None:
            least = _least(steps, stages, profiles, planner if windows is None
                           else windows.plain_planner(), boundary, shared)
            short.append((rank, budget, None if least is None else least + recv, recv))
            continue
        fraction, stage_plans, cost = found[:3]
        plans.update(stage_plans)
        n = _counts(steps)
        judged = found.judged.ranks[rank] if windows is not None else None
        rows.append(RankRow(rank, stages, held[rank], budget, rank_peak(steps, keep),
                            judged.peak_bytes if judged else rank_peak(steps, cost),
                            sum(cost[s].swapped_bytes * n.get(s, 0) for s in stages),
                            sum(cost[s].recomputed_bytes * n.get(s, 0) for s in stages),
                            fraction, judged.exposed_us if judged else None,
                            found.factor if judged else 1.0, recv, found.held))
    if short:
        raise _short(short, fewer)
    return PipelinePlan(plans, tuple(rows), {r: tuple(s) for r, s in order.items()})


ROW_HEADERS = ("rank", "stages", "held", "budget", "keep-all peak", "planned peak",
               "swapped/step", "recomputed/step", "fraction")


def row_cells(row: RankRow) -> tuple[str, ...]:
    """A rank's row as the per-rank table writes it."""
    from ..units import fmt_bytes
    return (str(row.rank), ",".join(map(str, row.stages)), str(row.held),
            fmt_bytes(row.budget_bytes) if row.budget_bytes > 0 else "-",
            fmt_bytes(row.keep_all_peak_bytes),
            fmt_bytes(row.planned_peak_bytes) + ("" if row.fits else " (over)"),
            fmt_bytes(row.swapped_bytes), fmt_bytes(row.recomputed_bytes),
            f"{row.fraction:.3f}")


def format_rows(rows: Sequence[RankRow]) -> str:
    """The per-rank table as plain text: keep-all peak, planned peak, microbatches held,
    swapped and recomputed bytes per step, the fraction of each stage's keep-all peak its
    plan was made at; then each rank's receive buffers, where it has any."""
    from ..units import fmt_bytes
    table = [ROW_HEADERS, *(row_cells(r) for r in rows)]
    widths = [max(len(line[i]) for line in table) for i in range(len(ROW_HEADERS))]
    recv = ("\nreceive buffers (all step, in the rank's budget beside its planned peak): "
            + ", ".join(f"rank {r.rank} {fmt_bytes(r.recv_bytes)}" for r in rows)
            if any(r.recv_bytes for r in rows) else "")
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(line, widths))
                     for line in table) + recv
