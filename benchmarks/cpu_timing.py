"""What the CPU step-time benchmarks share (`vs_torch_compile_cpu.py`, `fidelity.py --step-time`).

- `MODELS` / `QUICK`: the tiny GPT (4 layers x 256 wide, seq 256, no dropout, so attention runs
  CPU flash attention) and a small Hugging Face Llama (config class, as many key/value heads as
  heads), fp32; `QUICK` is a smaller pair for a smoke run.
- `cpu_hardware()`: a hardware file of this CPU on one thread: a fp32 matmul's FLOP/s and a
  copy's bytes/s measured here, and the host link at the least a hardware file allows
  (1e3 B/s each way), so no plan swaps: every plan is keep / recompute only. Profiles are
  `--device cpu` (each op timed on this CPU), so the roofline figures are not what costs them.
- `one_thread()`: torch (and inductor's compile workers) on one thread.
- `profile_and_plan()`: the profile and slackswap's plans at fractions of its keep-all peak.
- `stepper()`: one training step of a model (compiled or patched) as a call;
- `paired()`: interleaved rounds, order rotated each round, thread CPU time per call;
  `ratio_stats()`: median and quartiles of the per-round ratio of two of them.

Timing on a shared 2-core machine: `time.thread_time` counts only this thread's CPU time
(another process's load does not add to it, cache and memory-bandwidth contention still can),
and a ratio is taken within one round, where both sides ran back to back.
"""
from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
EX = ROOT / "examples"

MODELS = {
    "tiny-gpt": (EX / "tiny_gpt.py", dict(n_layer=4, d_model=256, n_head=4, seq=256, batch=2,
                                          vocab=512, dropout=0.0)),
    "llama": (EX / "llama_7b.py", dict(n_layer=4, hidden=256, n_head=4, intermediate=688,
                                       vocab=512, seq=256, batch=2, dtype="float32")),
}
QUICK = {
    "tiny-gpt": (EX / "tiny_gpt.py", dict(n_layer=2, d_model=64, n_head=4, seq=64, batch=2,
                                          vocab=128, dropout=0.0)),
    "llama": (EX / "llama_7b.py", dict(n_layer=2, hidden=64, n_head=4, intermediate=172,
                                       vocab=128, seq=64, batch=2, dtype="float32")),
}
BUDGETS = (0.3, 0.5, 0.7)


def one_thread() -> None:
    import torch
    torch.set_num_threads(1)
    try:
        import torch._inductor.config as inductor_config
        inductor_config.compile_threads = 1
    except ImportError:  # pragma: no cover
        pass


def _best_thread_time(fn: Callable[[], object], repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.thread_time()
        fn()
        best = min(best, time.thread_time() - t0)
    return best


def cpu_hardware():
    """A `HardwareSpec` of this CPU on one thread, host link at its minimum (see the module
    docstring)."""
    import torch

    from slackswap_cli.hardware import HardwareSpec
    one_thread()
    n = 512
    a, b = torch.randn(n, n), torch.randn(n, n)
    flops = 2 * n ** 3 / _best_thread_time(lambda: a @ b)
    x = torch.empty(8 * 2 ** 20)
    y = torch.empty_like(x)
    bandwidth = 2 * x.numel() * 4 / _best_thread_time(lambda: y.copy_(x))
    z = torch.ones(4)
    overhead_us = _best_thread_time(lambda: [z.add(z) for _ in range(1000)]) * 1e3
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return HardwareSpec(
        name="this-cpu-1-thread", peak_flops_per_s=flops, matmul_efficiency=1.0,
        hbm_bytes_per_s=bandwidth, hbm_efficiency=1.0, memory_bytes=int(memory),
        h2d_bytes_per_s=1e3, d2h_bytes_per_s=1e3, copy_latency_us=10.0, duplex=False,
        duplex_derate=1.0, kernel_overhead_us=overhead_us,
        description="measured on this CPU, one thread, fp32; host link at the least a hardware "
                    "file allows, so no plan swaps")


def profile_and_plan(path: Path, args: dict, hw, fractions, *, planner: str = "slackswap"):
    """The `--device cpu` profile of `path` (ops timed on this CPU) and, per fraction of its
    keep-all peak, the plan."""
    from slackswap_cli.planners import make_plan
    from slackswap_cli.trace import profile_workload
    prof = profile_workload(str(path), args=dict(args), device="cpu", hardware=hw)
    peak = prof.summary["peak_activation_bytes"]
    plans = {f: make_plan(planner, prof, hw, int(peak * f), f) for f in fractions}
    return prof, plans


def load_patched(plan, prof, path: Path, name: str):
    """The module `apply_plan` emits for `plan`, written to `path` and imported as `name`."""
    import importlib.util

    from slackswap_cli.run.emit import apply_plan
    path.write_text(apply_plan(plan, prof))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def stepper(f, model, work) -> Callable[[], None]:
    """One training step of `f` (the model, compiled or patched) on the workload's inputs:
    forward, loss, backward, `model`'s grads set to None."""
    from slackswap_cli.trace.joint import loss_from_output, split_inputs
    a, kw = split_inputs(work.inputs)

    def step():
        loss_from_output(f(*a, **kw), work.inputs, work.loss_fn).backward()
        for p in model.parameters():
            p.grad = None
    return step


def paired(fns: dict[str, Callable[[], object]], rounds: int, *, warmup: int = 2,
           calls: int = 1) -> dict[str, list[float]]:
    """Thread CPU seconds of `calls` calls of each fn per round, `rounds` rounds, every fn
    once per round, the order rotated by one each round (after `warmup` untimed rounds)."""
    import gc
    names = list(fns)
    out: dict[str, list[float]] = {k: [] for k in names}
    for r in range(warmup + rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for k in order:
            gc.collect()
            gc.disable()
            t0 = time.thread_time()
            for _ in range(calls):
                fns[k]()
            dt = time.thread_time() - t0
            gc.enable()
            if r >= warmup:
                out[k].append(dt)
    return out


def ratio_stats(num: list[float], den: list[float]) -> dict:
    """Median and quartiles of the per-round ratio num[i] / den[i]."""
    ratios = [a / b for a, b in zip(num, den)]
    q = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else ratios * 3
    return {"median": statistics.median(ratios), "q1": q[0], "q3": q[2], "rounds": len(ratios)}


def fmt_ratio(s: dict) -> str:
    return f"{s['median']:.3f} [{s['q1']:.3f}-{s['q3']:.3f}]"
