"""End-to-end check on a real GPU: predicted vs measured memory and time of slackswap plans.

On a CUDA machine this script

1. profiles a GPT-2-medium-sized model (24 layers, d_model 1024, 16 heads, seq 1024; the
   pure-torch GPT of examples/tiny_gpt.py) with `--device cuda` (every op timed),
2. measures this GPU's pinned H2D / D2H bandwidth (one direction at a time, then both at
   once) and builds a HardwareSpec from the closest preset with those figures,
3. plans at budgets 0.3 / 0.5 / 0.7 of the keep-all activation peak (planner `slackswap`),
   applies each plan and verifies it (same losses and gradients as eager; measured peak and
   step time),
4. runs the baselines at the same budgets: `torch.utils.checkpoint` on every block (budget-free:
   one measurement) and `torch.compile` with `torch._functorch.config.activation_memory_budget`
   (failures are recorded, not fatal),
5. runs the in-place patch (`patch(model)`, what users train with) at the same budgets:
   plain, under FSDP2 on this one GPU (`fully_shard` on the blocks and the root, world size
   1), and with a plan from a `--device fake` profile (made as on a CPU-only machine: fake CPU
   tensors, roofline costs) applied on this device: losses against eager, how many of the
   profile's forward ops lined up, ops re-run, peak memory and step time,
6. runs the library API (`slackswap_cli.plan_model` profiling in this process, then
   `patch(model, plan)`) at the same budgets and at `budget="auto"` (the device's memory less
   parameters, gradients, AdamW state and fit's reserve; the dry run checks that "auto" is
   refused on a CPU): losses against eager, predicted vs measured peak,
7. runs `compile_planned(model)` (the plan inside torch.compile: inductor; aot_eager in the
   dry run) at the same budgets, beside the torch.compile activation_memory_budget rows of 4
   and the in-place rows of 5: predicted vs measured peak and step time, losses against
   eager, and the bytes the compiled graphs save and offload and the ops they recompute,
8. runs two patched steps (budget 0.3) in a process of their own under torch's CUDA sanitizer
   (`TORCH_CUDA_SANITIZER=1`: a race between the swap engine's streams raises), and records
   whether it reported one and whether the steps were bitwise equal to eager
   (slackswap_testkit/race_check.py; the dry run uses the emulated asynchronous device instead),
9. writes JSON (`--out`, default benchmarks/results/gpu_check.json): for every row, predicted
   vs measured peak activation memory and step time, and measured retention (eager keep-all
   step time / step time).

`--dry-run` does all of it on the CPU with a tiny model (memory there is the bytes held for
backward; bandwidth is a host memcpy), so the script is tested before any GPU time is spent.

    python benchmarks/gpu_check.py --out $OUT/gpu_check.json   # on a GPU machine (~5-9 min)
    python benchmarks/gpu_check.py --dry-run                   # anywhere, about a minute

Budget it: the torch.compile baselines compile for minutes each; once --time-limit-s
(default 420 s) is spent, the remaining ones are recorded as skipped.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from slackswap_cli.hardware import PRESETS  # noqa: E402
from slackswap_cli.planners import make_plan  # noqa: E402
from slackswap_cli.run.emit import apply_plan  # noqa: E402
from slackswap_cli.run.verify.memory import saved_bytes_original  # noqa: E402
from slackswap_cli.run.verify.verify import verify  # noqa: E402
from slackswap_cli.trace import profile_workload  # noqa: E402
from slackswap_cli.trace.joint import loss_from_output, split_inputs  # noqa: E402
from slackswap_cli.trace.workload import load_workload  # noqa: E402

WORKLOAD = ROOT / "examples" / "tiny_gpt.py"
GPT2_MEDIUM = {"n_layer": 24, "d_model": 1024, "n_head": 16, "seq": 1024, "batch": 2,
               "vocab": 50257, "dropout": 0.1}
TINY = {"n_layer": 2, "d_model": 64, "n_head": 4, "seq": 32, "batch": 2, "vocab": 128,
        "dropout": 0.1}


# --------------------------------------------------------------------------------------------
# Host link
# --------------------------------------------------------------------------------------------

def _planned(prof, hw, frac: float, peak: int, row: dict):
    """slackswap's plan at `frac` of the keep-all `peak`; its predictions go into `row`."""
    plan = make_plan("slackswap", prof, hw, int(frac * peak), frac)
    row.update({"feasible": plan.feasible, "predicted_peak_bytes": plan.predicted.peak_bytes,
                "predicted_step_us": plan.predicted.step_us,
                "predicted_retention": plan.predicted.retention})
    return plan

