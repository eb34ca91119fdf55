"""`verify`'s value check: the original and the patched model loaded from the same weights
(`load_pair`), stepped side by side from the same RNG state with the same SGD update, timed and
measured per step, and their losses, gradients and buffers compared (`compare_steps`) against
the dtype's tolerances.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.utils._pytree as pytree

from ...errors import FingerprintMismatch, InputError, ModelChanged
from ...trace.joint import autocast_region, loss_from_output, split_inputs
from ...trace.workload import load_workload
from ..emit import load_patched
from .memory import check_fits, saved_bytes_original


def rel_diff(a, b) -> float:
    if a is None and b is None:
        return 0.0
    if a is None or b is None:
        return float("inf")
    a, b = a.detach().double(), b.detach().double()
    scale = max(float(a.abs().max()) if a.numel() else 0.0, 1e-12)
    return float((a - b).abs().max()) / scale if a.numel() else 0.0


def differences(a: dict, b: dict) -> list[tuple[str, float]]:
    """(name, `rel_diff`) of each tensor of `a` (name -> tensor or None) that is not bitwise
    equal to `b`'s of that name, in `a`'s order: verify's comparison of gradients, and the
    library's check (run/verify/check.py). Tensors on two devices are compared on `a`'s."""
    out = []
    for name, x in a.items():
        y = b.get(name)
        if x is None and y is None:
            continue
        if x is None or y is None or x.shape != y.shape:
            out.append((name, float("inf")))
            continue
        y = y.to(x.device)
        if not torch.equal(x, y):
            out.append((name, rel_diff(x, y)))
    return out


def tolerances(dtype) -> tuple[float, float]:
    if dtype in (torch.float16, torch.bfloat16):
        return 1e-3, 1e-2
    return 1e-5, 1e-4


def device_type(model) -> str:
    """The device type autocast keys on: the model's first parameter's (as the profile's)."""
    return next(model.parameters()).device.type


def warmup_step(model, run) -> None:
    """One untimed step; weights, buffers, gradients and the RNG are put back afterwards."""
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


@dataclass
class Pair:
    """The original and the patched model of one verify run, ready to step."""
    mod: object                  # the patched module (apply's output), loaded
    meta: dict
    path: str                    # the workload
    entry: str
    args: dict
    device: str
    dev: object                  # load_workload's device (None: CPU)
    orig: object                 # the workloads (model, inputs, loss_fn)
    work: object
    patched: object              # mod.step_module(work.model)
    o_call: tuple                # (args, kwargs) of each model's inputs
    p_call: tuple
    opt_o: object
    opt_p: object
    loss_tol: float
    grad_tol: float

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    def run_original(self):
        a, kw = self.o_call
        with autocast_region(self.meta.get("autocast"), device_type(self.orig.model)):
            return loss_from_output(self.orig.model(*a, **kw), self.orig.inputs,
                                    self.orig.loss_fn)

    def run_patched(self):
        a, kw = self.p_call
        return self.patched(*a, **kw)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def start(self) -> int:
        """Synchronise and open a measurement: the allocated bytes it starts from (CUDA)."""
        self.sync()
        if not self.cuda:
            return 0
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()

    def peak(self, base: int, model, held_bytes: int) -> int:
        """After the step: CUDA peak over it less gradients, or the CPU bytes held for backward."""
        if not self.cuda:
            return held_bytes
        grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters()
                    if p.grad is not None)
        return torch.cuda.max_memory_allocated() - base - grads


def load_pair(patched_path: str, model_path: str | None, entry: str | None,
               args: dict | None, seed: int, check_trace: bool) -> Pair:
    """Load the patched module and two copies of its workload from the same weights."""
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
    try:
        patched = mod.step_module(work.model, check_trace=check_trace)
    except FingerprintMismatch as exc:     # a finding about the model, not a bad option
        raise ModelChanged(f"the model in {path} is not the one the plan was made for: "
                           f"{exc.message}", hint=exc.hint) from None
    p_call = split_inputs(work.inputs)
    o_call = split_inputs(orig.inputs)
    ref = next(iter(dict(orig.model.named_parameters()).values()))
    loss_tol, grad_tol = tolerances(ref.dtype)
    opt_o = torch.optim.SGD(orig.model.parameters(), lr=1e-3)
    opt_p = torch.optim.SGD(work.model.parameters(), lr=1e-3)
    return Pair(mod, meta, path, entry, args, device, dev, orig, work, patched, o_call, p_call,
                 opt_o, opt_p, loss_tol, grad_tol)


