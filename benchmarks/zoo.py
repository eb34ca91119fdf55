"""The model zoo: does slackswap train the models people bring bitwise equal to eager, or refuse
them plainly? Like torch.compile's expected-accuracy files, one row per model.

Each model (benchmarks/zoo_models.py: timm, one per family; Hugging Face transformers, every
causal LM, masked LM, seq2seq, image and audio classifier and CTC model whose config builds
offline at a tiny size; diffusers UNets and diffusion transformers; torchvision classifiers),
in training mode with dropout on, goes the library user's way:

    plan = plan_model(model, inputs, budget=0.5, device="fake:cpu")  # InfeasibleError: the
    patch(model, plan)                    # first feasible budget above the floor instead
    5 AdamW steps, patched, against an eager deep copy from the same RNG state

then the same model again, fresh, under `planner="recompute-only"` at its first feasible
budget (the `rc_` columns: recompute exercised on real models), and gets a status: `pass` (losses and gradients of all five steps bitwise equal), `refused`
(a SlackswapError: the reason recorded; where the refusal's hint is to profile for real, as
for a data-dependent step, the zoo follows it: `plan_model(..., device="cpu")`, and the row
is `pass-real` when that plan trains bitwise, the fake refusal kept in its detail) or `fail` (numbers differ: the largest difference; or
any other exception, a crash, a timeout: the message). `skipped`: the library itself cannot
build or run the model at the zoo's tiny size (counted apart, listed in the summary).

Columns: library, model, status, bitwise, max_diff (largest |patched - eager| over losses and
gradients), budget (fraction of the keep-all peak planned for), held_budget (bytes held for
backward after the first patched forward / the plan's budget), keep_swap_recompute (the
plan's saved activations by action), plan_s (plan_model's seconds),
step_ratio (patched / eager seconds of steps 2-3), first_steady (the first of the 5 calls
from which none was recorded: `last_report["recorded"]`), steady_ratio (patched / eager CPU
seconds of a training step, each side's fastest of 8 interleaved steps after the 5 compared,
one thread: `_steady_ratio`; empty when no call was steady or a timed one recorded), rc_status, rc_budget, rc_keep_swap_recompute,
rc_first_steady, rc_steady_ratio (the recompute-only run's), seconds, cpu_s, detail, rc_detail. Ops are priced
with 2 us a kernel (slackswap_testkit/small_costs.py): on the fitted ~10 us the zoo's tiny
models would swap all they do not keep, and the recompute path would go untested.

Models run in worker processes (--jobs, one torch thread each), one after another in each; a
model that hangs past --timeout or kills its worker is a `fail` and a new worker takes the
next. Rows are written as they come, and sorted at the end. seconds: wall time of the model's
whole check (build, plan, ten compared steps and sixteen timed ones; again for recompute-only); cpu_s: the worker's CPU time for it, which a shared
machine does not inflate.

    python benchmarks/zoo.py                        # all; writes benchmarks/results/zoo.csv, .md
    python benchmarks/zoo.py --library timm --only resnet18,mixer_s16_224 --out /tmp/zoo
    python benchmarks/zoo.py --resume               # only models with no row yet
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import zoo_models  # noqa: E402

COLUMNS = ("library", "model", "status", "bitwise", "max_diff", "budget", "held_budget",
           "keep_swap_recompute", "plan_s", "step_ratio", "first_steady", "steady_ratio",
           "rc_status", "rc_budget", "rc_keep_swap_recompute", "rc_first_steady",
           "rc_steady_ratio", "seconds", "cpu_s", "detail", "rc_detail")
STEPS = 5
TIMED = 8        # interleaved steps timed after the compared ones (`steady_ratio`)
RECOMPUTE = "recompute-only"     # the second run's planner, at its first feasible budget
BUDGET = 0.5
RESULT = "ZOO-RESULT "


# -- one model (in the worker) ------------------------------------------------------------------

def check(library: str, name: str) -> dict:
    """`check_model`'s row, any exception it raises a `fail` with its message."""
    from slackswap_testkit.small_costs import small_model_costs
    try:
        with small_model_costs():      # plans that recompute as well as swap (its docstring)
            return check_model(library, name)
    except _Differs as exc:
        return {"status": "fail", "detail": str(exc)}
    except Exception as exc:
        return {"status": "fail", "detail": _one_line(exc)}


