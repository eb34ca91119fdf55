"""Pipeline schedules' order of compute actions, written without torch, for the CLI (`fit` and
`simulate --pp`): GPipe, 1F1B, Interleaved1F1B, ZBVZeroBubble and DualPipeV, each rank's steps (kind,
stage, microbatch) in the order torch 2.13's schedules run them (tests/test_pipeline.py checks them
against `parallel.pipeline.schedule_order`, which reads torch). Other schedules are read from torch
(`slackswap_cli.run.parallel.pipeline.schedule_order`).

GPipe: every forward, then every backward. 1F1B: `min(microbatches, pp - rank)` forwards, then
a backward and a forward in turn, then the remaining backwards (the loop Schedule1F1B runs).
Interleaved1F1B (two or more stages per rank, stage `k * pp + rank`): torch's
`_get_1f1b_rank_ops` with `_get_warmup_ops`: the microbatches go in rounds of
`microbatches // rounds`, `rounds = max(1, microbatches // pp)`, which must divide them.
ZBVZeroBubble (stages `rank` and `2 * pp - 1 - rank`): torch's
`_calculate_single_rank_operations`, backwards split into input ("I") and weight ("W") passes.
DualPipeV (the same V, at least `2 * pp` microbatches): torch's
`_calculate_single_rank_operations`, its overlapped forward-and-backward pairs as the forward
then the full backward ("B"), the last backwards split (a weight pass queued after each input
pass). InterleavedZeroBubble is planned by `plan_pipeline` (which reads torch), not here.

Torch-free.
"""
from __future__ import annotations

from typing import NamedTuple

from ..errors import InputError

__all__ = ["SCHEDULES", "V_SCHEDULES", "order", "check_schedule", "PipelineSpec", "declared_pipeline",
           "pipeline_spec"]

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV")
# the schedules that run two stages a rank in a V (stages `rank` and `2 * pp - 1 - rank`)
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")

Step = tuple[str, int, int]