@dataclass
class Compared:
    """What the compared steps found, step by step and at worst."""
    losses_o: list = field(default_factory=list)
    losses_p: list = field(default_factory=list)
    peaks_o: list = field(default_factory=list)
    peaks_p: list = field(default_factory=list)
    times_o: list = field(default_factory=list)
    times_p: list = field(default_factory=list)
    max_loss: float = 0.0
    max_grad: float = 0.0
    worst_param: str = ""
    max_buf: float = 0.0
    offloaded: int = 0


def _step_original(s: Pair, seed: int, out: Compared):
    """One step of the original model, timed; its loss (memory: into `out`)."""
    orig = s.orig
    s.opt_o.zero_grad(set_to_none=True)
    exclude_o = [*orig.model.parameters(), *orig.model.buffers(),
                 *[x for x in pytree.tree_leaves(orig.inputs) if isinstance(x, torch.Tensor)]]
    base = s.start()
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    loss_o, held_o = saved_bytes_original(orig.model, orig.inputs, s.run_original, exclude_o)
    loss_o.backward()
    s.sync()
    out.times_o.append((time.perf_counter() - t0) * 1e3)
    out.peaks_o.append(s.peak(base, orig.model, held_o))
    return loss_o


def _step_patched(s: Pair, seed: int, out: Compared):
    """One step of the patched step module, timed; its loss (memory, copies: into `out`)."""
    s.opt_p.zero_grad(set_to_none=True)
    base = s.start()
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    loss_p = s.run_patched()
    held_p = s.patched.held_bytes_after_forward
    store = s.patched.last_store() if s.patched.last_store is not None else None
    out.offloaded = store.offloaded_bytes if store is not None else 0
    loss_p.backward()
    s.sync()
    out.times_p.append((time.perf_counter() - t0) * 1e3)
    out.peaks_p.append(s.peak(base, s.work.model, held_p))
    return loss_p


def _compare(s: Pair, loss_o, loss_p, out: Compared) -> None:
    """Losses, gradients and buffers of the two models after one step (worst into `out`)."""
    out.losses_o.append(float(loss_o.detach()))
    out.losses_p.append(float(loss_p.detach()))
    out.max_loss = max(out.max_loss, rel_diff(loss_o, loss_p))
    grads_o = {name: p.grad for name, p in s.orig.model.named_parameters()}
    grads_p = {name: p.grad for name, p in s.work.model.named_parameters()}
    for name, d in differences(grads_o, grads_p):
        if d > out.max_grad:
            out.max_grad, out.worst_param = d, name
    for (name, b), (_, b2) in zip(s.orig.model.named_buffers(), s.work.model.named_buffers()):
        if b.is_floating_point():
            out.max_buf = max(out.max_buf, rel_diff(b, b2))
        elif not torch.equal(b, b2):
            out.max_buf = max(out.max_buf, float("inf"))


def compare_steps(s: Pair, steps: int, seed: int) -> Compared:
    """`steps` SGD steps of both models from the same RNG state, compared after each."""
    out = Compared()
    for k in range(steps):
        loss_o = _step_original(s, seed + 1 + k, out)
        loss_p = _step_patched(s, seed + 1 + k, out)
        _compare(s, loss_o, loss_p, out)
        with torch.no_grad():
            s.opt_o.step()
            s.opt_p.step()
    return out


def value_reasons(s: Pair, c: Compared) -> list[str]:
    reasons = []
    if c.max_loss > s.loss_tol:
        reasons.append(f"loss differs by {c.max_loss:.2e} (relative), tolerance {s.loss_tol:g}")
    if c.max_grad > s.grad_tol:
        reasons.append(f"gradient of {c.worst_param} differs by {c.max_grad:.2e} (relative), "
                       f"tolerance {s.grad_tol:g}")
    if c.max_buf > s.grad_tol:
        reasons.append(f"buffers differ by {c.max_buf:.2e} (relative), tolerance {s.grad_tol:g}")
    return reasons