def check_model(library: str, name: str) -> dict:
    """Plan, patch and train one model against its eager twin; the row (without timing)."""
    from slackswap_cli.errors import SlackswapError
    try:
        model, inputs, loss_fn = zoo_models.build(library, name)
    except zoo_models.BuildError as exc:
        return {"status": "skipped", "detail": str(exc)}
    twin = _deepcopy(model)
    row: dict = {}
    try:
        plan, row["budget"], row["plan_s"] = _plan(model, inputs, loss_fn)
    except SlackswapError as exc:
        if not follows_hint(exc):
            return {"status": "refused", "detail": _one_line(exc)}
        row["detail"] = f"fake trace: {_one_line(exc)}"[:400]
        try:        # the hint followed: the real profile, on this CPU
            plan, row["budget"], row["plan_s"] = _plan(model, inputs, loss_fn, "cpu")
        except SlackswapError as again:
            return {"status": "refused", "detail": f"--device cpu too: {_one_line(again)}"}
    real = "detail" in row
    try:
        row.update(_patched_run(model, twin, plan, inputs, loss_fn))
    except SlackswapError as exc:
        where = "--device cpu too: " if real else ""
        return {**row, "status": "refused", "detail": where + _one_line(exc)}
    diff = row["max_diff"]
    row["status"] = ("pass-real" if real else "pass") if diff == 0.0 else "fail"
    if diff != 0.0:
        row["detail"] = (f"losses or gradients differ from eager by up to {diff:.3g}"
                         + (" (profiled --device cpu)" if real else ""))
    row.update(recompute_run(library, name, plan, "cpu" if real else "fake:cpu"))
    return row


def _patched_run(model, twin, plan, inputs, loss_fn) -> dict:
    """Patch `model` with `plan` and train it against `twin`: the row's figures."""
    import slackswap_cli as slackswap
    slackswap.patch(model, plan)
    got = _train_both(twin, model, inputs, loss_fn)
    acts = plan.actions()
    return {**got, "bitwise": got["max_diff"] == 0.0,
            "keep_swap_recompute": f"{acts['keep']}/{acts['swap']}/{acts['recompute']}"}


def recompute_run(library: str, name: str, plan, device: str) -> dict:
    """The model again, fresh, under the recompute-only planner at its first feasible budget
    (on `plan`'s profile, traced on `device`): the rc_ columns. Recompute gets exercised on
    real models: the default planner recomputes in few of them at the zoo's sizes."""
    from slackswap_cli.budget import first_feasible_budget
    from slackswap_cli.errors import SlackswapError
    from slackswap_cli.hardware import load_hardware
    prof = plan.profile
    first = first_feasible_budget(prof, load_hardware(None), RECOMPUTE)
    if first is None:
        return {"rc_status": "refused", "rc_detail": f"{RECOMPUTE} fits no budget"}
    model, inputs, loss_fn = zoo_models.build(library, name)
    twin = _deepcopy(model)
    import slackswap_cli as slackswap
    try:
        rc = slackswap.plan_model(model, inputs, budget=int(first), device=device,
                                  loss_fn=loss_fn, planner=RECOMPUTE)
        got = _patched_run(model, twin, rc, inputs, loss_fn)
    except SlackswapError as exc:
        return {"rc_status": "refused", "rc_detail": _one_line(exc)}
    except _Differs as exc:
        return {"rc_status": "fail", "rc_detail": str(exc)}
    except Exception as exc:          # (the first run's row stands: this run's fail apart)
        return {"rc_status": "fail", "rc_detail": _one_line(exc)}
    out = {f"rc_{k}": got[k] for k in ("keep_swap_recompute", "first_steady", "steady_ratio")}
    out.update(rc_budget=first / prof.keep_all_peak_bytes,
               rc_status="pass" if got["max_diff"] == 0.0 else "fail")
    if got["max_diff"] != 0.0:
        out["rc_detail"] = f"losses or gradients differ from eager by up to {got['max_diff']:.3g}"
    return out


def follows_hint(exc) -> bool:
    """Is `exc` a fake trace's refusal whose hint is to profile for real (--device cpu)?
    The zoo then follows the hint: the row is `pass-real` when that plan trains bitwise."""
    from slackswap_cli.errors import TraceError
    return isinstance(exc, TraceError) and "--device cpu" in (exc.hint or "")