def measure_bandwidth(cuda: bool, size_bytes: int, repeats: int = 5) -> dict:
    """Pinned copy bandwidth in bytes/s: H2D, D2H, and each direction while both run."""
    n = size_bytes // 4
    if not cuda:  # dry run: a host memcpy stands in for the link (not used for planning)
        a, b = torch.empty(n), torch.empty(n)
        t0 = time.perf_counter()
        for _ in range(repeats):
            b.copy_(a)
        bw = size_bytes * repeats / (time.perf_counter() - t0)
        return {"h2d_bytes_per_s": bw, "d2h_bytes_per_s": bw, "duplex_each_bytes_per_s": bw,
                "size_bytes": size_bytes, "note": "cpu memcpy (dry run)"}
    host = torch.empty(n, pin_memory=True)
    host2 = torch.empty(n, pin_memory=True)
    dev = torch.empty(n, device="cuda")
    dev2 = torch.empty(n, device="cuda")
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def timed(fn):
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / repeats

    h2d = size_bytes / timed(lambda: dev.copy_(host, non_blocking=True))
    d2h = size_bytes / timed(lambda: host.copy_(dev, non_blocking=True))

    def both():
        with torch.cuda.stream(s1):
            dev.copy_(host, non_blocking=True)
        with torch.cuda.stream(s2):
            host2.copy_(dev2, non_blocking=True)

    each = size_bytes / timed(both)
    return {"h2d_bytes_per_s": h2d, "d2h_bytes_per_s": d2h, "duplex_each_bytes_per_s": each,
            "size_bytes": size_bytes}


def calibrated_hardware(cuda: bool, bw: dict):
    """The closest preset with this machine's measured host-link figures."""
    if not cuda:
        return PRESETS["a100-pcie4"]
    name = torch.cuda.get_device_name().lower()
    base = PRESETS["h200-pcie5"] if "h200" in name else PRESETS["h100-pcie5"] if "h100" in name \
        else PRESETS["gh200-c2c"] if "gh200" in name else PRESETS["a100-pcie4"]
    h2d, d2h = bw["h2d_bytes_per_s"], bw["d2h_bytes_per_s"]
    derate = min(1.0, max(0.05, bw["duplex_each_bytes_per_s"] / min(h2d, d2h)))
    return dataclasses.replace(
        base, name=f"{base.name}-measured", h2d_bytes_per_s=h2d, d2h_bytes_per_s=d2h,
        duplex=derate > 0.6, duplex_derate=round(derate, 3),
        memory_bytes=torch.cuda.get_device_properties(0).total_memory,
        description=f"{base.description}; host link measured on {torch.cuda.get_device_name()}",
        link_source=f"measured by benchmarks/gpu_check.py on {torch.cuda.get_device_name()} "
                    "(pinned copies one way at a time, then both at once)")


# --------------------------------------------------------------------------------------------
# Baselines
# --------------------------------------------------------------------------------------------
def _blocks(model: torch.nn.Module) -> torch.nn.ModuleList:
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    return max(lists, key=len)


