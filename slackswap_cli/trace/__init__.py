"""The torch frontend: workload file -> traced training step -> profile.

    load the workload (workload.py)     model, inputs, loss_fn; under FakeTensorMode for --device fake
    capture the joint graph (joint.py)  forward + loss + backward as one aten FX graph
    cost every op                       roofline of a hardware preset (fake), or timed (measure.py)
    build the profile (graph_profile.py) kinds, aliases, random ops, FLOPs, bytes, liveness

Torch is imported here and by the run side (`slackswap_cli/run/`: the emitted file, the
in-place patch, the whole-step module, the swap engine, verify); the planning core never
imports it (tests/test_torch_free.py).
"""
from __future__ import annotations

import platform
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ..errors import InputError, TraceError
from ..schema import Profile

if TYPE_CHECKING:   # the joint graph module imports torch; only its name is needed here
    from .joint import JointGraph


DEVICES = ("auto", "cuda", "cpu", "fake", "fake:cuda", "fake:cpu")
_DEVICE_HINT = "use auto, cuda, cpu, fake (= fake:cuda) or fake:cpu"


def split_device(device: str) -> tuple[str, str | None]:
    """`--device` -> (device, target): "fake:cpu" -> ("fake", "cpu"), "fake" -> ("fake", "cuda").

    A fake trace stands for the device the plan will run on (its dropout, see
    `joint._cuda_dropout`); `fake` alone means a CUDA GPU. Real devices are their own target
    (None here: resolved with `resolve_device`).
    """
    if device not in DEVICES:
        raise InputError(f"unknown device '{device}'", hint=_DEVICE_HINT)
    if device.startswith("fake"):
        return "fake", device.partition(":")[2] or "cuda"
    return device, None


def resolve_device(device: str) -> str:
    """auto -> cuda when available, else cpu; checks that cuda exists when asked for."""
    # torch and the tracer's modules load inside the functions: the CLI imports this package
    # for `split_device`, and an ONNX profile runs without torch
    import torch
    if device not in DEVICES or device.startswith("fake:"):
        raise InputError(f"unknown device '{device}'", hint=_DEVICE_HINT)
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

    from ..profile_build import dtype_name
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
            dtypes[key] = dtype_name(leaf.dtype)
    return shapes, dtypes


def profile_workload(path, *, entry: str = "workload", args: dict | None = None,
                     device: str = "auto", hardware=None, autocast: str | None = None,
                     progress: Callable[[str], None] | None = None,
                     on_load: Callable | None = None) -> Profile:
    """Load the workload at `path`, trace one training step and return its profile.

    device: `fake` builds everything under FakeTensorMode and costs ops by the roofline of
    `hardware`, tracing random ops as a CUDA GPU runs them (`fake:cuda` says the same;
    `fake:cpu` traces them as a CPU does, for a plan to run and verify on a CPU);
    `cpu`/`cuda` run the real step and time every op; `auto` picks cuda if present.
    The device the plan is for is `env["target_device"]`.
    autocast: "bf16" / "fp16" traces forward and loss under `torch.autocast` (the workload's
    own `Workload(autocast=...)` when not given; both given must agree); recorded as
    `workload["autocast"]`, with `env["autocast_device_type"]` the autocast device type used.
    `progress(line)` receives status lines (for stderr). `on_load(work)` is called with the
    loaded `Workload` before tracing (`fit` reads the parameters there; it may raise).
    """
    from .joint import autocast_name
    from .workload import MetaModelError, workload_name

    say = progress or (lambda _line: None)
    asked = device
    device, target = split_device(device)
    device = resolve_device(device) if device != "fake" else device
    target = target or device
    autocast = autocast_name(autocast)
    if device == "fake" and hardware is None:
        raise InputError("--device fake needs a hardware preset for roofline costs",
                         hint="pass --hardware a100-pcie4 (or another preset)")
    t0 = time.perf_counter()
    try:
        work, module, autocast = _load_workload(path, entry, args, device, autocast, say)
    except MetaModelError:
        if asked != "auto" or hardware is None:
            raise
        # a model on the meta device is described, not materialised: auto traces it fake
        device, target = "fake", device
        say(f"the model is on the meta device: tracing it with fake tensors for {target}, "
            f"every op priced by the roofline of {hardware.name} (--hardware to choose)")
        work, module, autocast = _load_workload(path, entry, args, device, autocast, say)
    if on_load is not None:
        on_load(work)
    header = {"name": workload_name(module, path), "path": str(Path(path).resolve()),
              "entry": entry, "args": dict(args or {})}
    return profile_traced(work, header, device=device, target=target, hardware=hardware,
                          autocast=autocast, progress=say, started=t0)[0]