def _deepcopy(model):
    import copy
    return copy.deepcopy(model)


def _plan(model, inputs, loss_fn, device="fake:cpu"):
    """(plan, budget fraction, seconds) at BUDGET, or at the first feasible budget above the
    floor when BUDGET is infeasible; profiled on `device`."""
    import slackswap_cli as slackswap
    from slackswap_cli.budget import first_feasible_budget
    from slackswap_cli.errors import InfeasibleError
    from slackswap_cli.hardware import load_hardware
    t = time.perf_counter()
    kw = dict(device=device, loss_fn=loss_fn)
    try:
        plan = slackswap.plan_model(model, inputs, budget=BUDGET, **kw)
        return plan, BUDGET, time.perf_counter() - t
    except InfeasibleError as exc:
        prof = exc.plan.profile
        first = first_feasible_budget(prof, load_hardware(None), "slackswap")
        if first is None:
            raise
    plan = slackswap.plan_model(model, inputs, budget=int(first), **kw)
    return plan, first / prof.keep_all_peak_bytes, time.perf_counter() - t


def _step(model, inputs, loss_fn, opt, state=None):
    """One training step; (loss, gradients, (seconds, CPU seconds), bytes held after forward
    or None)."""
    from slackswap_cli.trace.joint import loss_from_output, split_inputs
    t, c = time.perf_counter(), time.process_time()
    a, kw = split_inputs(inputs)
    out = model(*a, **kw)
    held = None
    if state is not None and state.measure_held:
        held = state.last_run.held_device_bytes() / state.last_report["budget_bytes"]
    loss = loss_from_output(out, inputs, loss_fn)
    loss.backward()
    grads = [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]
    opt.step()
    opt.zero_grad(set_to_none=True)
    return (loss.detach().clone(), grads, (time.perf_counter() - t, time.process_time() - c),
            held)


def _train_both(eager, patched, inputs, loss_fn) -> dict:
    """STEPS AdamW steps of each, from the same RNG state at every step: the largest
    difference over losses and gradients (`max_diff`), held/budget of the first patched step
    (`held_budget`), patched/eager seconds of steps 2-3 (`step_ratio`), the first call from
    which no call was recorded (`first_steady`, 1-based; None: the last one was recorded)
    and, where one before the last was, the steady step's patched/eager CPU seconds
    (`steady_ratio`, `_steady_ratio`: timed after the compared steps, the first steady call
    also working out its chains' records once)."""
    import torch
    state = patched.forward.__slackswap__
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (eager, patched)]
    _set_rng_state((torch.manual_seed(1).get_state(), *_seeded_others()))
    diff, held, times, recorded = 0.0, None, [], []
    for k in range(STEPS):
        rng = _rng_state()
        le, ge, te, _ = _step(eager, inputs, loss_fn, opts[0])
        after = _rng_state()
        _set_rng_state(rng)
        state.measure_held = k == 0
        lp, gp, tp, h = _step(patched, inputs, loss_fn, opts[1], state)
        if not _same_rng(after, _rng_state()):
            raise _Differs(f"step {k + 1}: the patched step drew other random numbers")
        held = h if k == 0 else held
        diff = max(diff, _diff(le, lp), *(_diff(x, y) for x, y in zip(ge, gp)))
        times.append((te, tp))
        recorded.append(state.last_report["recorded"])
    state.measure_held = False
    first = next((k + 1 for k in range(STEPS) if not any(recorded[k:])), None)
    return {"max_diff": diff, "held_budget": held,
            "step_ratio": _ratio([(e[0], p[0]) for e, p in times[1:3]]),
            "first_steady": first,
            "steady_ratio": None if first is None or first >= STEPS else
            _steady_ratio(eager, patched, inputs, loss_fn, opts)}


