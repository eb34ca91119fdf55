"""Fit the op cost constants (slackswap_cli/op_costs.json) on measured GPU training steps.

Data (benchmarks/data/gpu_truth/, NeuSight's measurements, MIT licence, see its README): per
GPU and (model, seq, batch), the whole step's forward and backward times (`.json`) and one
layer's per-op times (`.csv`, module-level FX nodes of the one-layer model). Our side: the
same steps traced with `slackswap profile --device fake` and cached per op (profiles.json,
written by gpu_truth_profiles.py). Nothing here imports torch.

What is fitted, shared by all GPUs (each GPU keeps its datasheet figures: `hardware.PRESETS`):

- per class of op, the achievable fraction of the memory bandwidth (elementwise,
  normalisation, softmax, embedding/gather; HBM's, or the L2's for bytes that fit in it) and
  of the FP32 FMA peak (GEMM, batched GEMM, after the wave quantization of its output tiles
  over the SMs and the clock factor below): each the one value that minimises the absolute
  log error of that class's time, our one-layer profile against the per-op file's sum of that
  class (each row less the file's cost of timing a node, `harness_ms`), over every step of
  every GPU fitted on;
- the fp32 clock factor's two constants (`op_cost.fp32_clock_factor`): the efficiency kept on
  SMs with 128 FP32 lanes and the board-power knee, fitted on the large GEMMs of the per-op
  files one by one (`Linear` rows of at least 2**33 FLOPs, forward time: the per-call host
  overhead those files include stays under about a tenth), each GPU's mean absolute log
  error counting once, so that a GPU with many rows does not outvote one with few. The T4's
  files (inference only: `labels/Tesla_T4/*-inf-*.csv`) join these rows on every fold: a
  70 W card, the one other board-power-limited GPU measured, without which the L4's limit
  could not be learnt when the L4 is held out;
- one per-kernel overhead, in [2, 10] us: the value that minimises the absolute log error of
  the whole step (`.json`), with the class constants fixed, over the steps whose backward
  takes at least 1.5 times their forward (`consistent`); the fits alternate three times.

Some A100 steps fail that check (backward 1.06-1.39 times forward, where every other GPU's
steps measure 1.54-2.08 and the per-op files of the same A100 steps time each GEMM's backward
at twice its forward): their forward timer took in something the step does not run, e.g.
opt_13 at batch 2 measures 2.96 times the forward of batch 1 and 2.02 times its backward.
They are predicted and reported like every step (benchmarks/gpu_truth.py), but not fitted on.

Classes the files cannot separate take a fitted neighbour's value, and say so in the output:
reductions (ours are bias gradients, which the per-op files time inside the Linear's backward:
compared together with GEMM; priced with elementwise's bandwidth), loss (log-softmax + NLL are
outside the measured layer: softmax's), attention (the measured models run eager attention, no
fused kernel: batched GEMM's), convolution (none measured: GEMM's, and elementwise's bandwidth).

`python benchmarks/fit_costs.py` fits on every GPU and writes slackswap_cli/op_costs.json;
`--check` fits again and exits 1 if the committed file differs.
"""
from __future__ import annotations

import ast
import csv
import json
import math
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from slackswap_cli.hardware import PRESETS  # noqa: E402
from slackswap_cli.op_cost import (  # noqa: E402
    Precision,
    cost_model_from_dict,
    op_time_us,
)

DATA = HERE / "data" / "gpu_truth"
OUT = HERE.parent / "slackswap_cli" / "op_costs.json"
# NeuSight's directory name -> our preset of that GPU
GPUS = {"NVIDIA_A100_80GB_PCIe": "a100-80gb-pcie", "NVIDIA_H100_80GB_HBM3": "h100-sxm",
        "Tesla_V100-PCIE-32GB": "v100-pcie", "NVIDIA_L4": "l4"}
ROW_ONLY_GPUS = {"Tesla_T4": "t4"}   # per-op files of inference only: their GEMM rows
MEMORY_FITTED = ("elementwise", "norm", "softmax", "embedding")
COMPUTE_FITTED = ("gemm", "bgemm")
POWER = 1
MAX_OVERHEAD_US = 10.0   # launch gaps are a few us; a wider range soaks up other errors
MIN_OVERHEAD_US = 2.0    # a kernel's launch and tail on the GPU (HardwareSpec's default)
CONSISTENT_BW_OVER_FW = 1.5   # a whole step whose backward is shorter was mistimed
ROW_MIN_FLOPS = 2 ** 33
# classes the per-op files cannot separate -> the fitted class whose value they take
BORROWED_MEMORY = {"reduction": "elementwise", "loss": "softmax", "attention": "elementwise",
                   "conv": "elementwise", "gemm": "elementwise", "bgemm": "elementwise"}
