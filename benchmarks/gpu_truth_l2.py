"""Does a memory-bound op whose bytes fit in the L2 cost less per byte? The measured per-op
files say, against the cost model's L2 rule (`op_cost.memory_rate`: such an op streams at the
L2's bandwidth, else at HBM's).

For every single-GPU `-train-` per-op file in benchmarks/data/gpu_truth/ (NeuSight's fp32
measurements, one layer: see its README), each LayerNorm module (class norm) and each
elementwise op (class elementwise, `fit_costs.csv_class`) is sized as the fp32 bytes it reads
and writes in forward (its inputs' and its output's elements x 4) and put on the side of its
GPU's L2 (`l2_bytes` of the preset) it falls. Per GPU, class and side, a line through the
measured forward times, time = intercept + bytes / rate: the rate is what one more byte costs
(the per-op files time each op with a floor of tens of microseconds, which the intercept takes
in), against the cost model's rate on that side. Where the model's rule holds, the measured
rate is higher below the L2's size than above it, as the model's is.

Torch-free, seconds: `PYTHONPATH=. python benchmarks/gpu_truth_l2.py` writes
benchmarks/results/gpu_truth_l2.md.
"""
from __future__ import annotations

import ast
import csv
import math
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import fit_costs as fc  # noqa: E402

from slackswap_cli.hardware import PRESETS  # noqa: E402
from slackswap_cli.op_cost import default_cost_model, memory_rate  # noqa: E402

CLASSES = ("norm", "elementwise")


def _numel(shape) -> int:
    return math.prod(shape) if isinstance(shape, (tuple, list)) else 0


def op_rows(path: Path) -> list[tuple[str, int, float]]:
    """(class, forward bytes, forward ms) of each norm and elementwise row of a per-op file."""
    out = []
    for row in csv.DictReader(path.open()):
        cls = fc.csv_class(row)
        if cls not in CLASSES or float(row["fw_latency"]) <= 0:
            continue
        inputs = ast.literal_eval(row["input_shapes"] or "[]")
        numel = sum(_numel(s) for s in inputs if isinstance(s, (list, tuple))
                    and all(isinstance(d, int) for d in s))
        numel += _numel(ast.literal_eval(row["output_shape"] or "()"))
        if numel > 1:
            out.append((cls, 4 * numel, float(row["fw_latency"])))
    return out


def line(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares time (us) = intercept + bytes / rate over (bytes, ms): (rate in GB/s,
    intercept in us). The intercept takes in the per-op file's timing floor (tens of us an op),
    so the rate is the cost of one more byte."""
    n = len(points)
    mx = sum(b for b, _ in points) / n
    my = sum(ms * 1e3 for _, ms in points) / n
    sxx = sum((b - mx) ** 2 for b, _ in points)
    slope = sum((b - mx) * (ms * 1e3 - my) for b, ms in points) / sxx   # us per byte
    return 1e-3 / slope, my - slope * mx


def table(min_ops: int = 5, min_span: float = 4e6) -> list[dict]:
    """Per GPU and class, below and above its L2 (sides with `min_ops` ops and more, their
    sizes spanning `min_span` bytes and more): ops, the bytes' range, the measured line and
    the cost model's rate per byte there."""
    model, rows = default_cost_model(), []
    for gpu, preset in fc.GPUS.items():
        hw = PRESETS[preset]
        ops = [r for f in sorted((fc.DATA / "labels" / gpu).glob("*-train-*.csv"))
               if len(f.stem.split("-")) == 4 for r in op_rows(f)]
        for cls in CLASSES:
            for side, fits in (("fits", True), ("exceeds", False)):
                sel = [(b, ms) for c, b, ms in ops if c == cls and (b <= hw.l2_bytes) == fits]
                span = max((b for b, _ in sel), default=0) - min((b for b, _ in sel), default=0)
                if len(sel) < min_ops or span < min_span:
                    continue
                rate, intercept = line(sel)
                mid = statistics.median(b for b, _ in sel)
                rows.append({
                    "gpu": gpu, "preset": preset, "l2_mb": hw.l2_bytes / 1e6, "class": cls,
                    "side": side, "ops": len(sel), "min_mb": min(b for b, _ in sel) / 1e6,
                    "max_mb": max(b for b, _ in sel) / 1e6, "measured_gbs": rate,
                    "intercept_us": intercept,
                    "model_gbs": memory_rate(hw, model, cls, mid) / 1e9})
    return rows


def main() -> None:
    rows = table()
    lines = ["# Memory-bound ops on either side of the L2, measured against the cost model", "",
             "Written by `benchmarks/gpu_truth_l2.py` (its docstring says how). Forward, fp32, "
             "one layer of each measured `-train-` step. Measured: the least-squares line "
             "time = intercept + bytes / rate over the ops on that side of the GPU's L2 (the "
             "intercept takes in the per-op files' timing floor); model: the cost model's rate "
             "(`op_cost.memory_rate`, committed constants) at the side's median size.", "",
             "| GPU (preset, L2) | class | side of the L2 | ops | MB | measured GB/s a byte "
             "more | intercept us | model GB/s |", "|---|---|---|---:|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['gpu']} ({r['preset']}, {r['l2_mb']:.0f} MB) | {r['class']} | "
                     f"{r['side']} | {r['ops']} | {r['min_mb']:.1f}-{r['max_mb']:.1f} | "
                     f"{r['measured_gbs']:,.0f} | {r['intercept_us']:.1f} | "
                     f"{r['model_gbs']:,.0f} |")
    out = HERE / "results" / "gpu_truth_l2.md"
    out.write_text("\n".join(lines) + "\n")
    print(out.read_text())


if __name__ == "__main__":
    main()