def _steady_ratio(eager, patched, inputs, loss_fn, opts) -> float | None:
    """Patched / eager CPU seconds of one training step (forward, backward, AdamW step),
    each side's fastest of TIMED interleaved steps after the five compared ones (who goes
    first alternates): on a shared machine a step's time is its own work plus whatever
    other load took from it, and the fastest of several is the nearest to the first.
    None when a timed patched call was recorded (it left the steady state)."""
    import torch

    from slackswap_cli.trace.joint import loss_from_output, split_inputs
    state = patched.forward.__slackswap__
    a, kw = split_inputs(inputs)
    best = [float("inf"), float("inf")]
    for k in range(TIMED):
        for side in ((0, 1) if k % 2 == 0 else (1, 0)):
            model, opt = (eager, patched)[side], opts[side]
            torch.manual_seed(k)
            t = time.thread_time()
            loss_from_output(model(*a, **kw), inputs, loss_fn).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            best[side] = min(best[side], time.thread_time() - t)
            if side == 1 and state.last_report["recorded"]:
                return None
    return best[1] / best[0] if best[0] else None


def _ratio(pairs) -> float | None:
    """patched / eager seconds summed over (eager, patched) pairs."""
    eager, patched = sum(e for e, _ in pairs), sum(p for _, p in pairs)
    return patched / eager if eager else None


def _rng_state() -> tuple:
    """torch's, NumPy's and Python's random states: models draw from all three (wav2vec2's
    SpecAugment masks come from NumPy), and each step of the two models starts from the same."""
    import random

    import numpy as np
    import torch
    return torch.get_rng_state(), np.random.get_state(), random.getstate()


def _seeded_others() -> tuple:
    """NumPy's and Python's random states seeded 1, as torch's is."""
    import random

    import numpy as np
    random.seed(1)
    np.random.seed(1)
    return np.random.get_state(), random.getstate()


def _set_rng_state(state: tuple) -> None:
    import random

    import numpy as np
    import torch
    torch.set_rng_state(state[0])
    np.random.set_state(state[1])
    random.setstate(state[2])


def _same_rng(a: tuple, b: tuple) -> bool:
    import numpy as np
    import torch
    return (torch.equal(a[0], b[0]) and a[2] == b[2]
            and all(np.array_equal(x, y) for x, y in zip(a[1], b[1])))


class _Differs(Exception):
    pass


def _diff(x, y) -> float:
    import torch
    if x is None or y is None:
        return 0.0 if x is None and y is None else float("inf")
    if x.shape != y.shape:
        return float("inf")
    if torch.equal(x, y):
        return 0.0
    d = (x.double() - y.double()).abs().max().item()
    return d if d == d else float("inf")     # NaN in one only


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}"[:400]


def worker() -> None:
    """Read `library/name` lines on stdin, write one RESULT line per model on the real stdout
    (what models print goes to stderr)."""
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    import torch
    torch.set_num_threads(1)
    for line in sys.stdin:
        library, name = line.strip().split("/", 1)
        t, c = time.perf_counter(), time.process_time()
        row = check(library, name)
        row.update(library=library, model=name, seconds=time.perf_counter() - t,
                   cpu_s=time.process_time() - c)
        out.write(RESULT + json.dumps(row, default=str) + "\n")
        out.flush()


# -- the run (parent) ---------------------------------------------------------------------------

class Worker:
    def __init__(self, log):
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker"], cwd=ROOT,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=log, text=True, bufsize=1)

    def run(self, library: str, name: str, timeout: float) -> dict | None:
        """The model's row, or None when the worker died or hung (it is then gone)."""
        self.proc.stdin.write(f"{library}/{name}\n")
        self.proc.stdin.flush()
        end = time.monotonic() + timeout
        while True:
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0, end - time.monotonic()))
            if not ready:
                self.kill()
                return None
            line = self.proc.stdout.readline()
            if not line:
                self.proc.wait()
                return None
            if line.startswith(RESULT):
                return json.loads(line[len(RESULT):])

    def kill(self):
        self.proc.kill()
        self.proc.wait()

    def close(self):
        self.proc.stdin.close()
        self.proc.wait()


