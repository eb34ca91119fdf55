"""Trace (FakeTensorMode, no GPU) the steps NeuSight measured and cache what the cost model needs.

For every `-train-` step in benchmarks/data/gpu_truth/labels/ (model, seq, batch) this traces
benchmarks/gpu_truth_workload.py twice with `slackswap profile --device fake`'s code: the whole
model (for the measured whole step) and the one-layer model (the per-op files measure it), and
writes each profile's ops grouped by (class, target, phase, dtype, FLOPs, bytes, output shape)
with a count to benchmarks/data/gpu_truth/profiles.json. benchmarks/fit_costs.py and
benchmarks/gpu_truth.py read that file, so fitting and validating need neither torch nor a
re-trace. Run: `PYTHONPATH=. python benchmarks/gpu_truth_profiles.py` (a few minutes).
"""
from __future__ import annotations

import sys
import time
from collections import Counter
from pathlib import Path

import orjson

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from slackswap_cli.hardware import PRESETS  # noqa: E402
from slackswap_cli.op_cost import op_class, op_dtype, op_shape  # noqa: E402

DATA = HERE / "data" / "gpu_truth"
OUT = DATA / "profiles.json"


def steps() -> list[tuple[str, int, int]]:
    """(model, seq, batch) of every single-GPU training step in the labels."""
    found = set()
    for f in (DATA / "labels").glob("*/*-train-*.json"):
        model, _, seq, batch = f.stem.split("-")[:4]
        if not f.stem.count("-") > 3:
            found.add((model, int(seq), int(batch)))
    return sorted(found)


def summary(prof) -> dict:
    """A profile's ops grouped (views and other free ops dropped) and its layer-free totals."""
    groups = Counter()
    for op in prof.ops:
        if op.flops <= 0 and op.bytes <= 0:
            continue
        groups[(op_class(op.target), op.target, op.phase, op_dtype(prof, op), op.flops,
                op.bytes, op_shape(prof, op))] += 1
    return {"ops": [[*k[:6], list(k[6]), n] for k, n in sorted(groups.items())],
            "float32_matmul": prof.env.get("float32_matmul"),
            "torch_version": prof.env.get("torch_version")}


def main() -> None:
    from slackswap_cli.trace import profile_workload
    out = {"source": "benchmarks/gpu_truth_profiles.py", "steps": {}}
    for model, seq, batch in steps():
        for layers in (None, 1):
            t0 = time.perf_counter()
            prof = profile_workload(HERE / "gpu_truth_workload.py", device="fake",
                                    hardware=PRESETS["a100-80gb-pcie"],
                                    args=dict(model=model, seq=seq, batch=batch, n_layer=layers))
            key = f"{model}-{seq}-{batch}" + ("-1layer" if layers else "")
            out["steps"][key] = summary(prof)
            print(f"{key}: {len(prof.ops)} ops, {time.perf_counter() - t0:.1f} s", flush=True)
    OUT.write_bytes(orjson.dumps(out, option=orjson.OPT_INDENT_2))
    print(f"wrote {OUT.relative_to(HERE.parent)} ({OUT.stat().st_size // 1024} KiB)")


if __name__ == "__main__":
    main()