def checkpoint_every_block(model: torch.nn.Module) -> None:
    from torch.utils.checkpoint import checkpoint
    for block in _blocks(model):
        forward = block.forward
        block.forward = (lambda f: (lambda *a, **k: checkpoint(f, *a, use_reentrant=False, **k)))(forward)


def measure_step(model, run, cuda: bool, steps: int, seed: int) -> dict:
    """Peak activation memory and fastest step time of `run()` (forward, returns the loss);
    `host_ms`: the fastest time the host took to issue the step (until backward returned,
    before waiting for the device), `gpu_ms` (CUDA): the fastest span of the step on the
    compute stream (CUDA events). host_ms near step_ms means the step is bound by Python."""
    # FSDP2 parameters are DTensors: their local shards are what exists on this rank
    exclude = [getattr(t, "_local_tensor", t) for t in (*model.parameters(), *model.buffers())]
    peaks, times, losses, host, gpu = [], [], [], [], []
    for k in range(steps + 1):        # step 0 warms up (and compiles)
        for p in model.parameters():
            p.grad = None
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        torch.manual_seed(seed + 1 + k)
        if cuda:
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
            ev[0].record()
        t0 = time.perf_counter()
        loss, held = saved_bytes_original(model, None, run, exclude)
        loss.backward()
        issued = (time.perf_counter() - t0) * 1e3
        if cuda:
            ev[1].record()
            torch.cuda.synchronize()
            gpu.append(ev[0].elapsed_time(ev[1]))
        dt = (time.perf_counter() - t0) * 1e3
        grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters()
                    if p.grad is not None)
        peak = torch.cuda.max_memory_allocated() - base - grads if cuda else held
        if k > 0:
            peaks.append(int(peak))
            times.append(dt)
            host.append(issued)
            losses.append(float(loss.detach()))
    return {"peak_bytes": max(peaks), "step_ms": min(times), "losses": losses,
            "host_ms": min(host), "gpu_ms": min(gpu[1:]) if gpu[1:] else None}


# --------------------------------------------------------------------------------------------
# The in-place patch: plain, under FSDP2 (world size 1), and a fake CPU profile's plan
# --------------------------------------------------------------------------------------------
def run_inplace(prof, hw, args: dict, fractions: list[float], cuda: bool, steps: int, seed: int,
                method: str, fsdp: bool = False) -> list[dict]:
    from slackswap_cli.run.emit import load_patched
    device = "cuda" if cuda else None
    peak = int(prof.summary["peak_activation_bytes"])
    rows = []
    if fsdp:
        import os

        import torch.distributed as dist
        if not dist.is_initialized():
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            if "MASTER_PORT" not in os.environ:   # a free port: another gloo group may hold one
                import socket
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", 0))
                    os.environ["MASTER_PORT"] = str(sock.getsockname()[1])
            dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    with tempfile.TemporaryDirectory() as tmp:
        for frac in fractions:
            row: dict = {"method": method, "budget_fraction": frac, "budget_bytes": int(frac * peak)}
            try:
                plan = _planned(prof, hw, frac, peak, row)
                path = Path(tmp) / f"inplace_{frac:g}.py"
                path.write_text(apply_plan(plan, prof, args=args))
                mod = load_patched(str(path))
                measured = {}
                for label in ("eager", "patched"):
                    work = load_workload(str(WORKLOAD), args=args, device=device)
                    model = work.model
                    if label == "patched":
                        mod.patch(model)
                        model.forward.__slackswap__.measure_held = not cuda
                    if fsdp:
                        from torch.distributed.fsdp import fully_shard
                        for b in _blocks(model):
                            fully_shard(b)
                        fully_shard(model)
                    a, kw = split_inputs(work.inputs)
                    held = []

                    def run():
                        out = loss_from_output(model(*a, **kw), work.inputs, work.loss_fn)
                        last = getattr(getattr(model.forward, "__slackswap__", None), "last_run", None)
                        if last is not None and not cuda:   # (CUDA: the allocator's peak)
                            held.append(last.held_device_bytes())
                        return out
                    m = measure_step(model, run, cuda, steps, seed)
                    if not cuda and held:
                        m["peak_bytes"] = max(held)     # CPU: bytes held for backward
                    last = getattr(getattr(model.forward, "__slackswap__", None), "last_run", None)
                    if last is not None:
                        m["steady_state"] = last.kind in ("steady", "keep_all")
                        m["ops_lined_up"] = len(last.rec_of_op)
                        m["profile_forward_ops"] = len(mod.TABLE["ops"])
                        m["ops_rerun"] = last.rerun_ops
                        m["roots_swapped"] = len(last.metas)
                    measured[label] = m
                e, p_ = measured["eager"], measured["patched"]
                row.update({"passed": e["losses"] == p_["losses"],
                            "max_loss_abs_diff": max(abs(x - y) for x, y in zip(e["losses"], p_["losses"])),
                            "measured_peak_bytes": p_["peak_bytes"], "eager_peak_bytes": e["peak_bytes"],
                            "measured_step_ms": p_["step_ms"], "eager_step_ms": e["step_ms"],
                            "measured_retention": e["step_ms"] / p_["step_ms"],
                            **_host_vs_device(e, p_),
                            **{k: p_[k] for k in ("ops_lined_up", "profile_forward_ops", "ops_rerun",
                                                  "roots_swapped", "steady_state") if k in p_}})
            except Exception as exc:
                row["error"] = _err(exc)
                row["traceback"] = traceback.format_exc().splitlines()[-6:]
            rows.append(row)
    return rows