def run(todo: list[tuple[str, str]], csv_path: Path, timeout: float, jobs: int) -> None:
    """The models in `jobs` worker processes; each row appended as it comes."""
    log = open(csv_path.with_suffix(".log"), "a")
    queue, lock, count = list(reversed(todo)), threading.Lock(), [0]

    def serve():
        w = None
        while True:
            with lock:
                if not queue:
                    break
                library, name = queue.pop()
            w = w or Worker(log)
            t = time.perf_counter()
            row = w.run(library, name, timeout)
            if row is None:
                rc = w.proc.returncode
                why = (f"timed out after {timeout:.0f} s" if rc == -9 else
                       f"the worker process died (exit code {rc})")
                row = {"library": library, "model": name, "status": "fail", "detail": why,
                       "seconds": time.perf_counter() - t}
                w = None
            with lock:
                _append(csv_path, row)
                count[0] += 1
                print(f"[{count[0]}/{len(todo)}] {library}/{name}: {row['status']} "
                      f"({row['seconds']:.1f} s) {row.get('detail') or ''}"[:200], flush=True)
        if w is not None:
            w.close()

    threads = [threading.Thread(target=serve) for _ in range(jobs)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    log.close()


def _fmt(v):
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)


def _append(path: Path, row: dict) -> None:
    new = not path.exists()
    with open(path, "a", newline="") as f:
        wr = csv.writer(f)
        if new:
            wr.writerow(COLUMNS)
        wr.writerow([_fmt(row.get(c)) for c in COLUMNS])


def read_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


# Why the fake trace refuses the models that pass on the real profile: the value each reads
# (`aten._local_scalar_dense` is `.item()`, a `bool()` or an `assert` on a tensor; `nonzero`
# a size set by values), found from the refusal's site (trace/joint.py names it). None is a
# constant of the config: each depends on the batch's values or on a random draw, which a
# fake tensor does not have (torch's unbacked sizes would carry a count, but not the Python
# branch or assert that reads it, and a plan needs the bytes).
FAKE_CAUSES = (
    ("wav2vec2, wav2vec2-conformer, hubert, data2vec-audio, sew, unispeech, unispeech-sat, "
     "wavlm", "LayerDrop: `skip_the_layer = torch.rand([]) < layerdrop`, then "
     "`if not skip_the_layer` (a random draw read in Python, each step its own)"),
    ("m2m_100, nllb-moe, seamless_m4t, seamless_m4t_v2",
     "LayerDrop: `if dropout_probability < self.layerdrop` (the same random draw)"),
    ("sew-d, t5gemma2", "`nonzero` in backward: the gradient of an assignment through a "
     "boolean mask (sew-d: SpecAugment's `hidden_states[mask_time_indices] = ...`, the mask "
     "drawn with NumPy; t5gemma2: `input_embeddings[input_ids == eoi_token_index] = ...`) "
     "has as many rows as the mask has true values"),
    ("flaubert, xlm", "`assert lengths.max().item() <= slen` (lengths counted from the "
     "token ids)"),
    ("ibert", "`assert x_max.isnan().sum() == 0` (the quantizer's NaN check)"),
    ("prophetnet", "`assert torch.all(shifted_input_ids >= 0).item()` (the labels shifted)"),
    ("longformer, led", "`is_global_attn = is_index_global_attn.flatten().any().item()` (a "
     "branch on whether any token attends globally)"),
    ("fsmt", "`if not padding_mask.any()` (a branch on whether the batch has padding)"),
    ("jetmoe", "`expert_size = expert_size.tolist()`: the experts' batch sizes (routing)"),
    ("sequencer2d_s (timm)", "not a value: the LSTM's `mkldnn_rnn_layer` workspace, which a "
     "fake trace cannot size (the refusal's own reason)"),
)


