"""What one op costs on a `HardwareSpec`: its class, the arithmetic it runs, fitted constants.

An op's time is a roofline with two things the plain one (`HardwareSpec.roofline_us`) lacks:

- **the peak of the arithmetic it runs.** Matmul-like ops (GEMM, batched GEMM, attention,
  convolution) in bf16/fp16 run on tensor cores at `peak_flops_per_s` times the preset's
  `matmul_efficiency` (fused attention: its `attention_efficiency` where given, its backward
  kernel its `attention_backward_efficiency`), all three times the preset's
  `bf16_sustained_fraction` (fitted to published training runs: hardware.py's [FIT]); fp8 at
  `fp8_flops_per_s`; fp32 at
  `tf32_flops_per_s` when the workload allowed TF32 (`torch.backends.cuda.matmul.allow_tf32`
  or a float32 matmul precision of "high"/"medium" for matmuls,
  `torch.backends.cudnn.allow_tf32` for convolutions: the profile records them in
  `env.float32_matmul`), else on the FP32 FMA units at `fp32_flops_per_s` times a fitted
  efficiency of its class, the wave quantization of its output over the GPU's SMs
  (`sm_count`; 128x128 output tiles) and `fp32_clock_factor`:
  a fitted efficiency on SMs with 128 FP32 lanes (`fp32_lanes_per_sm`: two FP32 datapaths
  per SM partition, which an FP32 GEMM does not keep both busy) and the clock a board power
  limit sustains (`board_power_w` under the fitted knee: the clock falls in proportion, as
  it does once the voltage sits at its floor, where power is about C x V_min^2 x clock; the
  70-75 W cards measured, T4 and L4, run FP32 GEMMs at about half their boost clock);
- **the L2**: a memory-bound op (not a matmul class) whose bytes fit in the L2 (`l2_bytes`)
  streams at the L2's bandwidth (`l2_bytes_per_s`) where that beats HBM's: the tensors of one
  op of a small model were just written by the op before;
- **per-class constants fitted on measured GPU steps** (`op_costs.json`, written by
  benchmarks/fit_costs.py from benchmarks/data/gpu_truth/): the achievable fraction of
  memory bandwidth per class of op, the FP32 GEMM efficiencies, the wide-SM efficiency and
  power knee, and one per-kernel overhead.

time = max(FLOPs / compute rate, bytes / (bandwidth x class efficiency)) + overhead;
an op that neither computes nor moves bytes (a view) is free.

`price_profile` re-times every roofline op of a profile this way and records the cost model
(`env.cost_model`: name and a digest of the constants) so that a profile priced by other
constants is recognised (`check_cost_model`: `plan` refuses to mix them).
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import orjson

from .errors import InputError
from .schema import Profile

COSTS_FILE = Path(__file__).with_name("op_costs.json")
MODEL_NAME = "roofline-by-class"
CLASSES = ("gemm", "bgemm", "attention", "conv", "elementwise", "norm", "softmax", "reduction",
           "embedding", "loss")
MATMUL_CLASSES = ("gemm", "bgemm", "attention", "conv")
TILE = 128   # output tile edge of an FP32 GEMM kernel, for wave quantization

# op name (aten's middle token, or an ONNX op type, lowercased) -> class; else elementwise
_EXACT = {
    **dict.fromkeys(("mm", "addmm", "matmul", "linear", "_scaled_mm", "mv", "addmv", "dot",
                     "gemm"), "gemm"),
    **dict.fromkeys(("bmm", "baddbmm"), "bgemm"),
    **dict.fromkeys(("_softmax", "_softmax_backward_data", "softmax", "_safe_softmax"),
                    "softmax"),
    **dict.fromkeys(("_log_softmax", "_log_softmax_backward_data", "log_softmax", "nll_loss_forward",
                     "nll_loss_backward", "nll_loss2d_forward", "nll_loss2d_backward",
                     "cross_entropy_loss", "mse_loss", "mse_loss_backward",
                     "binary_cross_entropy", "binary_cross_entropy_backward",
                     "binary_cross_entropy_with_logits", "softmaxcrossentropyloss",
                     "negativeloglikelihoodloss"), "loss"),
    **dict.fromkeys(("embedding", "embedding_dense_backward", "index_select", "gather",
                     "index", "index_put", "_index_put_impl_", "scatter", "scatter_add",
                     "index_add", "gathernd", "gatherelements", "scatterelements",
                     "scatternd"), "embedding"),
    **dict.fromkeys(("sum", "mean", "amax", "amin", "max", "min", "argmax", "argmin", "cumsum",
                     "var", "std", "var_mean", "prod", "any", "all", "logsumexp",
                     "linalg_vector_norm", "norm", "reducesum", "reducemean", "reducemax",
                     "reducemin", "reducel2", "reduceprod", "reducelogsumexp"), "reduction"),
}
_PREFIX = (("_scaled_dot_product", "attention"), ("_flash_attention", "attention"),
           ("_efficient_attention", "attention"), ("_cudnn_attention", "attention"),
           ("scaled_dot_product", "attention"), ("convolution", "conv"), ("conv", "conv"),
           ("native_layer_norm", "norm"), ("native_group_norm", "norm"),
           ("native_batch_norm", "norm"), ("_native_batch_norm", "norm"),
           ("_fused_rms_norm", "norm"), ("rms_norm", "norm"), ("layer_norm", "norm"),
           ("layernormalization", "norm"), ("batchnormalization", "norm"),
           ("groupnormalization", "norm"), ("cudnn_batch_norm", "norm"),
           ("matmul", "gemm"))


def op_class(target: str) -> str:
    """The class of an op from its target: "aten.mm.default" -> "gemm", ONNX "Softmax" ->
    "softmax"; anything not named is "elementwise" (its time is its memory traffic)."""
    parts = target.split(".")
    if parts[0] == "onnx" and len(parts) >= 2:   # onnx.MatMul, onnx.aten.mm, onnx.X.backward
        parts = [p for p in parts[1:] if p != "backward"] or parts[1:]
        name = parts[1] if parts[0] == "aten" and len(parts) >= 2 else parts[-1]
    else:
        name = parts[1] if len(parts) >= 2 and parts[0] in ("aten", "prims") else target
    name = name.lower()
    if name in _EXACT:
        return _EXACT[name]
    for prefix, cls in _PREFIX:
        if name.startswith(prefix):
            return cls
    return "elementwise"


@dataclass(frozen=True)
class CostModel:
    """Fitted constants (see the module docstring); `digest` names this set of them."""
    fp32_efficiency: dict          # class -> fraction of FP32 FMA peak (matmul classes)
    memory_efficiency: dict        # class -> fraction of datasheet HBM bandwidth
    kernel_overhead_us: float      # added to every op that computes or moves bytes
    digest: str
    fitted_from: tuple = ()        # the files the constants came from
    wide_sm_efficiency: float = 1.0   # fp32 FMA rate kept on SMs with 128 FP32 lanes
    power_knee_w: float = 0.0         # board power under which the fp32 clock falls (0: none)

    @property
    def identity(self) -> dict:
        return {"name": MODEL_NAME, "digest": self.digest}


def cost_model_from_dict(data: dict) -> CostModel:
    """A `CostModel` from the JSON object `fit_costs.py` writes."""
    body = orjson.dumps({k: data[k] for k in ("fp32_efficiency", "memory_efficiency",
                                                "kernel_overhead_us", *_OPTIONAL) if k in data},
                        option=orjson.OPT_SORT_KEYS)
    missing = [c for c in CLASSES if c not in data["memory_efficiency"]]
    if missing:
        raise InputError(f"op cost constants lack memory_efficiency for {', '.join(missing)}",
                         hint="run benchmarks/fit_costs.py to write them again")
    return CostModel(dict(data["fp32_efficiency"]), dict(data["memory_efficiency"]),
                     float(data["kernel_overhead_us"]),
                     hashlib.sha256(body).hexdigest()[:12], tuple(data.get("fitted_from", ())),
                     float(data.get("fp32_wide_sm_efficiency", 1.0)),
                     float(data.get("fp32_power_knee_w", 0.0)))


# constants a file may leave out (the file then prices as before they existed)
_OPTIONAL = ("fp32_wide_sm_efficiency", "fp32_power_knee_w")


@lru_cache(maxsize=1)
def default_cost_model() -> CostModel:
    """The committed constants (`op_costs.json`)."""
    return cost_model_from_dict(orjson.loads(COSTS_FILE.read_bytes()))


@dataclass(frozen=True)
class Precision:
    """What fp32 matmuls and convolutions may run as (from the profile's `env.float32_matmul`)."""
    tf32_matmul: bool = False
    tf32_conv: bool = False

    @classmethod
    def from_env(cls, env: dict) -> "Precision":
        rec = env.get("float32_matmul") or {}
        matmul = bool(rec.get("allow_tf32")) or rec.get("precision") in ("high", "medium")
        return cls(tf32_matmul=matmul, tf32_conv=bool(rec.get("cudnn_allow_tf32")))


def wave_utilisation(out_shape, sm_count: int) -> float:
    """Fraction of the SMs' slots a GEMM's output tiles fill over its waves (1 when unknown)."""
    if sm_count <= 0 or not out_shape or len(out_shape) < 2:
        return 1.0
    batch = math.prod(out_shape[:-2]) if len(out_shape) > 2 else 1
    tiles = batch * math.ceil(out_shape[-2] / TILE) * math.ceil(out_shape[-1] / TILE)
    if tiles <= 0:
        return 1.0
    return tiles / (math.ceil(tiles / sm_count) * sm_count)


def fp32_clock_factor(hw, model: CostModel) -> float:
    """The fraction of `fp32_flops_per_s` the FMA units keep: the wide-SM efficiency where an
    SM has 128 FP32 lanes, times the board-power-limited clock (power over the knee, at most
    1). Rounded to 4 places."""
    factor = model.wide_sm_efficiency if hw.fp32_lanes_per_sm >= 128 else 1.0
    if hw.board_power_w > 0 and model.power_knee_w > 0:
        factor *= min(1.0, hw.board_power_w / model.power_knee_w)
    return round(factor, 4)


def memory_rate(hw, model: CostModel, cls: str, nbytes: float) -> float:
    """Achievable bytes/s of an op of class `cls` moving `nbytes`: the L2's bandwidth where
    the bytes fit in it and it beats HBM's (not for matmul classes), else HBM's; times the
    class's fitted efficiency."""
    bandwidth = hw.hbm_bytes_per_s
    if cls not in MATMUL_CLASSES and 0 < nbytes <= hw.l2_bytes:
        bandwidth = max(bandwidth, hw.l2_bytes_per_s)
    return bandwidth * model.memory_efficiency.get(cls, model.memory_efficiency["elementwise"])


def compute_rate(hw, model: CostModel, cls: str, dtype: str, precision: Precision,
                 out_shape=None, backward: bool = False) -> float:
    """Achievable FLOP/s of an op of class `cls` whose operands are `dtype` (`backward`: the
    op is a backward kernel, which fused attention prices at its own fraction)."""
    if cls in MATMUL_CLASSES:
        if dtype in ("bfloat16", "float16"):
            eff = ((cls == "attention" and backward and hw.attention_backward_efficiency)
                   or (cls == "attention" and hw.attention_efficiency)
                   or hw.matmul_efficiency)
            return hw.peak_flops_per_s * eff * hw.bf16_sustained_fraction
        if dtype.startswith("float8"):
            return (hw.fp8_flops_per_s or hw.peak_flops_per_s) * hw.matmul_efficiency
        tf32 = precision.tf32_conv if cls == "conv" else precision.tf32_matmul
        if tf32 and hw.tf32_flops_per_s > 0:
            return hw.tf32_flops_per_s * hw.matmul_efficiency
    if hw.fp32_flops_per_s <= 0:   # a hardware file without the figure: its one peak
        return hw.peak_flops_per_s * hw.matmul_efficiency
    eff = model.fp32_efficiency.get(cls, model.fp32_efficiency["gemm"])
    return (hw.fp32_flops_per_s * eff * fp32_clock_factor(hw, model)
            * wave_utilisation(out_shape, hw.sm_count))


def op_time_us(hw, model: CostModel, cls: str, dtype: str, flops: float, nbytes: float,
               precision: Precision = Precision(), out_shape=None,
               backward: bool = False) -> float:
    """Time of one op (see the module docstring; `backward`: a backward kernel)."""
    if flops <= 0 and nbytes <= 0:
        return 0.0
    compute_us = 0.0
    if flops > 0:
        compute_us = flops / compute_rate(hw, model, cls, dtype, precision, out_shape,
                                          backward) * 1e6
    memory_us = nbytes / memory_rate(hw, model, cls, nbytes) * 1e6
    return max(compute_us, memory_us) + model.kernel_overhead_us


_FLOAT = ("float32", "bfloat16", "float16", "float64")


def op_dtype(prof: Profile, op) -> str:
    """The dtype an op computes in: its first floating-point input's, else its first output's."""
    for tid in op.inputs:
        dt = prof.tensors[tid].dtype
        if dt in _FLOAT or dt.startswith("float8"):
            return dt
    return prof.tensors[op.outputs[0]].dtype if op.outputs else "float32"


def op_shape(prof: Profile, op) -> tuple:
    """The shape of an op's first output (() when it has none)."""
    return tuple(prof.tensors[op.outputs[0]].shape) if op.outputs else ()


def is_backward_kernel(target: str) -> bool:
    """Whether an op is a backward kernel by its name ("..._backward.default")."""
    return "backward" in target.lower()


def price_profile(prof: Profile, hw, model: CostModel | None = None) -> Profile:
    """`prof` with every roofline op re-timed on `hw` by `model` (the committed constants by
    default), the summary's forward/backward times updated and the hardware and cost model
    recorded in `env`. Measured ops keep their times."""
    model = model or default_cost_model()
    precision = Precision.from_env(prof.env)
    ops = tuple(
        dataclasses.replace(op, time_us=op_time_us(
            hw, model, op_class(op.target), op_dtype(prof, op), op.flops, op.bytes, precision,
            op_shape(prof, op), is_backward_kernel(op.target)))
        if op.time_source == "roofline" else op
        for op in prof.ops)
    summary = dict(prof.summary,
                   forward_us=sum(o.time_us for o in ops if o.phase == "forward"),
                   backward_us=sum(o.time_us for o in ops if o.phase == "backward"))
    env = dict(prof.env, hardware=hw.to_dict(), cost_model=model.identity)
    return Profile(fingerprint=prof.fingerprint, workload=prof.workload, env=env,
                   summary=summary, ops=ops, tensors=prof.tensors)


def check_cost_model(prof: Profile, source: str = "profile") -> None:
    """Refuse a profile whose roofline times came from other cost constants than this
    slackswap's: planning it would mix its op times with copy times and re-costed ops of
    another model. Profiles with measured times, or written by hand (no `env.cost_model` and
    no stored hardware spec), pass."""
    if not prof.ops or all(op.time_source != "roofline" for op in prof.ops):
        return
    stored = prof.env.get("cost_model")
    current = default_cost_model().identity
    if stored == current:
        return
    if stored is None and not isinstance(prof.env.get("hardware"), dict):
        return   # hand-made or synthetic: no cost model claimed
    what = (f"cost model {stored.get('name')} {stored.get('digest')}"
            if isinstance(stored, dict) else "the bf16-only roofline of an older slackswap")
    raise InputError(
        f"{source} was priced by {what}; this slackswap prices ops with "
        f"{current['name']} {current['digest']} (benchmarks/fit_costs.py's constants), and "
        "a plan must not mix the two",
        hint="profile the model again with this slackswap (`slackswap profile ... --device "
             "fake`), or plan it with the slackswap that wrote it")