# --------------------------------------------------------------------------------------------
# The library API: plan_model + patch in the training process
# --------------------------------------------------------------------------------------------
def run_library_api(hw, args: dict, fractions: list[float], cuda: bool, steps: int,
                    seed: int) -> list[dict]:
    """`slackswap_cli.plan_model(model, inputs, budget=...)` then `patch(model, plan)` on the
    model the script built: on CUDA profiled there with op times measured (device="auto"), on
    the dry run's CPU with fake tensors (fake:cpu). Rows at each budget fraction and at
    budget="auto" (CUDA: the device's memory less parameters, gradients and AdamW state, less
    fit's reserve; on the CPU it must be refused with a SlackswapError saying it needs CUDA)."""
    import slackswap_cli as slackswap
    from slackswap_cli.errors import InputError
    rows = []
    for budget in ["auto", *fractions]:
        row: dict = {"method": "slackswap-api", "budget_fraction": budget}
        try:
            if budget == "auto" and not cuda:
                try:
                    slackswap.plan_model(*_api_twins(args, None)[1], budget="auto")
                    row.update(passed=False, error="budget='auto' on the CPU was not refused")
                except InputError as exc:
                    row.update(passed="needs a CUDA device" in exc.message, refused=exc.message)
                rows.append(row)
                continue
            eager, (model, inputs) = _api_twins(args, "cuda" if cuda else None)
            plan = slackswap.plan_model(model, inputs, budget=budget, hardware=hw)
            row.update({"budget_bytes": plan.budget_bytes, "feasible": plan.feasible,
                        "time_source": plan.profile.summary.get("time_source"),
                        "profiled_on": plan.profile.env.get("device"),
                        "predicted_peak_bytes": plan.predicted.peak_bytes,
                        "predicted_retention": plan.predicted.retention,
                        "actions": plan.actions()})
            if budget == "auto":      # within 64 MiB of the figure made by hand
                row.update(_auto_budget_check(model, inputs))
                row["auto_budget_ok"] = (0 < plan.budget_bytes and abs(
                    plan.budget_bytes - row["auto_budget_by_hand"]) <= 64 << 20)
            slackswap.patch(model, plan)
            model.forward.__slackswap__.measure_held = not cuda
            e, p_ = (_api_measure(m, inputs, cuda, steps, seed) for m in (eager[0], model))
            row.update({"passed": plan.feasible and e["losses"] == p_["losses"]
                        and row.get("auto_budget_ok", True),
                        "measured_peak_bytes": p_["peak_bytes"], "eager_peak_bytes": e["peak_bytes"],
                        "measured_step_ms": p_["step_ms"], "eager_step_ms": e["step_ms"]})
        except Exception as exc:
            row["error"] = _err(exc)
            row["traceback"] = traceback.format_exc().splitlines()[-6:]
        rows.append(row)
    return rows