def summary(rows: list[dict]) -> str:
    """zoo.md: counts per library, then every refusal's reason and every fail's symptom."""
    libs = sorted({r["library"] for r in rows}, key=zoo_models.LIBRARIES.index)
    kinds = ("pass", "pass-real", "refused", "fail", "skipped")
    lines = ["# Model zoo: patched (plan_model + patch, budget 0.5 or the first feasible)",
             "vs eager, 5 AdamW steps, training mode with dropout", "",
             "Written by `python benchmarks/zoo.py` (`make zoo`); rows in zoo.csv. pass: losses",
             "and gradients bitwise equal at every step, profiled fake (`device=\"fake:cpu\"`);",
             "pass-real: the fake trace refused with the hint to profile for real, and the plan",
             "of the real profile (`device=\"cpu\"`) trains bitwise; refused: a SlackswapError",
             "(both ways where the hint was followed); fail: numbers differ or the run crashed;",
             "skipped: the library cannot build or run the model eagerly at the zoo's size (not",
             "counted in the zoo).", "",
             "| library | models | pass | pass-real | refused | fail | skipped | seconds | "
             "CPU seconds |",
             "|---|---|---|---|---|---|---|---|---|"]
    for lib in [*libs, None]:
        sel = [r for r in rows if lib is None or r["library"] == lib]
        n = {k: sum(r["status"] == k for r in sel) for k in kinds}
        secs = sum(float(r["seconds"] or 0) for r in sel)
        cpu = sum(float(r.get("cpu_s") or 0) for r in sel)
        lines.append(f"| {lib or '**all**'} | {len(sel) - n['skipped']} | {n['pass']} | "
                     f"{n['pass-real']} | {n['refused']} | {n['fail']} | {n['skipped']} | "
                     f"{secs:.0f} | {cpu:.0f} |")
    for kind, title in (("fail", "Fails (symptom)"), ("refused", "Refusals (reason)"),
                        ("pass-real", "Passed on the real profile (the fake trace's refusal)"),
                        ("skipped", "Skipped (the library's own error at the zoo's size)")):
        sel = [r for r in rows if r["status"] == kind]
        lines += ["", f"## {title}: {len(sel)}", ""]
        lines += [f"- {r['library']}/{r['model']}: {' '.join(r['detail'].split())}"
                  for r in sel]
    if any(r["status"] == "pass-real" for r in rows):
        lines += ["", "What the fake trace could not see, per family (the line the refusal "
                      "names):", ""]
        lines += [f"- {names}: {why}" for names, why in FAKE_CAUSES]
    acts = [[int(x) for x in r["keep_swap_recompute"].split("/")] for r in rows
            if r["status"] in ("pass", "pass-real") and r.get("keep_swap_recompute")]
    if acts:
        lines += ["", f"What the passing plans did: {sum(a[2] > 0 for a in acts)} of {len(acts)} "
                      f"recompute, {sum(a[1] > 0 for a in acts)} swap, "
                      f"{sum(a[1] > 0 and a[2] > 0 for a in acts)} both (ops priced at 2 us a "
                      "kernel: slackswap_testkit/small_costs.py)."]
    passed = [float(r["step_ratio"]) for r in rows
              if r["status"] in ("pass", "pass-real") and r["step_ratio"]]
    if passed:
        passed.sort()
        lines += ["", f"Patched/eager step time over the passes (this CPU, tiny models): median "
                      f"{passed[len(passed) // 2]:.2f}, max {passed[-1]:.2f}."]
    return "\n".join(lines + steady_lines(rows)) + "\n"


