"""The torch frontend: workload file -> traced training step -> profile.

    load the workload (workload.py)     model, inputs, loss_fn; under FakeTensorMode for --device fake
    capture the joint graph (joint.py)  forward + loss + backward as one aten FX graph
    cost every op                       roofline of a hardware preset (fake), or timed (measure.py)
    build the profile (graph_profile.py) kinds, aliases, random ops, FLOPs, bytes, liveness

This package is the only place (with apply's runtime) that imports torch.
"""
from __future__ import annotations

import platform
import time
from pathlib import Path
from typing import Callable

from ..errors import InputError, TraceError
from ..schema import Profile


def resolve_device(device: str) -> str:
    """auto -> cuda when available, else cpu; checks that cuda exists when asked for."""
    import torch
    if device not in ("auto", "cuda", "cpu", "fake"):
        raise InputError(f"unknown device '{device}'", hint="use auto, cuda, cpu or fake")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise InputError("--device cuda, but torch sees no CUDA device",
                         hint="use --device cpu to measure here, or --device fake for a roofline "
                              "estimate of a GPU")
    return device


def _cpu_name() -> str:
    """The CPU model (e.g. "AMD EPYC 7B13"), from /proc/cpuinfo where there is one."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def _input_info(inputs) -> tuple[dict, dict]:
    import torch
    import torch.utils._pytree as pytree
    from .joint import split_inputs
    args, kwargs = split_inputs(inputs)
    shapes, dtypes = {}, {}
    for path, leaf in pytree.tree_flatten_with_path((args, kwargs))[0]:
        if isinstance(leaf, torch.Tensor):
            key = pytree.keystr(path)
            # ((args), {kwargs}) paths read "[0][1]" / "[1]['input_ids']": name them plainly
            if key.startswith("[1]['") and key.endswith("']") and key.count("[") == 2:
                key = key[5:-2]
            elif key.startswith("[0]"):
                key = "args" + key[3:]
            shapes[key] = list(leaf.shape)
            dtypes[key] = str(leaf.dtype).removeprefix("torch.")
    return shapes, dtypes


def profile_workload(path, *, entry: str = "workload", args: dict | None = None,
                     device: str = "auto", hardware=None,
                     progress: Callable[[str], None] | None = None) -> Profile:
    """Load the workload at `path`, trace one training step and return its profile.

    device: `fake` builds everything under FakeTensorMode and costs ops by the roofline of
    `hardware`; `cpu`/`cuda` run the real step and time every op; `auto` picks cuda if present.
    `progress(line)` receives status lines (for stderr).
    """
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from .graph_profile import joint_to_profile
    from .joint import capture_joint
    from .workload import _load, workload_name

    say = progress or (lambda _line: None)
    device = resolve_device(device)
    if device == "fake" and hardware is None:
        raise InputError("--device fake needs a hardware preset for roofline costs",
                         hint="pass --hardware a100-pcie4 (or another preset)")
    t0 = time.perf_counter()
    fake_mode = FakeTensorMode(allow_non_fake_inputs=False) if device == "fake" else None
    call = ", ".join(f"{k}={v!r}" for k, v in (args or {}).items())
    say(f"loading {path}: {entry}({call})")
    try:
        work, module = _load(path, entry, args, fake_mode=fake_mode,
                             device=None if device == "fake" else device)
    except torch.OutOfMemoryError as exc:
        raise _does_not_fit(device, exc) from None
    say("tracing forward + loss + backward")
    joint = capture_joint(work.model, work.inputs, work.loss_fn)
    n_nodes = len(joint.gm.graph.nodes)
    if joint.checkpoints_inlined:
        say(f"traced {joint.checkpoints_inlined} torch.utils.checkpoint region(s) as plain calls: "
            "the plan decides what to recompute")
    say(f"traced {n_nodes} graph nodes in {time.perf_counter() - t0:.1f} s")
    shapes, dtypes = _input_info(work.inputs)
    header = {"name": workload_name(module, path), "path": str(Path(path).resolve()),
              "entry": entry, "args": dict(args or {}), "input_shapes": shapes,
              "input_dtypes": dtypes}
    if device == "fake":
        env = {"torch_version": torch.__version__, "device": "fake",
               "device_name": "FakeTensorMode (nothing allocated)",
               "hardware": hardware.to_dict()}
        prof = joint_to_profile(joint, workload=header, env=env, hardware=hardware,
                                time_source="roofline", progress=say)
    else:
        from .measure import measure_joint
        dev = torch.device(device)
        name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else _cpu_name()
        env = {"torch_version": torch.__version__, "device": device, "device_name": name,
               "hardware": None}
        try:
            m = measure_joint(joint, work.model, work.inputs, device=dev, progress=say)
        except torch.OutOfMemoryError as exc:
            raise _does_not_fit(device, exc) from None
        extra = {"measured_step_us": m["measured_step_us"], "op_sum_us": m["op_sum_us"],
                 "measure_warmup": m["warmup"], "measure_repeats": m["repeats"]}
        prof = joint_to_profile(joint, workload=header, env=env, op_times_us=m["op_times_us"],
                                time_source="measured", storage_keys=m["storage_keys"],
                                storage_sizes=m["storage_sizes"],
                                summary_extra=extra, progress=say)
    prof.summary["profile_s"] = round(time.perf_counter() - t0, 3)
    say(f"profiled {prof.summary['n_ops']} ops in {prof.summary['profile_s']:.1f} s")
    return prof


def _does_not_fit(device: str, exc: BaseException) -> TraceError:
    """Measuring runs the whole step for real: a model that does not fit cannot be measured."""
    first = (str(exc).strip().splitlines() or [""])[0][:200]
    return TraceError(
        f"the model or its training step does not fit in {device} memory, so it cannot be "
        f"measured there ({first})",
        hint="profile it with --device fake --hardware PRESET: fake tensors allocate nothing "
             "and the roofline of PRESET costs every op")
