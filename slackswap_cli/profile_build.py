"""Assemble a valid profile from ops and tensors, whatever frontend found them.

The torch tracer, the ONNX importer and the synthetic profiles of the tests all describe a step
the same way: tensors (with kind, shape, dtype, size, alias root, recomputable) and ops in
execution order (with inputs, outputs, cost). `ProfileBuilder` derives the rest so that every
frontend derives it identically:

- `consumers` of each tensor, from the ops' inputs,
- `saved`: a forward-produced activation read by a backward op; a root is saved when it or any
  alias of it is,
- the summary: forward/backward time, saved bytes (roots only), the keep-everything peak of
  activation memory (see `schema` for the liveness rule),
- the fingerprint.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .hardware import PRESETS
from .schema import Op, Profile, Tensor, op_fingerprint, saved_flags, validate_profile
from .units import dtype_name as dtype_name  # (re-exported: defined in units.py)
from .units import fmt_bytes

# bytes per element of every dtype name a profile may hold (torch's names; the ONNX importer
# maps ONNX's element types onto them): the one table of element sizes
DTYPE_BYTES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4,
    "int16": 2, "int8": 1, "uint64": 8, "uint32": 4, "uint16": 2, "uint8": 1, "bool": 1,
    "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1, "float8_e5m2fnuz": 1,
    "complex64": 8, "complex128": 16,
}


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a dtype name: `DTYPE_BYTES`, and 4 (float32's) for a name not in it."""
    return DTYPE_BYTES.get(dtype, 4)


@dataclass
class _T:
    name: str
    kind: str
    shape: tuple[int, ...]
    dtype: str
    size_bytes: int
    recomputable: bool
    alias_of: int | None
    producer: int | None = None


@dataclass
class _Op:
    name: str
    target: str
    phase: str
    module: str
    flops: int
    bytes: int
    time_us: float
    time_source: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]


@dataclass
class ProfileBuilder:
    tensors: list[_T] = field(default_factory=list)
    ops: list[_Op] = field(default_factory=list)

    def add_tensor(self, name: str, kind: str, shape, dtype: str, size_bytes: int | None = None,
                   recomputable: bool | None = None, alias_of: int | None = None) -> int:
        """Add a tensor and return its id. `alias_of` may name an alias: it is resolved to its root."""
        shape = tuple(int(s) for s in shape)
        if alias_of is not None and self.tensors[alias_of].alias_of is not None:
            alias_of = self.tensors[alias_of].alias_of
        if size_bytes is None:
            n = 1
            for s in shape:
                n *= s
            size_bytes = n * dtype_bytes(dtype)
        if recomputable is None:
            recomputable = kind == "activation"
        self.tensors.append(_T(name, kind, shape, dtype, int(size_bytes), bool(recomputable),
                               alias_of))
        return len(self.tensors) - 1

    def add_op(self, name: str, target: str, phase: str, inputs, outputs, *, module: str = "",
               flops: int = 0, bytes: int = 0, time_us: float = 0.0,
               time_source: str = "roofline") -> int:
        op_id = len(self.ops)
        outputs = tuple(outputs)
        for tid in outputs:
            if self.tensors[tid].producer is not None:
                raise ValueError(f"tensor {tid} already has producer {self.tensors[tid].producer}")
            self.tensors[tid].producer = op_id
        self.ops.append(_Op(name, target, phase, module, int(flops), int(bytes), float(time_us),
                            time_source, tuple(inputs), outputs))
        return op_id

    def build(self, workload: dict | None = None, env: dict | None = None,
              summary_extra: dict | None = None) -> Profile:
        consumers: list[list[int]] = [[] for _ in self.tensors]
        for i, op in enumerate(self.ops):
            for tid in dict.fromkeys(op.inputs):  # an op reading a tensor twice consumes it once
                consumers[tid].append(i)
        saved = saved_flags(self.tensors, consumers,
                            [op.phase == "backward" for op in self.ops])
        tensors = tuple(
            Tensor(id=j, name=t.name, kind=t.kind, producer=t.producer,
                   consumers=tuple(consumers[j]), shape=t.shape, dtype=t.dtype,
                   size_bytes=t.size_bytes,
                   saved=saved[j],
                   recomputable=t.recomputable and t.kind == "activation",
                   alias_of=t.alias_of)
            for j, t in enumerate(self.tensors))
        ops = tuple(Op(id=i, name=o.name, target=o.target, phase=o.phase, module=o.module,
                       flops=o.flops, bytes=o.bytes, time_us=o.time_us,
                       time_source=o.time_source, inputs=o.inputs, outputs=o.outputs)
                    for i, o in enumerate(self.ops))
        fp = op_fingerprint(ops, tensors)
        prof = Profile(fingerprint=fp, workload=dict(workload or {}), env=dict(env or {}),
                       summary={}, ops=ops, tensors=tensors)
        validate_profile(prof, source="built profile")
        summary = {
            "forward_us": sum(o.time_us for o in ops if o.phase == "forward"),
            "backward_us": sum(o.time_us for o in ops if o.phase == "backward"),
            "saved_bytes": sum(t.size_bytes for t in prof.saved_activations),
            "peak_activation_bytes": prof.keep_all_peak_bytes,
            "n_ops": len(ops),
            "n_saved": len(prof.saved_activations),
            **(summary_extra or {}),
        }
        return Profile(fingerprint=fp, workload=prof.workload, env=prof.env, summary=summary,
                       ops=ops, tensors=tensors)


