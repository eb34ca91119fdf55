"""`verify`'s memory checks: whether this machine can hold the run at all (`check_fits`), the
bytes the original step saves for backward (`saved_bytes_original`), and why a measured peak
fails the plan's budget, naming the cause where it is known (`memory_reason`,
`inplace_memory_reason`).
"""
from __future__ import annotations

import math

import torch

from ...budget import MEMORY_TOLERANCE, keep_all_of
from ...errors import InputError
from ...profile_build import dtype_bytes, dtype_name
from ...trace.storage import storage_key, storage_nbytes
from ...units import fmt_bytes
from .timeline import MeasuredStep


def saved_bytes_original(model, inputs, run_step, exclude) -> tuple[object, int]:
    """Run `run_step()` (the forward) under saved_tensors_hooks; bytes it saves for backward."""
    skip = {storage_key(t) for t in exclude}
    seen: dict = {}

    def pack(t):
        key = storage_key(t)
        if key not in skip and t.device.type != "meta":
            seen[key] = storage_nbytes(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run_step()
    return out, sum(seen.values())


def _available_bytes(device: str) -> int | None:
    """Free memory where the step will run: the GPU's free bytes, or the host's MemAvailable."""
    if device == "cuda":
        return int(torch.cuda.mem_get_info()[0])
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_fits(meta: dict, device: str) -> None:
    """Refuse, before building anything, a verify this machine cannot hold.

    verify builds the model twice (original and patched) with their gradients and runs the
    original step with every activation kept. A module made from a `--device fake` profile of
    a large model would otherwise be built for real on the CPU and get the process killed by
    the kernel, without a word. The estimate is a floor (optimizer state, temporaries and the
    allocator come on top), so only a verify that cannot possibly fit is refused.
    """
    param_bytes = sum(math.prod(shape) * dtype_bytes(dtype_name(dtype))
                      for _, shape, dtype in meta.get("params", ()))
    budget = int(meta.get("budget_bytes") or 0)
    fraction = meta.get("budget_fraction")
    peak = int((meta.get("predicted") or {}).get("peak_bytes") or 0)
    keep_all = meta.get("keep_all_peak_bytes") or (keep_all_of(budget, fraction) if fraction
                                                   else max(budget, peak))
    need = int(4 * param_bytes + keep_all)
    free = _available_bytes(device)
    if free is not None and need > free:
        raise InputError(
            f"verify needs at least {fmt_bytes(need)} on {device} (the model twice with its "
            f"gradients, {fmt_bytes(4 * param_bytes)}, and one step keeping every "
            f"activation, {fmt_bytes(keep_all)}), but only {fmt_bytes(free)} is free",
            hint="verify runs the real model: check a smaller configuration here (profile, plan "
                 "and apply it with smaller --arg values), or run verify on a machine that "
                 "holds the full one")


def device_cause(meta: dict, device: str) -> str | None:
    """A profile made for another device than this run's: its saved bytes are that device's."""
    target = meta.get("target_device") or device
    if target == device:
        return None
    return (f"the profile was made for {target} (`--device fake` traces a CUDA GPU's dropout "
            f"and kernels) and this run is on {device}: profile with `--device fake:{device}` "
            f"or `--device {device}` for a plan to run here")


def inplace_memory_reason(inplace: dict, budget: int, meta: dict, device: str) -> str | None:
    """Why the model patched in place holds more after forward than the plan's budget allows
    (None: within 5%), with the cause where it is known: a profile made for another device
    (a `--device fake` profile is CUDA's: its dropout masks and kernels' workspace are not a
    CPU's), or planned recomputes the in-place run kept (their chains did not line up or cannot be
    re-run)."""
    held = inplace["held_bytes_after_forward"]
    if not (budget > 0 and held > budget * (1 + MEMORY_TOLERANCE)):
        return None
    text = (f"the model patched in place (patch(model)) holds {fmt_bytes(held)} for backward "
            f"after forward, {held / budget:.2f}x the plan's budget of {fmt_bytes(budget)}")
    causes = [c for c in (device_cause(meta, device),) if c]
    if inplace.get("recomputes_kept"):
        causes.append(f"{inplace['recomputes_kept']} of the plan's {inplace['planned_recomputes']} "
                      "recomputed tensors were kept, because the ops of their chains did not "
                      f"line up with the profile or cannot be re-run ({inplace['ops_lined_up']} "
                      f"of {inplace['profile_forward_ops']} forward ops lined up)")
    if not causes:
        causes.append("memory the profile does not see (kernels' workspace, or tensors the "
                      "model holds outside autograd)")
    return text + "; " + "; ".join(causes)


def memory_reason(ms: MeasuredStep, budget: int, worst: dict | None,
                   cause: str | None = None) -> str | None:
    """Why the measured peak fails the budget (None: it does not), naming the statement and
    the tensors held past their last use where the simulator's timeline says so."""
    if not (budget > 0 and ms.peak_bytes > budget * (1 + MEMORY_TOLERANCE)):
        return None
    at = ms.rows[ms.peak_row].statement.split("#")[0].strip() if ms.rows else "?"
    why = ""
    if worst is not None:
        held = [t for t in worst["live_tensors"] if t.get("held_past_last_use")]
        names = ", ".join(f"{t['tensor']} ({fmt_bytes(t['bytes'])}, dead after op "
                          f"{t['profile_last_use']} {t['profile_last_use_name']})"
                          for t in held[:4])
        why = (f"; largest excess over the simulator: {fmt_bytes(worst['excess_bytes'])} at "
               f"op {worst['op']} ({worst['name']})"
               + (f", held past their last use: {names}" if names else ""))
    return (f"measured activation peak {fmt_bytes(ms.peak_bytes)} ({ms.peak_bytes} "
            f"bytes) at `{at[:80]}` is more than {MEMORY_TOLERANCE:.0%} above the plan's budget of "
            f"{fmt_bytes(budget)}" + why + (f"; {cause}" if cause else ""))
