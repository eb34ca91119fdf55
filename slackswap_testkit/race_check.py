"""Patched training steps checked for races between the swap engine's streams, for
benchmarks/gpu_check.py: on CUDA under torch's CUDA sanitizer (`TORCH_CUDA_SANITIZER=1`, which
enables `torch.cuda._sanitizer` when torch is imported: every kernel's reads and writes checked
against the streams' events and waits; a race raises `CUDASanitizerErrors`), on the CPU
(`--dry-run`) under the emulated asynchronous device (slackswap_testkit/emulated_device.py). The
step runs in a process of its own (the sanitizer stays on for the life of a process) and is
also compared with eager, bit for bit.

    python -m slackswap_testkit.race_check PATCHED_MODULE OUT_JSON '{"n_layer": 2, ...}' [--cuda]

is what gpu_check runs in that process; `run` starts it and returns gpu_check's row.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKLOAD = ROOT / "examples" / "tiny_gpt.py"
STEPS = 2


def run(patched: Path, out: Path, args: dict, cuda: bool, timeout_s: float = 300) -> dict:
    """gpu_check's row: which checker ran, whether it reported a race, whether the step was
    bitwise equal to eager."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if cuda:
        env["TORCH_CUDA_SANITIZER"] = "1"
    row = {"method": "race-check",
           "checker": "torch.cuda._sanitizer (TORCH_CUDA_SANITIZER=1)" if cuda
           else "emulated asynchronous device (slackswap_testkit/emulated_device.py)"}
    cmd = [sys.executable, "-m", "slackswap_testkit.race_check", str(patched), str(out),
           json.dumps(args)] + (["--cuda"] if cuda else [])
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s,
                           cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {**row, "error": f"timed out after {timeout_s:g} s"}
    if p.returncode != 0 or not out.exists():
        return {**row, "error": f"exit {p.returncode}: {p.stderr.strip()[-600:]}"}
    got = json.loads(out.read_text())
    row.update(got)
    row["passed"] = got["bitwise"] and not got["race_reported"]
    return row


def _step(patched: str, out: str, args: dict, cuda: bool) -> None:
    import contextlib

    import torch

    from slackswap_cli.run.emit import load_patched
    from slackswap_cli.trace.workload import load_workload
    device = "cuda" if cuda else None
    twin, work = (load_workload(str(WORKLOAD), args=args, device=device) for _ in range(2))
    work.model.load_state_dict(twin.model.state_dict())
    model = load_patched(patched).patch(work.model)
    got: dict = {"steps": STEPS, "race_reported": False, "report": None}

    def steps(m, w):
        opt = torch.optim.AdamW(w.model.parameters(), lr=1e-2)
        torch.manual_seed(1)
        losses = []
        for _ in range(STEPS):
            loss = m(*w.inputs)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach().clone())
        if cuda:
            torch.cuda.synchronize()
        return losses, [p.detach().clone() for p in w.model.parameters()]
    want = steps(twin.model, twin)
    if cuda:
        ctx = contextlib.nullcontext()
    else:
        from slackswap_testkit.emulated_device import emulated_device
        ctx = emulated_device()
    try:
        with ctx as dev:
            have = steps(model, work)
    except Exception as exc:       # the sanitizer's CUDASanitizerErrors, or a kernel's error
        got.update(race_reported=type(exc).__name__ == "CUDASanitizerErrors",
                   report=f"{type(exc).__name__}: {exc}"[:2000], bitwise=False)
    else:
        got["bitwise"] = all(torch.equal(a, b) for x, y in zip(want, have)
                             for a, b in zip(x, y))
        run_ = model.forward.__slackswap__.last_run
        got["swaps"] = len(run_.swaps)
        if dev is not None:
            got["emulated"] = {"copies": dev.stats.copies, "poisoned": dict(dev.stats.poisoned)}
            got["race_reported"] = bool(dev.stats.poisoned)
    Path(out).write_text(json.dumps(got))


if __name__ == "__main__":
    a = sys.argv[1:]
    _step(a[0], a[1], json.loads(a[2]), "--cuda" in a[3:])
