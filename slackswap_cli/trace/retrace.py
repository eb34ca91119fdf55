"""Trace a workload again (with fake tensors when possible) and fingerprint the result: what
`apply` checks a workload against its profile with, and what the whole-step module
(`run/written/step.py`'s `PatchedStep`) checks a user's model against."""
from __future__ import annotations

from ..errors import FingerprintMismatch, TraceError
from ..hardware import DEFAULT_PRESET, PRESETS

__all__ = ["trace_fake", "joint_fingerprint", "trace_matching", "trace_options"]


def trace_fake(path: str, entry: str, args: dict | None, device: str | None, real: bool = False,
               *, autocast: str | None = None, target_device: str | None = None):
    """(joint graph, workload) of the workload at `path`, traced with fake tensors when possible.

    Fake tensors allocate nothing, so a model too large for this machine can still be applied.
    A workload that builds part of its model outside `workload()` cannot be faked, nor can a
    step whose sizes depend on values (mixture-of-experts routing): it is then loaded and
    traced for real. `autocast` and `target_device` are the profile's (its trace
    ran under that autocast, and took the random ops of that device).
    """
    # torch and the tracer load when a trace runs: run/emit.py imports this module at its top
    from torch._subclasses.fake_tensor import FakeTensorMode

    from .joint import capture_joint, needs_values
    from .workload import load_workload
    dev = None if device is None or device == "cpu" or device.startswith("fake") else device
    work = None
    if not real:
        try:
            work = load_workload(path, entry, args, fake_mode=FakeTensorMode(), device=dev)
        except TraceError:
            work = None
    how = {"autocast": autocast, "target_device": target_device}
    if work is not None:
        try:
            return capture_joint(work.model, work.inputs, work.loss_fn, **how), work
        except TraceError as exc:
            if not needs_values(exc.__cause__ or exc):
                raise
            # sizes that depend on values (expert routing): only a real trace has them
    work = load_workload(path, entry, args, device=dev)
    return capture_joint(work.model, work.inputs, work.loss_fn, **how), work


def joint_fingerprint(joint) -> str:
    """The profile fingerprint of a joint graph: op targets and tensors, which times do not
    enter (so the graph is costed with zero times, no roofline needed)."""
    from .graph_profile import joint_to_profile
    times = {n.name: 0.0 for n in joint.gm.graph.nodes if n.op == "call_function"}
    prof = joint_to_profile(joint, workload={}, env={}, op_times_us=times,
                            time_source="measured")
    return prof.fingerprint


def trace_options(profile) -> dict:
    """`trace_fake`'s keyword arguments that make a re-trace trace as `profile` was traced."""
    return {"autocast": profile.workload.get("autocast"),
            "target_device": profile.env.get("target_device")}


def trace_matching(profile, path: str, entry: str | None = None, args: dict | None = None):
    """(joint graph, workload, fake fingerprint) of the workload at `path`, traced as `profile`
    was (its entry, args, device, autocast and target device unless given) and checked against it.

    Fake tensors first; when their graph differs from the profile's, a real trace (a fake trace
    may pick other kernels than the real one did). The fake fingerprint is None when the fake
    trace failed. FingerprintMismatch when the workload now traces to another graph.
    """
    entry = entry or profile.workload.get("entry") or "workload"
    args = dict(profile.workload.get("args") or {}) if args is None else dict(args)
    device, how = profile.env.get("device"), trace_options(profile)
    joint, work = trace_fake(str(path), entry, args, device, **how)
    fp = joint_fingerprint(joint)
    trace_fp = fp if joint.fake else None
    if fp != profile.fingerprint and joint.fake:
        joint, work = trace_fake(str(path), entry, args, device, real=True, **how)
        fp = joint_fingerprint(joint)
    if fp != profile.fingerprint:
        from .graph_profile import first_difference, joint_to_profile
        got = joint_to_profile(joint, workload={}, env={}, hardware=PRESETS[DEFAULT_PRESET])
        raise FingerprintMismatch(
            f"{path} now traces to graph {fp}, but the profile was made from graph "
            f"{profile.fingerprint}; {first_difference(profile, got)}",
            hint="the model, its inputs or torch changed: re-run `slackswap profile` and `slackswap plan`")
    return joint, work, trace_fp