def recost(prof: Profile, hw) -> Profile:
    """The same step costed on other hardware: every roofline op re-timed on `hw` by the cost
    model (`op_cost.price_profile`: per op class and dtype, fitted constants).

    Only a profile whose ops were all costed by the roofline can be re-costed (each op keeps
    its FLOPs and bytes) and records the hardware it was costed on (`env.hardware`: the whole
    spec, or a preset's name in older profiles); measured or hand-made times belong to where
    they came from, and such a profile is returned unchanged. The fingerprint does not change
    (times are not part of it).
    """
    from .op_cost import default_cost_model, price_profile
    costed_on = prof.env.get("hardware")
    if costed_on is None:
        return prof  # no hardware to re-cost from (measured or hand-made times)
    same_model = prof.env.get("cost_model") == default_cost_model().identity
    if same_model and (costed_on == hw.to_dict() or (
            isinstance(costed_on, str) and costed_on == hw.name and _is_preset(hw))):
        return prof  # already costed there
    if not prof.ops or any(op.time_source != "roofline" for op in prof.ops):
        return prof
    return price_profile(prof, hw)


def _is_preset(hw) -> bool:
    return PRESETS.get(hw.name) == hw


ATTENTION_MIN_SEQ = 128   # below this a seq x seq matrix is small whatever path made it


def attention_warning(prof: Profile) -> str | None:
    """A warning when the step saves seq x seq attention matrices, else None.

    Fused attention kernels (flash, memory-efficient) save only the output and a log-sum-exp
    per row; the unfused "math" path saves the softmax of every head, and with attention
    dropout its mask and output too: (batch, heads, seq, seq) each, which at long sequences
    dwarfs the rest of a layer. The sign is a saved softmax output whose last two dimensions
    are equal (seq x seq) over more than one head; every saved activation of that shape is
    counted.
    """
    squares = set()
    for t in prof.saved_activations:
        sh = t.shape
        if (len(sh) >= 4 and sh[-1] == sh[-2] >= ATTENTION_MIN_SEQ and sh[-3] > 1
                and "softmax" in prof.ops[t.producer].target.lower()):
            squares.add(tuple(sh))
    if not squares:
        return None
    hits = [t for t in prof.saved_activations if tuple(t.shape) in squares]
    total = sum(t.size_bytes for t in hits)
    example = max(hits, key=lambda t: t.size_bytes)
    seq = example.shape[-1]
    return (f"{len(hits)} saved tensors are {seq}x{seq} attention matrices "
            f"({fmt_bytes(total)} of {fmt_bytes(prof.summary.get('saved_bytes', 0))} saved; "
            f"e.g. {example.name} {'x'.join(map(str, example.shape))}): attention ran the "
            "unfused math path. The fused kernel saves none of them: use "
            "torch.nn.functional.scaled_dot_product_attention (Hugging Face: "
            'attn_implementation="sdpa") with attention dropout 0 (e.g. attn_pdrop=0.0 or '
            "attention_dropout=0.0); ignore this if the math path is what you train with")
