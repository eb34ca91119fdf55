"""`slackswap verify`: prove on the user's own model that a patched step computes the same thing.

Two copies of the workload's model start from the same weights. Each step, both run one
training step from the same RNG state (so dropout draws the same masks), then take the same
plain SGD update, so later steps start from updated weights. Compared per step: the loss, every
parameter's gradient and every floating-point buffer (BatchNorm running statistics).

Memory, measured for both the original and the patched step:

- CUDA: `torch.cuda.max_memory_allocated` during the step minus what was allocated before it
  (parameters, optimizer state). Gradients are allocated inside the step by both, so their
  bytes are subtracted to estimate the activation peak the budget refers to.
- CPU (no allocator statistics): the bytes held for backward at the end of forward. For the
  original, every tensor autograd saves passes through `saved_tensors_hooks`; storages are
  counted once, and parameters, buffers and inputs (which exist anyway) are left out. For the
  patched step, the runtime's store counts what it keeps on the device (kept storages, and
  swapped tensors still being copied); recomputed and swapped-out tensors hold nothing.

Pass: loss within 1e-5 relative and gradients within 1e-4 relative (fp32; 1e-3/1e-2 for 16-bit
floats), buffers within the gradient tolerance, and measured memory at most 5% above the plan's
budget (the report names the quantity compared).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from .errors import InputError

MEMORY_TOLERANCE = 0.05


@dataclass
class VerifyReport:
    patched: str
    workload: str
    device: str
    steps: int
    losses_original: list[float]
    losses_patched: list[float]
    max_loss_rel_diff: float
    max_grad_rel_diff: float
    worst_grad_param: str
    max_buffer_rel_diff: float
    loss_tolerance: float
    grad_tolerance: float
    memory_metric: str                 # what original/patched_peak_bytes measure
    original_peak_bytes: int
    patched_peak_bytes: int
    budget_bytes: int
    predicted_peak_bytes: int
    original_step_ms: float            # fastest of the steps (the first includes warm-up)
    patched_step_ms: float
    predicted_step_us: float
    swapped_bytes_per_step: int
    kept: int
    swapped: int
    recomputed: int
    passed: bool
    reasons: list[str] = field(default_factory=list)


def _rel(a, b) -> float:
    import torch
    if a is None and b is None:
        return 0.0
    if a is None or b is None:
        return float("inf")
    a, b = a.detach().double(), b.detach().double()
    scale = max(float(a.abs().max()) if a.numel() else 0.0, 1e-12)
    return float((a - b).abs().max()) / scale if a.numel() else 0.0


def _tolerances(dtype) -> tuple[float, float]:
    import torch
    if dtype in (torch.float16, torch.bfloat16):
        return 1e-3, 1e-2
    return 1e-5, 1e-4


def saved_bytes_original(model, inputs, run_step, exclude) -> tuple[object, int]:
    """Run `run_step()` (the forward) under saved_tensors_hooks; bytes it saves for backward."""
    import torch

    from .runtime import storage_bytes, storage_key
    skip = {storage_key(t) for t in exclude}
    seen: dict = {}

    def pack(t):
        key = storage_key(t)
        if key not in skip and t.device.type != "meta":
            seen[key] = storage_bytes(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run_step()
    return out, sum(seen.values())


_DTYPE_BYTES = {"torch.float64": 8, "torch.float32": 4, "torch.float16": 2, "torch.bfloat16": 2}


def _available_bytes(device: str) -> int | None:
    """Free memory where the step will run: the GPU's free bytes, or the host's MemAvailable."""
    import torch
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
    import math
    param_bytes = sum(math.prod(shape) * _DTYPE_BYTES.get(dtype, 4)
                      for _, shape, dtype in meta.get("params", ()))
    budget = int(meta.get("budget_bytes") or 0)
    fraction = meta.get("budget_fraction")
    peak = int((meta.get("predicted") or {}).get("peak_bytes") or 0)
    keep_all = budget / fraction if fraction else max(budget, peak)
    need = int(4 * param_bytes + keep_all)
    free = _available_bytes(device)
    if free is not None and need > free:
        gib = 2 ** 30
        raise InputError(
            f"verify needs at least {need / gib:.1f} GiB on {device} (the model twice with its "
            f"gradients, {4 * param_bytes / gib:.1f} GiB, and one step keeping every "
            f"activation, {keep_all / gib:.1f} GiB), but only {free / gib:.1f} GiB is free",
            hint="verify runs the real model: check a smaller configuration here (profile, plan "
                 "and apply it with smaller --arg values), or run verify on a machine that "
                 "holds the full one")


def _warmup(model, run) -> None:
    """One untimed step; weights, buffers, gradients and the RNG are put back afterwards."""
    import torch
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    run().backward()
    with torch.no_grad():
        model.load_state_dict(state)
    for p in model.parameters():
        p.grad = None
    torch.set_rng_state(rng)
    if cuda_rng is not None:
        torch.cuda.set_rng_state_all(cuda_rng)


def verify(patched_path: str, model_path: str | None = None, entry: str | None = None,
           args: dict | None = None, steps: int = 1, seed: int = 0,
           check_trace: bool = True, warmup: bool = True) -> VerifyReport:
    """Run the original and the patched training step `steps` times and compare them.

    `warmup` first runs one untimed step of each and restores weights, buffers and RNG state,
    so step times do not include one-off costs (allocator growth, kernel selection).
    """
    import torch
    import torch.utils._pytree as pytree

    from .apply import load_patched
    from .trace.joint import loss_from_output, split_inputs
    from .trace.workload import load_workload

    if steps < 1:
        raise InputError(f"steps must be at least 1, got {steps}")
    mod = load_patched(patched_path)
    meta = mod.META
    w = meta["workload"]
    path = model_path or w["path"]
    entry = entry or w["entry"]
    args = dict(w["args"]) if args is None else dict(args)
    device = meta["device_type"]
    if device == "cuda" and not torch.cuda.is_available():
        raise InputError("the patched module was made for CUDA, but no GPU is visible",
                         hint="run verify on the machine the profile was made on")
    dev = None if device == "cpu" else device
    check_fits(meta, device)

    torch.manual_seed(seed)
    orig = load_workload(path, entry, args, device=dev)
    torch.manual_seed(seed)
    work = load_workload(path, entry, args, device=dev)
    work.model.load_state_dict(orig.model.state_dict())
    orig.model.train()
    work.model.train()
    patched = mod.patch(work.model, check_trace=check_trace)

    p_args, p_kwargs = split_inputs(work.inputs)
    o_args, o_kwargs = split_inputs(orig.inputs)
    params_o = dict(orig.model.named_parameters())
    params_p = dict(work.model.named_parameters())
    ref = next(iter(params_o.values()))
    loss_tol, grad_tol = _tolerances(ref.dtype)
    opt_o = torch.optim.SGD(orig.model.parameters(), lr=1e-3)
    opt_p = torch.optim.SGD(work.model.parameters(), lr=1e-3)
    cuda = device == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def grad_bytes(model):
        return sum(p.grad.numel() * p.grad.element_size() for p in model.parameters()
                   if p.grad is not None)

    if warmup:
        _warmup(orig.model, lambda: loss_from_output(orig.model(*o_args, **o_kwargs), orig.inputs,
                                                     orig.loss_fn))
        _warmup(work.model, lambda: patched(*p_args, **p_kwargs))

    losses_o, losses_p = [], []
    max_loss = max_grad = max_buf = 0.0
    worst = ""
    peaks_o, peaks_p, times_o, times_p = [], [], [], []
    offloaded = 0

    def start() -> int:
        """Synchronise and open a measurement: the allocated bytes it starts from (CUDA)."""
        sync()
        if not cuda:
            return 0
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()

    def peak(base: int, model, held_bytes: int) -> int:
        """After the step: CUDA peak over it less gradients, or the CPU bytes held for backward."""
        if not cuda:
            return held_bytes
        return torch.cuda.max_memory_allocated() - base - grad_bytes(model)

    for k in range(steps):
        # ---- original ----------------------------------------------------------------------
        opt_o.zero_grad(set_to_none=True)
        exclude_o = [*orig.model.parameters(), *orig.model.buffers(),
                     *[x for x in pytree.tree_leaves(orig.inputs) if isinstance(x, torch.Tensor)]]
        base = start()
        torch.manual_seed(seed + 1 + k)
        t0 = time.perf_counter()

        def run_o():
            return loss_from_output(orig.model(*o_args, **o_kwargs), orig.inputs, orig.loss_fn)

        loss_o, held_o = saved_bytes_original(orig.model, orig.inputs, run_o, exclude_o)
        loss_o.backward()
        sync()
        times_o.append((time.perf_counter() - t0) * 1e3)
        peaks_o.append(peak(base, orig.model, held_o))
        # ---- patched -----------------------------------------------------------------------
        opt_p.zero_grad(set_to_none=True)
        base = start()
        torch.manual_seed(seed + 1 + k)
        t0 = time.perf_counter()
        loss_p = patched(*p_args, **p_kwargs)
        held_p = patched.held_bytes_after_forward
        store = patched.last_store() if patched.last_store is not None else None
        offloaded = store.offloaded_bytes if store is not None else 0
        loss_p.backward()
        sync()
        times_p.append((time.perf_counter() - t0) * 1e3)
        peaks_p.append(peak(base, work.model, held_p))
        # ---- compare -----------------------------------------------------------------------
        losses_o.append(float(loss_o.detach()))
        losses_p.append(float(loss_p.detach()))
        max_loss = max(max_loss, _rel(loss_o, loss_p))
        for name, p in params_o.items():
            d = _rel(p.grad, params_p[name].grad)
            if d > max_grad:
                max_grad, worst = d, name
        for (name, b), (_, b2) in zip(orig.model.named_buffers(), work.model.named_buffers()):
            if b.is_floating_point():
                max_buf = max(max_buf, _rel(b, b2))
            elif not torch.equal(b, b2):
                max_buf = max(max_buf, float("inf"))
        with torch.no_grad():
            opt_o.step()
            opt_p.step()

    reasons = []
    if max_loss > loss_tol:
        reasons.append(f"loss differs by {max_loss:.2e} (relative), tolerance {loss_tol:g}")
    if max_grad > grad_tol:
        reasons.append(f"gradient of {worst} differs by {max_grad:.2e} (relative), tolerance {grad_tol:g}")
    if max_buf > grad_tol:
        reasons.append(f"buffers differ by {max_buf:.2e} (relative), tolerance {grad_tol:g}")
    budget = int(meta.get("budget_bytes") or 0)
    metric = ("cuda max_memory_allocated above the step's start, gradients subtracted" if cuda
              else "bytes held for backward at the end of forward (cpu)")
    peak_p = max(peaks_p)
    if budget > 0 and peak_p > budget * (1 + MEMORY_TOLERANCE):
        reasons.append(f"measured {metric}: {peak_p} bytes, more than 5% above the plan's budget "
                       f"of {budget} bytes")
    pred = meta.get("predicted", {})
    return VerifyReport(
        patched=str(patched_path), workload=str(path), device=device, steps=steps,
        losses_original=losses_o, losses_patched=losses_p, max_loss_rel_diff=max_loss,
        max_grad_rel_diff=max_grad, worst_grad_param=worst, max_buffer_rel_diff=max_buf,
        loss_tolerance=loss_tol, grad_tolerance=grad_tol, memory_metric=metric,
        original_peak_bytes=int(max(peaks_o)), patched_peak_bytes=int(peak_p),
        budget_bytes=budget, predicted_peak_bytes=int(pred.get("peak_bytes", 0)),
        original_step_ms=min(times_o), patched_step_ms=min(times_p),
        predicted_step_us=float(pred.get("step_us", 0.0)), swapped_bytes_per_step=int(offloaded),
        kept=len(meta.get("kept", ())), swapped=len(meta.get("swapped", ())),
        recomputed=len(meta.get("recomputed", ())), passed=not reasons, reasons=reasons)
