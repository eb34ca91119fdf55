"""A simulated step as a Chrome trace, to open in Perfetto (ui.perfetto.dev) or chrome://tracing.

The Chrome trace event format is a JSON object whose `traceEvents` list holds

- `"ph": "X"` complete events (a name, a start `ts` and a duration `dur`, both in microseconds,
  the unit the simulator uses) on a thread `tid` of a process `pid`;
- `"ph": "C"` counter events, drawn as a stepped area chart: each one sets the counter's value
  from its `ts` on;
- `"ph": "M"` metadata events naming the process and threads (tracks) and fixing their order.

The simulated step becomes one process with three tracks, compute, D2H and H2D, in that order.
Recompute ops and stalls sit on the compute track, told apart by category and colour (`cname`,
one of the trace viewer's reserved colour names); each op carries its id, target and module
path in `args`. Activation memory is a counter track (bytes), with the budget as a second
series when one is given.
"""
from __future__ import annotations

import os

import orjson

from ..errors import InputError
from ..schema import Profile, write_atomic
from ..simulate import SimResult

PID = 1
TRACKS = {"compute": 1, "d2h": 2, "h2d": 3}
TRACK_NAMES = {"compute": "compute", "d2h": "D2H copies (offload)", "h2d": "H2D copies (prefetch)"}
# reserved colour names of the trace viewer (catapult's color scheme)
COLORS = {"op": "thread_state_running", "recompute": "yellow", "stall": "terrible",
          "offload": "rail_load", "prefetch": "rail_response"}
MEMORY_COUNTER = "activation memory"


def to_chrome_trace(result: SimResult, profile: Profile,
                    budget_bytes: int | None = None) -> dict:
    """The Chrome trace JSON object of a simulated step (`simulate(..., record=True)`)."""
    if not result.events and not result.memory:
        raise InputError("this simulation result has no timeline",
                         hint="simulate with record=True to get a trace")
    ops, tensors = profile.ops, profile.tensors
    events: list[dict] = [
        {"ph": "M", "pid": PID, "name": "process_name",
         "args": {"name": f"slackswap: {profile.workload.get('name', 'step')}"}},
    ]
    for engine, tid in TRACKS.items():
        events.append({"ph": "M", "pid": PID, "tid": tid, "name": "thread_name",
                       "args": {"name": TRACK_NAMES[engine]}})
        events.append({"ph": "M", "pid": PID, "tid": tid, "name": "thread_sort_index",
                       "args": {"sort_index": tid}})
    for e in result.events:
        args: dict = {}
        if e.op is not None:
            op = ops[e.op]
            args.update(op=op.id, target=op.target, module=op.module, phase=op.phase)
        if e.tensor is not None:
            t = tensors[e.tensor]
            args.update(tensor=t.id, tensor_name=t.name, shape=list(t.shape), dtype=t.dtype,
                        size_bytes=t.size_bytes)
        if e.cause is not None:
            args["cause"] = e.cause
        cat = e.kind if e.kind != "op" else (ops[e.op].phase if e.op is not None else "op")
        events.append({"ph": "X", "pid": PID, "tid": TRACKS[e.engine], "name": e.name,
                       "cat": cat, "ts": e.start_us, "dur": e.end_us - e.start_us,
                       "cname": COLORS.get(e.kind, "generic_work"), "args": args})
    for ts, nbytes in result.memory:
        args = {"bytes": nbytes}
        if budget_bytes is not None:
            args["budget_bytes"] = budget_bytes
        events.append({"ph": "C", "pid": PID, "name": MEMORY_COUNTER, "ts": ts, "args": args})
    pr = result.predicted
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "feasible": result.feasible, "reason": result.reason,
            "step_us": pr.step_us, "ideal_us": pr.ideal_us, "retention": pr.retention,
            "peak_bytes": pr.peak_bytes, "budget_bytes": budget_bytes,
            "profile_fingerprint": profile.fingerprint,
        },
    }


def write_chrome_trace(path: str | os.PathLike, result: SimResult, profile: Profile,
                       budget_bytes: int | None = None) -> None:
    """Write the trace atomically (no half-written file on failure)."""
    write_atomic(path, orjson.dumps(to_chrome_trace(result, profile, budget_bytes)))