BORROWED_COMPUTE = {"attention": "bgemm", "conv": "gemm"}
# per-op file rows -> class (module-level FX nodes); others (views, scalar arithmetic,
# shape queries) launch no kernel of their own and are left out
_MODULES = {"Linear": "gemm", "Embedding": "embedding", "LayerNorm": "norm",
            "Dropout": "elementwise", "ReLU": "elementwise", "Tanh": "elementwise",
            "GELUActivation": "elementwise", "NewGELUActivation": "elementwise"}
_ELEMENTWISE = ("add", "sub", "mul", "truediv", "pow", "tanh", "gelu", "where", "masked_fill",
                "masked_fill_", "contiguous", "relu", "dropout", "ones", "full", "arange",
                "neg", "exp", "cat")


def csv_class(row: dict) -> str | None:
    """The class of one per-op file row, or None for a row that launches no kernel."""
    if row["op"] == "call_module":
        return _MODULES.get(row["module"], "elementwise")
    if row["op"] not in ("call_function", "call_method"):
        return None
    name = row["target"].replace("<built-in function ", "").replace("<built-in method ", "")
    name = name.replace("<function ", "").split(" ")[0].rstrip(">")
    out = ast.literal_eval(row["output_shape"] or "()")
    if not isinstance(out, tuple) or math.prod(out) <= 1:
        return None   # a scalar: Python arithmetic on sizes
    if name in ("addmm", "linear"):
        return "gemm"
    if name in ("matmul", "bmm"):
        return "bgemm" if len(out) > 2 else "gemm"
    if name in ("softmax", "embedding"):
        return name
    if name in ("cumsum", "max", "sum", "mean"):
        return "reduction"
    return "elementwise" if name in _ELEMENTWISE else None


def load_steps() -> list[dict]:
    """Every single-GPU training step measured: GPU, preset, model, seq, batch, the whole step
    (ms) and, where the per-op file exists, its time per class (ms, forward + backward)."""
    steps = []
    for gpu_dir in sorted((DATA / "labels").iterdir()):
        for f in sorted(gpu_dir.glob("*-train-*.json")):
            parts = f.stem.split("-")
            if len(parts) != 4:
                continue   # -dp4 / -tp4 / -pp4: several GPUs
            whole = json.loads(f.read_text())
            step = {"gpu": gpu_dir.name, "preset": GPUS[gpu_dir.name], "model": parts[0],
                    "seq": int(parts[2]), "batch": int(parts[3]), "file": _rel(f),
                    "fw_ms": whole["fw_latency"], "bw_ms": whole["bwall_latency"],
                    "e2e_ms": whole["e2e_latency"], "classes_ms": None}
            per_op = f.with_suffix(".csv")
            if per_op.exists():
                step["classes_ms"] = _csv_classes(per_op)
                step["csv_file"] = _rel(per_op)
            steps.append(step)
    return steps


def _rel(p: Path) -> str:
    return str(p.relative_to(HERE.parent))


