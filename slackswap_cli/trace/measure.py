"""Time every op of a real joint graph by running it node by node.

The traced graph is run the way the patched module will run it: one aten op after the other.
Each call_function node (getitem excepted: it is not an op) is timed on its own:

- on CUDA, with a pair of CUDA events around the node, all read after one synchronize at the
  end of the pass (events do not stall the stream, so the pass runs at full speed);
- on CPU, with `time.perf_counter` around the node (ops are synchronous there).

A few passes warm up (allocator, kernel selection, caches), then `repeats` timed passes. Each
op's time is the median over the passes on CUDA, and the minimum on CPU: there, other
processes and descheduled worker threads only ever add time (a parallel op waits a whole
scheduler slice for a thread that lost its core), so the fastest pass is the op's own cost.
Python's cyclic GC is held off during a pass (it would fire on the same op every time).

The whole step (the graph module called end to end, without our per-node bookkeeping) is
timed the same way, one step right after each node-by-node pass (so that a burst of load on
a shared machine hits both clocks alike), and the profile reports both (`measured_step_us`, `op_sum_us`): their
ratio says how far the per-op times can be trusted. On CPU the sum is usually below the step,
which also pays Python's dispatch between ops.

On CPU the first pass also records which outputs share storage (`storage.storage_key`,
with every value kept alive so addresses are unique): the profile then takes its aliases from
real storages, which the tests compare with the ones the fake trace recorded. On CUDA that
pass is skipped (keeping every value of a large step alive could run out of memory); the
trace's fake storages decide there.
"""
from __future__ import annotations

import gc
import operator
import statistics
import time
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from ..errors import TraceError
from .dtensor import local_params
from .joint import JointGraph, split_inputs
from .storage import storage_key


def flat_args(joint: JointGraph, model: torch.nn.Module, inputs: Any) -> list:
    """The graph's placeholders in order: parameters, buffers, input tensors, tangent."""
    params, _ = local_params(dict(model.named_parameters()))     # DTensors: their shards
    buffers = dict(model.named_buffers())
    args, kwargs = split_inputs(inputs)
    leaves = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    ref = next(iter(params.values()))
    tangent = torch.ones((), dtype=ref.dtype, device=ref.device)
    # buffers may be updated in place (BatchNorm running stats): time a copy, not the model's
    return ([params[n].detach() for n in joint.param_names]
            + [buffers[n].detach().clone() for n in joint.buffer_names]
            + [x.detach() for x in leaves] + [tangent])


def _last_uses(nodes: list[fx.Node]) -> dict[fx.Node, list[fx.Node]]:
    """node -> values whose last reader it is (so a pass frees them like eager would)."""
    last: dict[fx.Node, fx.Node] = {}
    for node in nodes:
        for a in node.all_input_nodes:
            last[a] = node
    out: dict[fx.Node, list[fx.Node]] = {}
    for value, user in last.items():
        out.setdefault(user, []).append(value)
    return out


class _Runner:
    def __init__(self, gm: fx.GraphModule, device: torch.device):
        self.gm = gm
        self.nodes = list(gm.graph.nodes)
        self.frees = _last_uses(self.nodes)
        self.cuda = device.type == "cuda"
        self.timed = [n for n in self.nodes
                      if n.op == "call_function" and n.target is not operator.getitem]

    def run(self, args: list, *, keep_all: bool = False) -> tuple[list[float], dict]:
        """One pass; returns (time of each timed node in us, env if keep_all else {})."""
        env: dict[fx.Node, Any] = {}
        it = iter(args)
        times: list[float] = []
        events = []
        for node in self.nodes:
            if node.op == "placeholder":
                env[node] = next(it)
            elif node.op == "get_attr":
                obj = self.gm
                for part in str(node.target).split("."):
                    obj = getattr(obj, part)
                env[node] = obj
            elif node.op == "call_function":
                a, kw = fx.node.map_arg((node.args, node.kwargs), lambda n: env[n])
                if node.target is operator.getitem:
                    env[node] = operator.getitem(*a)
                elif self.cuda:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    env[node] = node.target(*a, **kw)
                    end.record()
                    events.append((start, end))
                else:
                    t0 = time.perf_counter()
                    env[node] = node.target(*a, **kw)
                    times.append((time.perf_counter() - t0) * 1e6)
            elif node.op == "output":
                break
            if not keep_all:
                for dead in self.frees.get(node, ()):
                    env.pop(dead, None)
        if self.cuda:
            torch.cuda.synchronize()
            times = [s.elapsed_time(e) * 1e3 for s, e in events]
        return times, (env if keep_all else {})


def storage_keys_from_run(env: dict, nodes: list[fx.Node]) -> dict[str, tuple]:
    """Tensor name -> storage key (`storage.storage_key`), for every value of one pass kept
    alive together."""
    keys: dict[str, tuple] = {}
    for node in nodes:
        if node not in env or node.op == "output":
            continue
        if node.op == "call_function" and node.target is operator.getitem:
            continue  # named by their op as "<op>.<i>"
        val = env[node]
        vals = val if isinstance(val, (tuple, list)) else [val]
        for i, v in enumerate(vals):
            if isinstance(v, torch.Tensor) and v.untyped_storage().nbytes() > 0:
                name = f"{node.name}.{i}" if isinstance(val, (tuple, list)) else node.name
                keys[name] = storage_key(v)
    return keys