def profile_traced(work, header: dict, *, device: str, target: str, hardware=None,
                   autocast: str | None = None, progress: Callable[[str], None] | None = None,
                   started: float | None = None) -> tuple[Profile, "JointGraph"]:
    """(profile, joint graph) of a loaded workload (`work`: model and inputs on `device`, FakeTensors
    for "fake"): its step traced (under `autocast`, random ops as on `target`), every op
    costed (the roofline of `hardware` for "fake", else timed on `device`). `header` is the
    profile's `workload` (name, path, entry, args); the inputs' shapes and dtypes are added.
    What `profile_workload` does once the workload is loaded, and what the library's
    `plan_model` calls on a model it is handed."""
    from .joint import capture_joint

    say = progress or (lambda _line: None)
    t0 = time.perf_counter() if started is None else started
    say("tracing forward + loss + backward" + (f" under autocast {autocast}" if autocast else ""))
    joint = capture_joint(work.model, work.inputs, work.loss_fn, autocast=autocast,
                          target_device=target)
    if device == "fake":
        _refuse_hidden_workspace(joint, target)
    n_nodes = len(joint.gm.graph.nodes)
    if joint.checkpoints_inlined:
        say(f"traced {joint.checkpoints_inlined} torch.utils.checkpoint region(s) as plain calls: "
            "the plan decides what to recompute")
    say(f"traced {n_nodes} graph nodes in {time.perf_counter() - t0:.1f} s")
    shapes, dtypes = _input_info(work.inputs)
    header = {**header, "input_shapes": shapes, "input_dtypes": dtypes}
    if autocast:
        header["autocast"] = autocast
    if getattr(work, "pipeline", None) is not None:
        from ..pipeline.orders import declared_pipeline
        header["pipeline"] = declared_pipeline(work.pipeline, f"{Path(header['path']).name}'s workload")
    if device == "fake":
        prof = _fake_profile(joint, work, header, hardware, target, autocast, say)
    else:
        prof = _measured_profile(joint, work, header, device, target, autocast, say)
    prof.summary["profile_s"] = round(time.perf_counter() - t0, 3)
    say(f"profiled {prof.summary['n_ops']} ops in {prof.summary['profile_s']:.1f} s")
    return prof, joint