def _api_measure(model, inputs, cuda: bool, steps: int, seed: int) -> dict:
    """measure_step of `model` on `inputs`; on the CPU a patched model's peak is the bytes its
    run held for backward (as run_inplace measures it)."""
    a, kw = split_inputs(inputs)
    held = []

    def run():
        out = loss_from_output(model(*a, **kw), inputs, None)
        last = getattr(getattr(model.forward, "__slackswap__", None), "last_run", None)
        if last is not None and not cuda:
            held.append(last.held_device_bytes())
        return out
    m = measure_step(model, run, cuda, steps, seed)
    if held:
        m["peak_bytes"] = max(held)
    return m


def _api_twins(args: dict, device):
    """((eager model, inputs), (model, inputs)): two copies of the workload, same weights."""
    a = load_workload(str(WORKLOAD), args=args, device=device)
    b = load_workload(str(WORKLOAD), args=args, device=device)
    b.model.load_state_dict(a.model.state_dict())
    return (a.model, a.inputs), (b.model, b.inputs)


def _auto_budget_check(model, inputs) -> dict:
    """budget="auto" on CUDA, recomputed here from its parts: the device's total less what
    other processes hold, the static memory with AdamW, and fit's default reserve."""
    from slackswap_cli.fit import default_reserve, static_memory
    from slackswap_cli.trace.static_memory import model_facts
    free, total = torch.cuda.mem_get_info()
    static = static_memory(model_facts(model, inputs), "adamw")
    others = max(0, total - free - torch.cuda.memory_reserved())
    return {"device_total_bytes": total, "device_free_bytes": free, "others_bytes": others,
            "static_bytes": static.total, "reserve_bytes": default_reserve(total),
            "auto_budget_by_hand": total - others - static.total - default_reserve(total)}


def _host_vs_device(eager: dict, patched: dict) -> dict:
    """Is the patched step bound by Python (host time per step against device time per step),
    and the retention with the patch's extra host time taken out (an estimate: the measured
    step less the host time the patch adds over eager)."""
    extra = max(0.0, patched["host_ms"] - eager["host_ms"])
    return {"host_ms_per_step": patched["host_ms"], "eager_host_ms_per_step": eager["host_ms"],
            "gpu_ms_per_step": patched["gpu_ms"], "eager_gpu_ms_per_step": eager["gpu_ms"],
            "host_over_gpu": (patched["host_ms"] / patched["gpu_ms"]) if patched["gpu_ms"] else None,
            "patch_host_overhead_ms": extra,
            "retention_without_patch_overhead":
                eager["step_ms"] / max(patched["step_ms"] - extra, 1e-9)}