def storage_sizes_from_run(env: dict, nodes: list[fx.Node]) -> dict[str, int]:
    """Tensor name -> bytes of its storage in a real run (kernels may allocate more than the
    fake trace shows: the CPU RNN kernels' workspace is empty under FakeTensorMode)."""
    sizes: dict[str, int] = {}
    for node in nodes:
        if node not in env or node.op != "call_function" or node.target is operator.getitem:
            continue
        val = env[node]
        vals = val if isinstance(val, (tuple, list)) else [val]
        for i, v in enumerate(vals):
            if isinstance(v, torch.Tensor):
                name = f"{node.name}.{i}" if isinstance(val, (tuple, list)) else node.name
                sizes[name] = v.untyped_storage().nbytes()
    return sizes


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure_joint(joint: JointGraph, model: torch.nn.Module, inputs: Any, *,
                  device: torch.device, warmup: int = 2, repeats: int = 5,
                  progress: Callable[[str], None] | None = None) -> dict:
    """Measure op times and the whole step of a real joint graph.

    Returns {"op_times_us": {op name: median us}, "measured_step_us", "op_sum_us",
    "storage_keys": {tensor name: storage address} (None on CUDA), "storage_sizes": {tensor
    name: storage bytes} (None on CUDA), "warmup", "repeats"}.
    """
    runner = _Runner(joint.gm, device)
    args = flat_args(joint, model, inputs)
    # Python's cyclic GC fires after a fixed number of allocations, so it would land on the same
    # op in every pass and add milliseconds to it: collect between passes, never during one.
    gc_was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        keys: dict[str, int] | None = None
        sizes: dict[str, int] | None = None
        if device.type == "cpu":
            if progress:
                progress("measuring: first pass (storage check)")
            _, env = runner.run(args, keep_all=True)
            keys = storage_keys_from_run(env, runner.nodes)
            sizes = storage_sizes_from_run(env, runner.nodes)
            del env
        gm_args = _gm_args(joint, args)
        # warm both ways of running the step before any clock starts: the first calls pay
        # for kernel selection, allocator growth and lazy code generation
        for i in range(warmup):
            if keys is None or i > 0:
                runner.run(args)
            joint.gm(*gm_args)
        _sync(device)
        # then alternate a node-by-node pass with a whole step, so both clocks see the same
        # machine: on a shared host, timing all passes first and all steps after lets a burst
        # of load land on one of them only, and the check comparing them cries noise
        samples: list[list[float]] = []
        steps = []
        for r in range(repeats):
            if progress:
                progress(f"measuring ops and the whole step: pass {r + 1}/{repeats}")
            samples.append(runner.run(args)[0])
            steps.append(_time_step(joint, gm_args, device))
            gc.collect()
    except torch.cuda.OutOfMemoryError as exc:
        raise TraceError(f"the step does not fit on {device} ({str(exc).splitlines()[0][:200]})",
                         hint="profile it with --device fake (roofline costs), or shrink it "
                              "with --arg (batch, seq, layers)") from None
    except RuntimeError as exc:
        first = str(exc).splitlines()[0][:300]
        hint = "check that the workload trains eagerly on this device"
        if "dtype" in first.lower():
            hint = ("give the inputs the dtypes the model trains with (token ids and labels as "
                    "torch.long, floats in the model's dtype); " + hint)
        raise TraceError(f"running the traced step on {device} failed: {first}",
                         hint=hint) from None
    finally:
        if gc_was_enabled:
            gc.enable()
    pick = statistics.median if device.type == "cuda" else min
    medians = [pick(col) for col in zip(*samples)] if samples else []
    op_times = {n.name: t for n, t in zip(runner.timed, medians)}
    return {"op_times_us": op_times, "measured_step_us": pick(steps),
            "op_sum_us": sum(medians), "storage_keys": keys, "storage_sizes": sizes,
            "warmup": warmup,
            "repeats": repeats}


def _time_step(joint: JointGraph, gm_args: list, device: torch.device) -> float:
    """One whole step, end to end, in microseconds."""
    _sync(device)
    if device.type == "cuda":
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        joint.gm(*gm_args)
        e.record()
        torch.cuda.synchronize()
        return s.elapsed_time(e) * 1e3
    t0 = time.perf_counter()
    joint.gm(*gm_args)
    return (time.perf_counter() - t0) * 1e6


def _gm_args(joint: JointGraph, flat: list) -> list:
    """The structured call the traced function had: (params, buffers, inputs, tangent)."""
    n_p, n_b = len(joint.param_names), len(joint.buffer_names)
    n_i = sum(joint.input_leaf_is_tensor)
    return [flat[:n_p], flat[n_p:n_p + n_b], flat[n_p + n_b:n_p + n_b + n_i], flat[-1]]