def check_schedule(schedule: str, pp: int, microbatches: int, stages_per_rank: int = 2) -> None:
    """Refuse, with what to do, what the schedule cannot run."""
    if schedule not in SCHEDULES:
        known = {s.lower(): s for s in SCHEDULES}
        near = known.get(str(schedule).lower())
        raise InputError(f"unknown pipeline schedule {schedule!r}",
                         hint=(f"did you mean --schedule {near}?" if near else
                               "one of --schedule " + ", ".join(SCHEDULES)))
    if pp < 1:
        raise InputError(f"--pp {pp}: a pipeline has at least 1 rank",
                         hint="--pp 4 for four pipeline ranks")
    if microbatches < 1:
        raise InputError(f"--microbatches {microbatches}: a step has at least 1 microbatch",
                         hint=f"--microbatches {2 * pp} (twice the ranks, say)")
    if schedule == "1F1B" and microbatches < pp:
        raise InputError(f"1F1B with --pp {pp} needs at least {pp} microbatches, not "
                         f"{microbatches} (torch's Schedule1F1B refuses fewer)",
                         hint=f"--microbatches {pp}")
    if schedule in V_SCHEDULES and stages_per_rank != 2:
        raise InputError(f"{schedule} runs exactly 2 stages per rank (a V), not "
                         f"{stages_per_rank}", hint="--stages-per-rank 2")
    if schedule == "DualPipeV" and microbatches < 2 * pp:
        raise InputError(f"DualPipeV with --pp {pp} needs at least {2 * pp} microbatches (one "
                         f"per stage), not {microbatches} (torch's ScheduleDualPipeV refuses "
                         "fewer)", hint=f"--microbatches {2 * pp}")
    if schedule == "Interleaved1F1B":
        if stages_per_rank < 2:
            raise InputError(f"Interleaved1F1B runs at least 2 stages per rank, not "
                             f"{stages_per_rank}", hint="--stages-per-rank 2")
        rounds = max(1, microbatches // pp)
        if microbatches % rounds:
            fit = ((microbatches + pp - 1) // pp) * pp
            raise InputError(f"Interleaved1F1B with --pp {pp} runs the microbatches in "
                             f"rounds of {pp}: {microbatches} is not a multiple of the "
                             f"{rounds} rounds", hint=f"--microbatches {fit}")


def _gpipe(pp: int, n: int) -> dict[int, tuple[Step, ...]]:
    return {r: tuple([("F", r, m) for m in range(n)] + [("B", r, m) for m in range(n)])
            for r in range(pp)}


def one_f_one_b(pp: int, n: int) -> dict[int, tuple[Step, ...]]:
    """Schedule1F1B's `_step_microbatches`, rank by rank (one stage per rank): the order its
    loop runs, which `run/parallel/pipeline.py` takes too."""
    out = {}
    for rank in range(pp):
        warmup = min(n, pp - rank)
        steps: list[Step] = [("F", rank, i) for i in range(warmup)]
        fwd, bwd = warmup, 0
        while bwd < n:
            steps.append(("B", rank, bwd))
            bwd += 1
            if fwd < n:
                steps.append(("F", rank, fwd))
                fwd += 1
        out[rank] = tuple(steps)
    return out


def _interleaved(pp: int, n: int, local: int) -> dict[int, tuple[Step, ...]]:
    per_round = n // max(1, n // pp)
    out = {}
    for rank in range(pp):
        warmup = min((local - 1) * per_round + 2 * (pp - 1 - rank), n * local)
        total = n * local                      # forwards, and as many backwards
        fwd_mb: dict[int, int] = {}
        bwd_mb: dict[int, int] = {}
        steps: list[Step] = []

        def fwd(op):
            s = ((op // per_round) % local) * pp + rank
            fwd_mb[s] = fwd_mb.get(s, 0) + 1
            steps.append(("F", s, fwd_mb[s] - 1))

        def bwd(op):
            s = (local - 1 - ((op - warmup) // per_round) % local) * pp + rank
            bwd_mb[s] = bwd_mb.get(s, 0) + 1
            steps.append(("B", s, bwd_mb[s] - 1))
        for op in range(warmup):
            fwd(op)
        for op in range(warmup, total):
            fwd(op)
            bwd(op)
        for op in range(total, total + warmup):
            bwd(op)
        out[rank] = tuple(steps)
    return out


def _zbv(pp: int, n: int) -> dict[int, tuple[Step, ...]]:
    """ScheduleZBVZeroBubble's `_calculate_single_rank_operations`, rank by rank: two stages
    a rank in a V (`rank` and `2 * pp - 1 - rank`), each backward split into its input pass
    ("I") and weight pass ("W"); planned for at least `2 * pp - 1` microbatches, the steps
    of the ones past `n` left out."""
    micro = max(2 * pp - 1, n)
    out = {}
    for rank in range(pp):
        s0, s1 = rank, 2 * pp - 1 - rank
        c = {"f0": 0, "f1": 0, "b0": 0, "b1": 0}
        steps: list[Step] = []

        def put(kind, chunk, key):
            steps.append((kind, s0 if chunk == 0 else s1, c[key]))

        def step(kind, chunk):           # (F, I) count on; W is counted by its own loop
            key = ("f" if kind == "F" else "b") + str(chunk)
            put(kind, chunk, key)
            c[key] += 1
        for _ in range(2 * (pp - rank) - 1):
            step("F", 0)
        for _ in range(rank):
            step("F", 1)
            step("F", 0)
        for _ in range(pp - rank):
            step("F", 1)
            put("I", 1, "b1")
            put("W", 1, "b1")
            c["b1"] += 1
        while c["f1"] < c["f0"] or c["f0"] < micro:
            if c["f0"] < micro:
                step("F", 0)
            for chunk in (0, 1):
                if chunk == 1:
                    step("F", 1)
                key = f"b{chunk}"
                put("I", chunk, key)
                put("W", chunk, key)
                c[key] += 1
        steps += _zbv_cooldown(rank, pp, c, s0, s1)
        out[rank] = tuple(x for x in steps if x[2] < n)
    return out


def _zbv_cooldown(rank: int, pp: int, c: dict, s0: int, s1: int) -> list[Step]:
    """ZBV's cool-down: input passes first, the weight passes after."""
    steps: list[Step] = []
    w0, w1 = c["b0"], c["b1"]
    for _ in range(rank):
        steps += [("I", s0, c["b0"]), ("I", s1, c["b1"])]
        c["b0"] += 1
        c["b1"] += 1
    for _ in range(pp - rank):
        steps += [("I", s0, c["b0"]), ("W", s0, w0)]
        c["b0"] += 1
        w0 += 1
    steps += [("W", s1, w) for w in range(w1, c["b1"])]
    steps += [("W", s0, w) for w in range(w0, c["b0"])]
    return steps


class _DualPipeV:
    """ScheduleDualPipeV's `_calculate_single_rank_operations` for one rank: counters per
    (stage, kind), a full backward counting the input and the weight pass on, each input
    pass queueing its weight pass."""

    def __init__(self, rank: int, pp: int):
        self.s0, self.s1 = rank, 2 * pp - 1 - rank
        self.count: dict[tuple[int, str], int] = {}
        self.queue: list[tuple[int, int]] = []
        self.steps: list[Step] = []

    def add(self, stage: int, kind: str) -> None:
        key = (stage, "I" if kind == "B" else kind)
        mb = self.count.get(key, 0)
        self.steps.append((kind, stage, mb))
        if kind == "I":
            self.queue.append((stage, mb))
        self.count[key] = mb + 1

    def weight(self) -> None:
        if self.queue:
            stage, mb = self.queue.pop(0)
            self.steps.append(("W", stage, mb))


def _dualpipev(pp: int, n: int) -> dict[int, tuple[Step, ...]]:
    out = {}
    for rank in range(pp):
        r = _DualPipeV(rank, pp)
        s0, s1 = r.s0, r.s1
        for _ in range(2 * (pp - rank - 1)):
            r.add(s0, "F")
        for _ in range(rank + 1):
            r.add(s0, "F")
            r.add(s1, "F")
        for _ in range(pp - rank - 1):
            r.add(s1, "I")
            r.weight()
            r.add(s1, "F")
        for _ in range(n - 2 * pp + rank + 1):      # overlapped pairs: the forward first
            r.add(s0, "F")
            r.add(s1, "B")
            r.add(s1, "F")
            r.add(s0, "B")
        for _ in range(pp - rank - 1):
            r.add(s1, "B")
            r.add(s1, "F")
            r.add(s0, "B")
        _dualpipev_tail(r, rank, pp)
        out[rank] = tuple(r.steps)
    return out


def _dualpipev_tail(r: _DualPipeV, rank: int, pp: int) -> None:
    """DualPipeV's last backwards: full ones, then (from the middle, on one side of the V or
    the other by the rank's parity) split ones, then the queued weight passes."""
    split = False
    for i in range(rank + 1):
        if i == (rank + 1) // 2 and rank % 2 == 1:
            split = True
        r.add(r.s1, "I" if split else "B")
        if i == (rank + 1) // 2 and rank % 2 == 0:
            split = True
        r.add(r.s0, "I" if split else "B")
    for _ in range(pp - rank - 1):
        r.weight()
        r.add(r.s0, "I" if split else "B")
    for _ in range(rank + 1):
        r.weight()


def order(schedule: str, pp: int, microbatches: int,
          stages_per_rank: int = 2) -> dict[int, tuple[Step, ...]]:
    """rank -> its compute steps in the order `schedule` runs them (checked first)."""
    check_schedule(schedule, pp, microbatches, stages_per_rank)
    if schedule == "GPipe":
        return _gpipe(pp, microbatches)
    if schedule == "1F1B":
        return one_f_one_b(pp, microbatches)
    if schedule == "ZBVZeroBubble":
        return _zbv(pp, microbatches)
    if schedule == "DualPipeV":
        return _dualpipev(pp, microbatches)
    return _interleaved(pp, microbatches, stages_per_rank)


class PipelineSpec(NamedTuple):
    """A checked pipeline: the schedule, its ranks, microbatches per step, stages per rank
    (Interleaved1F1B; one for the others)."""
    schedule: str
    pp: int
    microbatches: int
    stages_per_rank: int = 2


DECLARED_KEYS = ("pp", "schedule", "microbatches", "stages_per_rank")


def declared_pipeline(value, where: str = "the workload") -> dict:
    """A workload's `pipeline = dict(pp=4, schedule="1F1B", microbatches=8)` as plain values,
    its keys and types checked (the values are checked by `pipeline_spec`)."""
    hint = 'pipeline=dict(pp=4, schedule="1F1B", microbatches=8) (stages_per_rank for Interleaved1F1B)'
    if not isinstance(value, dict):
        raise InputError(f"{where} declares pipeline={value!r}, not a dict", hint=hint)
    unknown = [k for k in value if k not in DECLARED_KEYS]
    if unknown:
        raise InputError(f"{where} declares pipeline keys {unknown}, not among "
                         f"{', '.join(DECLARED_KEYS)}", hint=hint)
    if "pp" not in value:
        raise InputError(f"{where} declares a pipeline without pp (its ranks)", hint=hint)
    for key in ("pp", "microbatches", "stages_per_rank"):
        if key in value and (isinstance(value[key], bool) or not isinstance(value[key], int)):
            raise InputError(f"{where} declares pipeline {key}={value[key]!r}, not an integer",
                             hint=hint)
    if "schedule" in value and not isinstance(value["schedule"], str):
        raise InputError(f"{where} declares pipeline schedule={value['schedule']!r}, not a "
                         "name", hint="one of " + ", ".join(SCHEDULES))
    return dict(value)


def pipeline_spec(pp: int | None, schedule: str | None = None, microbatches: int | None = None,
                  stages_per_rank: int | None = None, declared: dict | None = None
                  ) -> PipelineSpec | None:
    """The checked pipeline from the flags (None where not given), each one overriding the
    workload's `declared` pipeline; None when neither gives --pp. Defaults: 1F1B, twice the
    ranks microbatches, 2 stages per rank. A bad value (given or declared) is refused with
    the flag that fixes it (the flag overrides the declared value)."""
    base = declared_pipeline(declared) if declared is not None else {}
    if pp is None and not base:
        given = [o for o, v in (("--schedule", schedule), ("--microbatches", microbatches),
                                ("--stages-per-rank", stages_per_rank)) if v is not None]
        if given:
            raise InputError(f"{', '.join(given)} describe(s) a pipeline, and --pp is not given",
                             hint=f"add --pp N (the pipeline's ranks), e.g. --pp 4 {given[0]} ...")
        return None
    pp = base["pp"] if pp is None else pp
    schedule = schedule or base.get("schedule") or "1F1B"
    microbatches = base.get("microbatches", 2 * pp) if microbatches is None else microbatches
    per_rank = base.get("stages_per_rank", 2) if stages_per_rank is None else stages_per_rank
    try:
        check_schedule(schedule, pp, microbatches, per_rank)
    except InputError as exc:
        if not base:
            raise
        raise InputError(f"{exc.message} (the workload declares pipeline={base!r}; a flag "
                         "overrides it)", hint=exc.hint) from None
    return PipelineSpec(schedule, pp, microbatches, per_rank)