def harness_ms(rows: list[dict]) -> float:
    """The per-op file's own cost of timing one node: the median forward time of its nodes that
    launch no kernel (views, size queries), 6.8-11.9 us. Each row's time carries it; the whole
    step does not (the GPU runs ahead of Python)."""
    empty = sorted(float(r["fw_latency"]) for r in rows
                   if r["op"] in ("call_method", "call_function") and csv_class(r) is None
                   and float(r["fw_latency"]) > 0)
    return empty[len(empty) // 2] if empty else 0.0


def _csv_classes(path: Path) -> dict:
    """Time per class of a per-op file (ms, forward + backward), each row's forward and
    backward less the file's `harness_ms`."""
    out: dict[str, float] = {}
    with path.open() as fh:
        rows = list(csv.DictReader(fh))
    harness = harness_ms(rows)
    for row in rows:
        cls = csv_class(row)
        if cls == "reduction":
            cls = "gemm"   # compared as `comparable` groups ours
        if cls is not None:
            fw, bw = float(row["fw_latency"]), float(row["bw_latency"])
            out[cls] = (out.get(cls, 0.0) + max(fw - harness, 0.0)
                        + (max(bw - harness, 0.0) if bw > 0 else 0.0))
    return out


def consistent(step: dict) -> bool:
    """Whether a whole step's forward and backward times are plausible together (see the
    module docstring): the backward at least `CONSISTENT_BW_OVER_FW` times the forward."""
    return step["bw_ms"] >= CONSISTENT_BW_OVER_FW * step["fw_ms"]


def gemm_rows() -> list[tuple]:
    """The large GEMMs of the per-op files: (GPU, preset, FLOPs, bytes, output shape, measured
    forward us), from the `Linear` rows of the training files and of the T4's."""
    presets = {**GPUS, **ROW_ONLY_GPUS}
    rows = []
    for gpu_dir in sorted((DATA / "labels").iterdir()):
        pattern = "*-inf-*.csv" if gpu_dir.name in ROW_ONLY_GPUS else "*-train-*.csv"
        for f in sorted(gpu_dir.glob(pattern)):
            with f.open() as fh:
                for row in csv.DictReader(fh):
                    if row["op"] != "call_module" or row["module"] != "Linear":
                        continue
                    x = ast.literal_eval(row["input_shapes"])[0]
                    m, k = math.prod(x[:-1]), x[-1]
                    n = ast.literal_eval(row["output_shape"])[-1]
                    if 2 * m * n * k >= ROW_MIN_FLOPS:
                        rows.append((gpu_dir.name, presets[gpu_dir.name], 2 * m * n * k,
                                     4 * (m * k + k * n + m * n), (m, n),
                                     float(row["fw_latency"]) * 1e3))
    return rows


def load_profiles() -> dict:
    return json.loads((DATA / "profiles.json").read_text())["steps"]


def predict(summary: dict, hw, model) -> dict:
    """Our predicted forward, backward (us) and time per class (us) of one cached profile."""
    precision = Precision.from_env({"float32_matmul": summary.get("float32_matmul")})
    fw = bw = 0.0
    classes: dict[str, float] = {}
    for cls, _target, phase, dtype, flops, nbytes, shape, count in summary["ops"]:
        t = count * op_time_us(hw, model, cls, dtype, flops, nbytes, precision, tuple(shape))
        if phase == "forward":
            fw += t
        else:
            bw += t
        classes[cls] = classes.get(cls, 0.0) + t
    return {"fw_us": fw, "bw_us": bw, "classes_us": classes}


def comparable(classes_us: dict) -> dict:
    """Our per-class times grouped as the per-op files can see them (ms): reductions (bias
    gradients) inside GEMM, loss left out (it is outside the measured layer)."""
    out = {c: v / 1e3 for c, v in classes_us.items() if c not in ("reduction", "loss")}
    out["gemm"] = out.get("gemm", 0.0) + classes_us.get("reduction", 0.0) / 1e3
    return out


def step_key(step: dict, one_layer: bool = False) -> str:
    return f"{step['model']}-{step['seq']}-{step['batch']}" + ("-1layer" if one_layer else "")


def _constants(fit: dict, overhead: float) -> dict:
    mem = {c: fit["mem"][c] for c in MEMORY_FITTED}
    mem.update({c: mem[src] for c, src in BORROWED_MEMORY.items()})
    comp = {c: fit["comp"][c] for c in COMPUTE_FITTED}
    comp.update({c: comp[src] for c, src in BORROWED_COMPUTE.items()})
    return {"fp32_efficiency": {c: round(v, 4) for c, v in sorted(comp.items())},
            "memory_efficiency": {c: round(v, 4) for c, v in sorted(mem.items())},
            "fp32_wide_sm_efficiency": round(fit["wide"], 4),
            "fp32_power_knee_w": round(fit["knee"], 1),
            "kernel_overhead_us": round(overhead, 3)}


def _golden(f, lo: float, hi: float, iters: int = 60) -> float:
    """The minimiser of a unimodal `f` on [lo, hi] (golden-section search)."""
    g = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = f(c), f(d)
    for _ in range(iters):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = f(d)
    return (a + b) / 2


def fit(steps: list[dict], profiles: dict, gpus, rows: list[tuple]) -> dict:
    """The constants fitted on the steps of `gpus` and the GEMM rows of `gpus` and of the
    row-only GPUs (see the module docstring)."""
    mine = [s for s in steps if s["gpu"] in gpus]
    per_op = [s for s in mine if s["classes_ms"]]
    whole = [s for s in mine if consistent(s)]
    my_rows = [r for r in rows if r[0] in gpus or r[0] in ROW_ONLY_GPUS]
    fitted = {"mem": dict.fromkeys(MEMORY_FITTED, 0.8), "comp": dict.fromkeys(COMPUTE_FITTED, 0.8),
              "wide": 1.0, "knee": 100.0}
    overhead = MIN_OVERHEAD_US
    for _ in range(3):
        for kind, classes in (("mem", MEMORY_FITTED), ("comp", COMPUTE_FITTED)):
            for cls in classes:
                def loss(log_v, kind=kind, cls=cls):
                    trial = {**fitted, kind: {**fitted[kind], cls: math.exp(log_v)}}
                    return _class_loss(per_op, profiles, _constants(trial, overhead), cls)
                fitted[kind][cls] = math.exp(_golden(loss, math.log(0.02), math.log(1.0)))
        fitted["wide"], fitted["knee"] = _fit_clock(my_rows, fitted, overhead)
        overhead = _golden(lambda o: _step_loss(whole, profiles, _constants(fitted, o)),
                           MIN_OVERHEAD_US, MAX_OVERHEAD_US)
    return _constants(fitted, overhead)


def _fit_clock(rows: list[tuple], fitted: dict, overhead: float) -> tuple[float, float]:
    """The wide-SM efficiency and power knee that minimise `_rows_loss` together (the two
    trade against each other on the L4, one at a time they would creep): for each knee the
    best efficiency, and the knee whose best is least."""
    def best_wide(knee: float) -> float:
        return _golden(lambda v: _rows_loss(rows, _constants(
            {**fitted, "wide": v, "knee": knee}, overhead)), 0.2, 1.0, iters=30)

    def loss(log_knee: float) -> float:
        knee = math.exp(log_knee)
        return _rows_loss(rows, _constants({**fitted, "wide": best_wide(knee), "knee": knee},
                                           overhead))
    knee = math.exp(_golden(loss, math.log(10.0), math.log(2000.0), iters=30))
    return best_wide(knee), knee


def _rows_loss(rows: list[tuple], constants: dict) -> float:
    """Sum over GPUs of the mean absolute log error of their large GEMMs."""
    model = cost_model_from_dict(constants)
    per_gpu: dict[str, list[float]] = {}
    for gpu, preset, flops, nbytes, shape, measured_us in rows:
        ours = op_time_us(PRESETS[preset], model, "gemm", "float32", flops, nbytes,
                          Precision(), shape)
        per_gpu.setdefault(gpu, []).append(abs(math.log(ours / measured_us)))
    return sum(sum(v) / len(v) for v in per_gpu.values())


def _class_loss(steps, profiles, constants: dict, cls: str) -> float:
    model = cost_model_from_dict(constants)
    total = 0.0
    for s in steps:
        measured = s["classes_ms"].get(cls, 0.0)
        ours = comparable(predict(profiles[step_key(s, True)], PRESETS[s["preset"]],
                                  model)["classes_us"]).get(cls, 0.0)
        if measured > 0 and ours > 0:
            total += abs(math.log(ours / measured)) ** POWER
    return total


def _step_loss(steps, profiles, constants: dict) -> float:
    model = cost_model_from_dict(constants)
    total = 0.0
    for s in steps:
        p = predict(profiles[step_key(s)], PRESETS[s["preset"]], model)
        total += abs(math.log((p["fw_us"] + p["bw_us"]) / 1e3 / s["e2e_ms"])) ** POWER
    return total


def fit_all() -> dict:
    """The committed file's content: fitted on every GPU of the data, with its sources."""
    steps, rows = load_steps(), gemm_rows()
    constants = fit(steps, load_profiles(), sorted(GPUS), rows)
    files = sorted({s["file"] for s in steps} | {s["csv_file"] for s in steps if "csv_file" in s}
                   | {_rel(f) for g in ROW_ONLY_GPUS for f in (DATA / "labels" / g).glob("*.csv")})
    return {**constants, "fitted_on": sorted({**GPUS, **ROW_ONLY_GPUS}), "borrowed": {
        "memory_efficiency": BORROWED_MEMORY, "fp32_efficiency": BORROWED_COMPUTE},
        "fitted_from": ["benchmarks/data/gpu_truth/profiles.json", *files],
        "written_by": "benchmarks/fit_costs.py"}


def main(argv: list[str]) -> int:
    data = fit_all()
    text = json.dumps(data, indent=1) + "\n"
    if "--check" in argv:
        same = OUT.exists() and OUT.read_text() == text
        print("op_costs.json matches the fit" if same else "op_costs.json differs from the fit")
        return 0 if same else 1
    OUT.write_text(text)
    shown = {k: data[k] for k in ("fp32_efficiency", "memory_efficiency",
                                  "fp32_wide_sm_efficiency", "fp32_power_knee_w",
                                  "kernel_overhead_us")}
    print(f"wrote {OUT.relative_to(HERE.parent)}: {json.dumps(shown)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