def steady_lines(rows: list[dict]) -> list[str]:
    """zoo.md's steady state, per planner: how many passing rows were steady by call 3 (no
    call recorded from it on), the median and worst steady patched/eager CPU-time ratio,
    every row steady later or never, and every row over 1.5x. Rows written before the zoo
    measured the steady state (no `rc_status`) are left out and counted apart."""
    old = sum(r["status"] in ("pass", "pass-real") and not r.get("rc_status") for r in rows)
    rows = [r for r in rows if r.get("rc_status")]
    out = ["", "## Steady state", "",
           f"Each model trained {STEPS} steps; first steady call: the first from which no call "
           "was recorded (`last_report[\"recorded\"]`); steady ratio: patched/eager CPU "
           f"seconds of a training step (forward, backward, AdamW), each side's fastest of "
           f"{TIMED} interleaved steps timed after those, one thread. Default planner (`budget`), then recompute-only at "
           "its first feasible budget (`rc_` columns).", "",
           "| planner | passing rows | steady by call 3 | median steady ratio | worst | "
           "rows over 1.5x |", "|---|---|---|---|---|---|"]
    late, over = [], []
    for label, pre, ok in (("default", "", ("pass", "pass-real")),
                           ("recompute-only", "rc_", ("pass",))):
        sel = [r for r in rows if r.get(f"{pre}status") in ok]
        steady = [r for r in sel if r.get(f"{pre}first_steady")
                  and int(r[f"{pre}first_steady"]) <= 3]
        ratios = sorted((float(r[f"{pre}steady_ratio"]), r["model"]) for r in sel
                        if r.get(f"{pre}steady_ratio"))
        late += [f"- {label}: {r['library']}/{r['model']}: first steady call "
                 f"{r.get(f'{pre}first_steady') or 'none'}" for r in sel if r not in steady]
        over += [f"- {label}: {r['library']}/{r['model']}: {float(r[f'{pre}steady_ratio']):.2f}x "
                 f"(keep/swap/recompute {r[f'{pre}keep_swap_recompute']})" for r in sel
                 if r.get(f"{pre}steady_ratio") and float(r[f"{pre}steady_ratio"]) > 1.5]
        med = f"{ratios[len(ratios) // 2][0]:.2f}" if ratios else ""
        worst = f"{ratios[-1][0]:.2f} ({ratios[-1][1]})" if ratios else ""
        out.append(f"| {label} | {len(sel)} | {len(steady)} | {med} | {worst} | "
                   f"{sum(x > 1.5 for x, _ in ratios)} |")
    if old:
        out += ["", f"Passing rows run before the zoo measured the steady state (not counted "
                    f"above; `python benchmarks/zoo.py --only ...` measures them): {old}"]
    return out + ["", f"Not steady by call 3: {len(late)}", "", *late,
                  "", f"Steady ratio over 1.5x: {len(over)}", "", *over]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--library", action="append", choices=zoo_models.LIBRARIES)
    ap.add_argument("--only", help="comma-separated model names (as in zoo.csv)")
    ap.add_argument("--resume", action="store_true", help="skip models that have a row")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--timeout", type=float, default=300, help="seconds per model")
    ap.add_argument("--jobs", type=int, default=2, help="models run at once (worker "
                    "processes, one torch thread each)")
    ap.add_argument("--list", action="store_true", help="print the models and stop")
    ap.add_argument("--summary", action="store_true",
                    help="only write zoo.md again from zoo.csv (rows of several runs merged)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker()
    todo = [(lib, n) for lib in (args.library or zoo_models.LIBRARIES)
            for n in zoo_models.entries(lib)]
    if args.only:
        want = set(args.only.split(","))
        todo = [(lib, n) for lib, n in todo if n in want]
        if missing := want - {n for _, n in todo}:
            sys.exit(f"Error: not in the zoo: {', '.join(sorted(missing))} (--list shows it)")
    if args.list:
        print("\n".join(f"{lib}/{n}" for lib, n in todo))
        return
    csv_path = Path(args.out) / "zoo.csv"
    csv_path.parent.mkdir(parents=True, exist_ok=True)
    if args.summary:
        return _write_summary(csv_path, todo)
    old = read_rows(csv_path)
    done = {(r["library"], r["model"]) for r in old}
    if args.resume:
        todo = [t for t in todo if t not in done]
    else:       # rows of the models run now are replaced; the others stay
        keep = [r for r in old if (r["library"], r["model"]) not in set(todo)]
        csv_path.unlink(missing_ok=True)
        for r in keep:
            _append(csv_path, r)
    started = time.perf_counter()
    run(todo, csv_path, args.timeout, args.jobs)
    wall = time.perf_counter() - started
    _write_summary(csv_path, todo)
    print(f"{len(todo)} models in {wall:.0f} s ({args.jobs} jobs); "
          f"{csv_path} and {csv_path.with_suffix('.md')}")


def _write_summary(csv_path: Path, zoo: list[tuple[str, str]]) -> None:
    """zoo.csv sorted, and zoo.md from it; the models of `zoo` with no row are listed."""
    rows = sorted(read_rows(csv_path), key=_order)
    csv_path.unlink(missing_ok=True)
    for r in rows:
        _append(csv_path, r)
    have = {(r["library"], r["model"]) for r in rows}
    missing = [f"{lib}/{n}" for lib, n in zoo if (lib, n) not in have]
    text = summary(rows)
    if missing:
        text += (f"\n## Not run yet: {len(missing)} (`python benchmarks/zoo.py --resume` runs "
                 f"them)\n\n" + "\n".join(f"- {m}" for m in missing) + "\n")
    csv_path.with_suffix(".md").write_text(text)


def _order(row: dict) -> tuple:
    return zoo_models.LIBRARIES.index(row["library"]), row["model"]


if __name__ == "__main__":
    main()