def run_baselines(args: dict, fractions: list[float], cuda: bool, steps: int, seed: int,
                  eager_ms: float, peak_keep_all: int, deadline: float = float("inf")) -> list[dict]:
    device = "cuda" if cuda else None
    rows = []

    def load():
        torch.manual_seed(seed)
        return load_workload(str(WORKLOAD), "workload", args, device=device)

    try:
        w = load()
        checkpoint_every_block(w.model)
        a, kw = split_inputs(w.inputs)
        m = measure_step(w.model, lambda: loss_from_output(w.model(*a, **kw), w.inputs, w.loss_fn),
                         cuda, steps, seed)
        rows.append({"method": "torch.utils.checkpoint (every block)", "budget_fraction": None,
                     "measured_peak_bytes": m["peak_bytes"], "measured_step_ms": m["step_ms"],
                     "measured_retention": eager_ms / m["step_ms"],
                     "note": None if cuda else "cpu: saved_tensors_hooks miss what checkpoint "
                                                "stores itself (block inputs)"})
        del w
    except Exception as exc:
        rows.append({"method": "torch.utils.checkpoint (every block)", "error": _err(exc)})
    import torch._functorch.config as fconfig
    backend = "inductor" if cuda else "aot_eager_decomp_partition"
    for frac in fractions:
        row = {"method": f"torch.compile ({backend}) activation_memory_budget",
               "budget_fraction": frac, "budget_bytes": int(frac * peak_keep_all)}
        if time.perf_counter() > deadline:
            row["error"] = "skipped: --time-limit-s reached (compiling takes minutes)"
            rows.append(row)
            continue
        try:
            torch._dynamo.reset()
            w = load()
            a, kw = split_inputs(w.inputs)
            compiled = torch.compile(w.model, backend=backend)
            with fconfig.patch(activation_memory_budget=frac):
                m = measure_step(w.model, lambda: loss_from_output(compiled(*a, **kw), w.inputs,
                                                                   w.loss_fn), cuda, steps, seed)
            row.update({"measured_peak_bytes": m["peak_bytes"], "measured_step_ms": m["step_ms"],
                        "measured_retention": eager_ms / m["step_ms"], "losses": m["losses"]})
            if not cuda:
                row["note"] = "cpu: compiled graphs save through autograd.Function; bytes from hooks"
            del w, compiled
        except Exception as exc:
            row["error"] = _err(exc)
        rows.append(row)
    return rows


def run_compile_planned(prof, hw, args: dict, fractions: list[float], cuda: bool, steps: int,
                        seed: int, eager_ms: float, deadline: float = float("inf")) -> list[dict]:
    """`compile_planned(model)` (the plan inside torch.compile; inductor on CUDA, aot_eager in
    the dry run: inductor on a CPU compiles for minutes) at each budget: predicted vs measured
    peak and step time, losses against eager, and what the compiled graphs save, offload and
    recompute (run/compiled/report.py's reports)."""
    from slackswap_cli.run.compiled.report import totals
    from slackswap_cli.run.emit import load_patched
    device = "cuda" if cuda else None
    backend = "inductor" if cuda else "aot_eager"
    peak = int(prof.summary["peak_activation_bytes"])
    w = load_workload(str(WORKLOAD), args=args, device=device)
    a, kw = split_inputs(w.inputs)
    eager = measure_step(w.model, lambda: loss_from_output(w.model(*a, **kw), w.inputs,
                                                           w.loss_fn), cuda, steps, seed)
    del w
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for frac in fractions:
            row: dict = {"method": f"slackswap compile_planned ({backend})",
                         "budget_fraction": frac, "budget_bytes": int(frac * peak)}
            if time.perf_counter() > deadline:
                row["error"] = "skipped: --time-limit-s reached (compiling takes minutes)"
                rows.append(row)
                continue
            try:
                plan = _planned(prof, hw, frac, peak, row)
                path = Path(tmp) / f"compiled_{frac:g}.py"
                path.write_text(apply_plan(plan, prof, args=args))
                torch._dynamo.reset()
                w = load_workload(str(WORKLOAD), args=args, device=device)
                compiled = load_patched(str(path)).compile_planned(w.model, backend=backend,
                                                                   quiet=True)
                a, kw = split_inputs(w.inputs)
                m = measure_step(w.model, lambda: loss_from_output(compiled(*a, **kw), w.inputs,
                                                                   w.loss_fn), cuda, steps, seed)
                t = totals(compiled._slackswap_partitions)
                del t["lined_up_rows"]
                row.update({"measured_peak_bytes": m["peak_bytes"], "measured_step_ms": m["step_ms"],
                            "eager_step_ms": eager["step_ms"], "eager_peak_bytes": eager["peak_bytes"],
                            "measured_retention": eager_ms / m["step_ms"],
                            "losses": m["losses"], "eager_losses": eager["losses"],
                            "max_loss_abs_diff": max(abs(x - y) for x, y in
                                                     zip(m["losses"], eager["losses"])),
                            "compiled": t})
                # inductor fuses: fp32 within 1e-5 relative; aot_eager runs eager's ops
                tol = 1e-5 * max(abs(x) for x in eager["losses"]) if cuda else 0.0
                row["passed"] = row["max_loss_abs_diff"] <= tol
                del w, compiled
            except Exception as exc:
                row["error"] = _err(exc)
                row["traceback"] = traceback.format_exc().splitlines()[-6:]
            rows.append(row)
    return rows