def _load_workload(path, entry: str, args: dict | None, device: str, autocast: str | None,
                   say: Callable[[str], None]):
    """(work, its module, the autocast to trace under): the workload built on `device`
    (under FakeTensorMode for `fake`); `autocast` (from the caller) and the workload's own
    must agree."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from .workload import load_entry

    fake_mode = FakeTensorMode(allow_non_fake_inputs=False) if device == "fake" else None
    call = ", ".join(f"{k}={v!r}" for k, v in (args or {}).items())
    say(f"loading {path}: {entry}({call})")
    try:
        work, module = load_entry(path, entry, args, fake_mode=fake_mode,
                             device=None if device == "fake" else device)
    except torch.OutOfMemoryError as exc:
        raise does_not_fit(device, exc) from None
    if autocast and work.autocast and autocast != work.autocast:
        raise InputError(f"--autocast {autocast}, but the workload asks for autocast "
                         f"{work.autocast}", hint="give one of them, or make them agree")
    return work, module, autocast or work.autocast


def _fake_profile(joint, work, header: dict, hardware, target: str, autocast: str | None,
                  say: Callable[[str], None]) -> Profile:
    """The profile of a fake trace: every op costed by the roofline of `hardware`."""
    import torch

    from ..op_cost import price_profile
    from .graph_profile import joint_to_profile

    env = {"torch_version": torch.__version__, "device": "fake",
           "device_name": "FakeTensorMode (nothing allocated)",
           "hardware": hardware.to_dict(), "target_device": target,
           "float32_matmul": float32_matmul()}
    if autocast:
        env["autocast_device_type"] = _ref_device(work.model)
    prof = joint_to_profile(joint, workload=header, env=env, hardware=hardware,
                            time_source="roofline", progress=say)
    return price_profile(prof, hardware)   # per op class and dtype (op_cost.py)


def float32_matmul() -> dict:
    """What fp32 matmuls and convolutions may run as, as the workload left torch's switches
    (recorded in a profile's `env.float32_matmul`; op_cost prices fp32 ops by it)."""
    import torch
    return {"allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
            "precision": torch.get_float32_matmul_precision(),
            "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32)}


def _measured_profile(joint, work, header: dict, device: str, target: str,
                      autocast: str | None, say: Callable[[str], None]) -> Profile:
    """The profile of a real trace: every op timed on `device` (measure.py)."""
    import torch

    from .graph_profile import joint_to_profile
    from .measure import measure_joint

    dev = torch.device(device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else _cpu_name()
    env = {"torch_version": torch.__version__, "device": device, "device_name": name,
           "hardware": None, "target_device": target, "float32_matmul": float32_matmul()}
    if autocast:
        env["autocast_device_type"] = _ref_device(work.model)
    try:
        m = measure_joint(joint, work.model, work.inputs, device=dev, progress=say)
    except torch.OutOfMemoryError as exc:
        raise does_not_fit(device, exc) from None
    extra = {"measured_step_us": m["measured_step_us"], "op_sum_us": m["op_sum_us"],
             "measure_warmup": m["warmup"], "measure_repeats": m["repeats"]}
    return joint_to_profile(joint, workload=header, env=env, op_times_us=m["op_times_us"],
                            time_source="measured", storage_keys=m["storage_keys"],
                            storage_sizes=m["storage_sizes"],
                            summary_extra=extra, progress=say)


# Recurrent kernels whose real result carries a workspace (reserve) buffer that their fake
# (meta) result leaves empty: a fake trace cannot see those bytes (CPU oneDNN LSTM/GRU layers,
# cuDNN and MIOpen RNNs).
HIDDEN_WORKSPACE_OPS = ("mkldnn_rnn_layer", "_cudnn_rnn", "miopen_rnn")


def _refuse_hidden_workspace(joint, target: str) -> None:
    """A fake trace of a step with RNN kernels would plan without their workspace bytes (an
    LSTM's plan then holds several times its budget): refuse, naming the layer."""
    for node in joint.gm.graph.nodes:
        name = getattr(getattr(node.target, "_schema", None), "name", "")
        if node.op == "call_function" and name.removeprefix("aten::") in HIDDEN_WORKSPACE_OPS:
            where = joint.module.get(node.name) or "the model"
            raise TraceError(
                f"{where} runs {name.removeprefix('aten::')}, a recurrent kernel (LSTM/GRU) whose "
                "workspace a fake trace cannot see: its plan would hold more than its budget",
                hint=f"profile on the device the plan is for: --device {target} on that "
                     "machine (the real kernel's workspace is measured)")


def _ref_device(model) -> str:
    """The device type of the model's first parameter (the one autocast keys on)."""
    return next(model.parameters()).device.type


def does_not_fit(device: str, exc: BaseException) -> TraceError:
    """Measuring runs the whole step for real: a model that does not fit cannot be measured."""
    first = (str(exc).strip().splitlines() or [""])[0][:200]
    return TraceError(
        f"the model or its training step does not fit in {device} memory, so it cannot be "
        f"measured there ({first})",
        hint="profile it with --device fake --hardware PRESET: fake tensors allocate nothing "
             "and the roofline of PRESET costs every op")