def run_race_check(prof, hw, args: dict, cuda: bool, frac: float = 0.3) -> dict:
    """slackswap_testkit/race_check.py: two patched steps at `frac` of the keep-all peak, in a
    process of their own under torch's CUDA sanitizer (on the CPU: the emulated device);
    whether it reported a race, and the steps against eager."""
    from slackswap_testkit import race_check
    peak = int(prof.summary["peak_activation_bytes"])
    row: dict = {"budget_fraction": frac, "budget_bytes": int(frac * peak)}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            plan = _planned(prof, hw, frac, peak, row)
            path = Path(tmp) / "race_check.py"
            path.write_text(apply_plan(plan, prof, args=args))
            return {**row, **race_check.run(path, Path(tmp) / "race.json", args, cuda)}
        except Exception as exc:
            return {"method": "race-check", **row, "error": _err(exc)}


def _err(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"


# --------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny model on the CPU")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu_check.json"))
    ap.add_argument("--budgets", default="0.3,0.5,0.7")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-baselines", action="store_true")
    ap.add_argument("--time-limit-s", type=float, default=420.0,
                    help="skip the remaining torch.compile baselines once this much time is spent")
    opts = ap.parse_args(argv)
    cuda = not opts.dry_run
    if cuda and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run to check the script on the CPU", file=sys.stderr)
        return 2
    fractions = [float(x) for x in opts.budgets.split(",")]
    args = TINY if opts.dry_run else GPT2_MEDIUM
    t_start = time.perf_counter()
    result: dict = {"dry_run": opts.dry_run, "workload": str(WORKLOAD.relative_to(ROOT)),
                    "workload_args": args, "torch": torch.__version__,
                    "device": torch.cuda.get_device_name() if cuda else platform.machine(),
                    "rows": []}

    def say(msg):
        print(f"[{time.perf_counter() - t_start:7.1f}s] {msg}", file=sys.stderr, flush=True)

    say("measuring the host link")
    bw = measure_bandwidth(cuda, (256 << 20) if cuda else (16 << 20))
    hw = calibrated_hardware(cuda, bw)
    result["bandwidth"] = bw
    result["hardware"] = hw.to_dict()
    say(f"profiling ({'cuda' if cuda else 'cpu'}, measured)")
    prof = profile_workload(str(WORKLOAD), args=args, device="cuda" if cuda else "cpu")
    peak = int(prof.summary["peak_activation_bytes"])
    result["profile"] = {"fingerprint": prof.fingerprint, "n_ops": prof.summary["n_ops"],
                         "peak_activation_bytes": peak, "saved_bytes": prof.summary["saved_bytes"],
                         "forward_us": prof.summary["forward_us"],
                         "backward_us": prof.summary["backward_us"],
                         "measured_step_us": prof.summary.get("measured_step_us")}
    eager_ms = None
    with tempfile.TemporaryDirectory() as tmp:
        for frac in [1.0, *fractions]:
            budget = int(frac * peak)
            row: dict = {"method": "slackswap", "budget_fraction": frac, "budget_bytes": budget}
            try:
                say(f"planning at {frac:g}")
                plan = make_plan("slackswap", prof, hw, budget, frac)
                row.update({"feasible": plan.feasible, "solve_ms": plan.solve_ms,
                            "predicted_peak_bytes": plan.predicted.peak_bytes,
                            "predicted_step_us": plan.predicted.step_us,
                            "predicted_ideal_us": plan.predicted.ideal_us,
                            "predicted_retention": plan.predicted.retention,
                            "actions": {a: sum(1 for d in plan.decisions if d.action == a)
                                        for a in ("keep", "swap", "recompute")}})
                path = Path(tmp) / f"patched_{frac:g}.py"
                path.write_text(apply_plan(plan, prof))
                say(f"verifying at {frac:g}")
                # apply just compared the model's trace with the profile: skip the re-trace
                r = verify(str(path), steps=opts.steps, seed=opts.seed, check_trace=False)
                if frac == 1.0:
                    eager_ms = r.original_step_ms
                row.update({"passed": r.passed, "reasons": r.reasons,
                            "max_loss_rel_diff": r.max_loss_rel_diff,
                            "max_grad_rel_diff": r.max_grad_rel_diff,
                            "memory_metric": r.memory_metric,
                            "measured_peak_bytes": r.patched_peak_bytes,
                            "eager_peak_bytes": r.original_peak_bytes,
                            "measured_step_ms": r.patched_step_ms,
                            "eager_step_ms": r.original_step_ms,
                            "measured_retention": (eager_ms or r.original_step_ms) / r.patched_step_ms,
                            "swapped_bytes_per_step": r.swapped_bytes_per_step})
            except Exception as exc:
                row["error"] = _err(exc)
                row["traceback"] = traceback.format_exc().splitlines()[-6:]
            result["rows"].append(row)
    say("in place: patch(model), plain and under FSDP2 (world size 1)")
    result["rows"] += run_inplace(prof, hw, args, fractions, cuda, opts.steps, opts.seed,
                                  "slackswap-inplace")
    result["rows"] += run_inplace(prof, hw, args, fractions, cuda, opts.steps, opts.seed,
                                  "slackswap-inplace-fsdp2", fsdp=True)
    say("in place with a plan from a --device fake profile (as made on a CPU-only machine)")
    fake_prof = profile_workload(str(WORKLOAD), args=args, device="fake", hardware=hw)
    result["rows"] += run_inplace(fake_prof, hw, args, fractions, cuda, opts.steps, opts.seed,
                                  "slackswap-inplace-fake-cpu-profile")
    say("race check: one patched step under "
        + ("torch's CUDA sanitizer" if cuda else "the emulated asynchronous device"))
    result["rows"].append(run_race_check(prof, hw, args, cuda))
    say("the library API: plan_model + patch in this process (budget fractions and 'auto')")
    result["rows"] += run_library_api(hw, args, fractions, cuda, opts.steps, opts.seed)
    say("compile_planned: the plan inside torch.compile")
    result["rows"] += run_compile_planned(prof, hw, args, fractions, cuda, opts.steps, opts.seed,
                                          eager_ms or 1.0, deadline=t_start + opts.time_limit_s)
    if not opts.no_baselines:
        say("baselines: checkpoint every block, torch.compile activation_memory_budget")
        result["rows"] += run_baselines(args, fractions, cuda, opts.steps, opts.seed,
                                        eager_ms or 1.0, peak,
                                        deadline=t_start + opts.time_limit_s)
    result["wall_s"] = round(time.perf_counter() - t_start, 1)
    out = Path(opts.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str))
    say(f"wrote {out}")
    failed = [r for r in result["rows"] if r["method"].startswith(("slackswap", "race-check"))
              and (r.get("error") or not r.get("passed", False))]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
