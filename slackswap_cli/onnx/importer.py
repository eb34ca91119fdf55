"""ONNX frontend: an exported forward graph -> the same `slackswap.profile` a traced model gives.

An ONNX file holds one forward pass at (ideally) fixed shapes. A training step is forward, a
loss, then backward; this module derives the missing two from the graph:

1. **Load and infer shapes.** The file is read without its external weight files (only shapes
   matter), `--input-shape` overrides replace the declared input dims, and ONNX's shape inference
   gives every value a shape; small shape arithmetic it cannot follow (Where/Equal on shapes) is
   evaluated and inference re-run. A value whose shape is still symbolic or unknown stops the
   import with a hint: export with static shapes or pass `--input-shape name=1x3x224x224`.
2. **Fold what is not work.** Initializers, `Constant` nodes, `Shape` of a statically shaped
   value and every node computed only from those are constants an inference runtime folds: they
   are not timed. Float initializers used where weights sit (and constants derived from them,
   like a pre-transposed weight) are `parameter`s; the rest (shape tensors, masks, rotary
   tables, BatchNorm running stats) are `buffer`s.
3. **Forward ops**, one per remaining node, in topological order. Reshape, Squeeze, Unsqueeze,
   Flatten, Identity and Transpose are views, as in torch: their output aliases the input's
   storage, costs nothing, and counts no bytes. Everything else writes a new tensor. The nodes
   the dynamo exporter made from one fused aten call (SDPA, SiLU; see `FUSED_ATEN`) are one op.
4. **Loss**: if the first graph output is not a scalar, a forward `loss` op reduces it (mean).
   The gradient seed (d loss / d loss) is an `input` tensor.
5. **Backward ops**, one per forward node that leads to the loss and has an input that needs a
   gradient, in reverse order. Each reads the gradients of its outputs and the forward values its
   `GradRule` (see `grad_rules`) says it saves, and writes the gradients of its inputs:
   `activation` (transient) for activations, `gradient` for parameters. A value with several
   consumers gets one gradient buffer: the first backward op creates it, later ones accumulate
   into it (they read it). Model inputs and integer values never need gradients, so e.g. the
   first convolution computes only its weight gradient, as in torch.

FLOPs and bytes come from the static shapes; times are the hardware roofline. Op types without a
rule are treated conservatively (all inputs saved, backward twice the forward) and returned as
warnings. Module paths come from the exporter: the dynamo exporter's `pkg.torch.onnx.name_scopes`
node metadata, or the TorchScript exporter's node names (`/h.0/attn/MatMul` -> `h.0.attn`).

This module does not import torch.
"""
from __future__ import annotations

import ast
import os
import re
from collections import deque
from dataclasses import dataclass, field
from math import prod
from pathlib import Path
from typing import Iterable, Mapping

from ..errors import FormatError, InputError, require_file
from ..hardware import HardwareSpec
from ..profile_build import DTYPE_BYTES, ProfileBuilder
from ..schema import Profile
from .grad_rules import FUSED_ATEN, NodeView, rule_for, unknown_rule

SHAPE_HINT = "export with static input shapes, or pass --input-shape name=1x3x224x224"

# onnx.TensorProto.DataType -> our dtype name (its size: profile_build.DTYPE_BYTES)
_ONNX_DTYPES = {
    1: "float32", 2: "uint8", 3: "int8", 4: "uint16", 5: "int16", 6: "int32", 7: "int64",
    9: "bool", 10: "float16", 11: "float64", 12: "uint32", 13: "uint64", 14: "complex64",
    15: "complex128", 16: "bfloat16", 17: "float8_e4m3fn", 18: "float8_e4m3fnuz",
    19: "float8_e5m2", 20: "float8_e5m2fnuz",
}
_FLOAT_DTYPES = {"float32", "float16", "float64", "bfloat16", "float8_e4m3fn",
                 "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz"}
# Static nodes whose output is (a reshaped / retyped copy of) their single input: when that input
# is a parameter, the output is the same parameter, so gradients accumulate into one tensor.
_PASS_THROUGH = {"Identity", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Transpose", "Cast"}
# Where a float initializer is a weight (see `_Importer.fold_constants`).
_WEIGHT_OPS = {"MatMul", "Gemm", "Conv", "ConvTranspose", "Einsum"}
_NORM_OPS = {"LayerNormalization", "BatchNormalization", "InstanceNormalization",
             "GroupNormalization", "RMSNormalization", "SimplifiedLayerNormalization"}
_ELEMENTWISE = {"Add", "Sub", "Mul", "Div", "Sum", "Max", "Min", "Where"}


def parse_input_shapes(specs: Iterable[str] | None) -> dict[str, tuple[int, ...]]:
    """`["input_ids=2x128", "mask=2x128"]` -> `{"input_ids": (2, 128), "mask": (2, 128)}`
    (`profile --input-shape`; the name is what comes before the last "=")."""
    out: dict[str, tuple[int, ...]] = {}
    for spec in specs or ():
        name, sep, dims = spec.rpartition("=")
        try:
            shape = tuple(int(d) for d in dims.lower().split("x")) if sep and name else ()
        except ValueError:
            shape = ()
        if not shape or any(d <= 0 for d in shape):
            raise InputError(f"cannot read --input-shape {spec!r}",
                             hint="write name=DIMxDIMx..., e.g. --input-shape input=1x3x224x224")
        out[name] = shape
    return out


def profile_onnx(path: str | os.PathLike, hw: HardwareSpec,
                 input_shapes: Mapping[str, tuple[int, ...]] | None = None
                 ) -> tuple[Profile, list[str]]:
    """Profile one training step of the forward graph in an ONNX file.

    Returns (profile, warnings); `input_shapes` replaces the declared dims of graph inputs.
    """
    p = Path(path)
    warnings: list[str] = []
    model = _load(p, warnings)
    init_names = {i.name for i in model.graph.initializer}
    real_inputs = [i for i in model.graph.input if i.name not in init_names]
    if input_shapes:
        _override_input_shapes(model, real_inputs, input_shapes)
    _drop_weight_data(model)
    model = _infer_shapes(model, p, warnings)
    return _Importer(model, p, hw, warnings).run()


# --------------------------------------------------------------------------------------------
# Loading and shape inference
# --------------------------------------------------------------------------------------------
def _onnx():
    try:
        import onnx
    except ImportError:  # pragma: no cover - onnx is a dev dependency here
        raise InputError("profiling an ONNX file needs the `onnx` package",
                         hint="pip install 'slackswap[onnx]'") from None
    return onnx


def _load(p: Path, warnings: list[str]):
    onnx = _onnx()
    require_file(p, "ONNX file", hint="check the path")
    hint = "pass a .onnx file written by torch.onnx.export (or another ONNX exporter)"
    try:
        # Weights in external files are not needed (shapes live in the initializers' dims), and
        # loading them would cost memory and fail when they were not copied along.
        model = onnx.load(str(p), load_external_data=False)
    except Exception as exc:  # protobuf raises DecodeError, RuntimeWarning, ValueError, ...
        raise FormatError(f"{p} is not a valid ONNX model ({type(exc).__name__}: {exc})",
                          hint=hint) from None
    # Protobuf parses some garbage without complaint: require the parts every model has.
    if not model.HasField("graph") or not model.graph.node or not model.opset_import:
        raise FormatError(f"{p} is not an ONNX model (no graph, nodes or opset)", hint=hint)
    external = any(init.data_location == 1 for init in model.graph.initializer)  # EXTERNAL
    try:
        # With weights in external files the checker must resolve them relative to the model's
        # folder, so it gets the path; a model without them is checked in memory.
        onnx.checker.check_model(str(p) if external else model)
    except Exception as exc:
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if not (external and ("external" in msg.lower() or "stored in" in msg)):
            raise FormatError(f"{p} is a malformed ONNX model: {msg}", hint=hint) from None
        warnings.append(f"external weight data could not be checked ({msg}); only shapes are "
                        "needed, so the profile is unaffected")
    return model


_FOLD_MAX_ELEMENTS = 1 << 16   # constants worth evaluating: shape arithmetic and masks


def _drop_weight_data(model) -> None:
    """Free the data of large inline initializers (checked already; only their dims are used),
    so that shape inference does not copy the weights back and forth."""
    for init in model.graph.initializer:
        if init.data_location != 1 and prod(init.dims) > _FOLD_MAX_ELEMENTS:
            for name in ("raw_data", "float_data", "int32_data", "int64_data", "double_data",
                         "uint64_data", "string_data"):
                init.ClearField(name)


def _override_input_shapes(model, real_inputs, input_shapes) -> None:
    names = [i.name for i in real_inputs]
    unknown = sorted(set(input_shapes) - set(names))
    if unknown:
        raise InputError(f"--input-shape names {', '.join(unknown)}, which the model does not "
                         f"take as input", hint=f"the model's inputs are: {', '.join(names)}")
    for inp in real_inputs:
        if inp.name not in input_shapes:
            continue
        shape = tuple(int(d) for d in input_shapes[inp.name])
        if any(d <= 0 for d in shape):
            raise InputError(f"--input-shape {inp.name} has a non-positive dimension: {shape}")
        tshape = inp.type.tensor_type.shape
        if len(tshape.dim) and len(tshape.dim) != len(shape):
            raise InputError(f"--input-shape gives {inp.name} {len(shape)} dims, the model "
                             f"declares {len(tshape.dim)}",
                             hint=f"declared: {_fmt_dims(tshape.dim)}")
        del tshape.dim[:]
        for d in shape:
            tshape.dim.add().dim_value = d
    # Shapes inferred for the old input dims would contradict the new ones.
    del model.graph.value_info[:]


def _infer_shapes(model, p: Path, warnings: list[str]):
    """Shape inference, then constant evaluation of the small static subgraphs and inference
    again while that gives more values a shape: ONNX's own inference propagates values through
    Shape/Gather/Concat only, so a TorchScript export's `Where(Equal(...))` shape arithmetic
    (HF BERT's token-type ids, for one) leaves dimensions unknown until it is evaluated."""
    model = _infer_once(model, p, warnings)
    for _ in range(4):
        folded = _fold_small_constants(model)
        if folded is None:
            break
        model = _infer_once(folded, p, warnings)
    return model


def _unknown_shapes(model) -> int:
    vis = (*model.graph.value_info, *model.graph.output)
    return sum(1 for vi in vis if _shape_of(vi)[0] is None)


def _fold_small_constants(model):
    """A copy of `model` with small static values computed (by onnx's reference evaluator) and
    stored as initializers, or None when that cannot give any unknown shape a value."""
    import numpy as np
    onnx = _onnx()
    from onnx import numpy_helper
    from onnx.reference import ReferenceEvaluator

    if not _unknown_shapes(model):
        return None
    g = model.graph
    shapes = {vi.name: _shape_of(vi)[0] for vi in (*g.input, *g.value_info, *g.output)}
    known: dict[str, object] = {}
    for init in g.initializer:
        if init.data_location != 1 and prod(init.dims) <= _FOLD_MAX_ELEMENTS:
            known[init.name] = numpy_helper.to_array(init)
    new_values: dict[str, object] = {}
    graph_outputs = {o.name for o in g.output}
    for node in g.node:
        if any(a.type in (5, 10) for a in node.attribute) or node.domain not in ("", "ai.onnx"):
            continue
        ins = [i for i in node.input if i]
        if node.op_type == "Shape" and ins and shapes.get(ins[0]) is not None:
            start = next((a.i for a in node.attribute if a.name == "start"), 0)
            end = next((a.i for a in node.attribute if a.name == "end"), None)
            value = np.array(shapes[ins[0]][start:end], dtype=np.int64)
            outs = [value]
        elif node.op_type == "Constant" or (ins and all(i in known for i in ins)):
            if rule_for(node.op_type) is not None and rule_for(node.op_type).random:
                continue
            try:
                outs = ReferenceEvaluator(node).run(None, {i: known[i] for i in ins})
            except Exception:
                continue
        else:
            continue
        for name, value in zip((o for o in node.output if o), outs):
            if getattr(value, "size", _FOLD_MAX_ELEMENTS + 1) <= _FOLD_MAX_ELEMENTS:
                known[name] = value
                if node.op_type != "Constant" and name not in graph_outputs:
                    new_values[name] = value
    if not new_values:
        return None
    folded = onnx.ModelProto()
    folded.CopyFrom(model)
    keep = [n for n in folded.graph.node
            if not all(o in new_values for o in n.output if o) or not any(n.output)]
    del folded.graph.node[:]
    folded.graph.node.extend(keep)
    for name, value in new_values.items():
        folded.graph.initializer.append(numpy_helper.from_array(value, name))
    # drop stale inferred shapes so the next pass infers them from the new constants
    del folded.graph.value_info[:]
    return folded


def _infer_once(model, p: Path, warnings: list[str]):
    onnx = _onnx()
    try:
        return onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True,
                                                 data_prop=True)
    except Exception as exc:
        strict_error = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    # Strict inference stops at the first op it cannot infer (e.g. a custom-domain op); the
    # lenient pass may still give every value we need a shape. Missing ones are reported later.
    try:
        model = onnx.shape_inference.infer_shapes(model, check_type=False, strict_mode=False,
                                                  data_prop=True)
    except Exception as exc:
        raise FormatError(f"{p}: ONNX shape inference failed: {exc}", hint=SHAPE_HINT) from None
    warnings.append(f"strict shape inference failed ({strict_error}); used lenient inference")
    return model


def _fmt_dims(dims) -> str:
    return "x".join(str(d.dim_value) if d.HasField("dim_value") else (d.dim_param or "?")
                    for d in dims) or "(scalar)"


def _shape_of(vi):
    """(shape tuple or None when not fully static, dtype name, printable dims)."""
    if vi.type.HasField("sequence_type") or vi.type.HasField("optional_type"):
        return None, "float32", ("a sequence, not a tensor (sequence ops are not supported; "
                                 "torch's dynamo exporter emits them with optimize=False, "
                                 "its default optimize=True removes them)")
    tt = vi.type.tensor_type
    dtype = _ONNX_DTYPES.get(tt.elem_type, f"onnx_type_{tt.elem_type}")
    if not vi.type.HasField("tensor_type") or not tt.HasField("shape"):
        return None, dtype, "unknown rank"
    dims = tt.shape.dim
    if all(d.HasField("dim_value") and d.dim_value > 0 for d in dims):
        return tuple(int(d.dim_value) for d in dims), dtype, _fmt_dims(dims)
    return None, dtype, _fmt_dims(dims)


def _module_of(node) -> str:
    """Module path the exporter recorded for a node ("" when it recorded none)."""
    for prop in node.metadata_props:
        if prop.key == "pkg.torch.onnx.name_scopes":
            try:
                scopes = ast.literal_eval(prop.value)
            except (ValueError, SyntaxError):
                break
            # [..., "h.0", "h.0.attn", "matmul"]: the last entry is the op, the one before it
            # the module
            if isinstance(scopes, list) and len(scopes) >= 2:
                return str(scopes[-2])
            return ""
    if node.name.startswith("/"):                  # TorchScript exporter: /h.0/attn/MatMul
        return ".".join(part for part in node.name.split("/")[1:-1] if part)
    return ""


_FX_NODE = re.compile(r"^%(\S+) : .*?target=torch\.ops\.aten\.(\w+)\.")


def _fx_call(node) -> tuple[str, str] | None:
    """(fx node name, aten op) the dynamo exporter recorded for a node, if any."""
    for prop in node.metadata_props:
        if prop.key == "pkg.torch.onnx.fx_node":
            m = _FX_NODE.match(prop.value)
            return (m.group(1), m.group(2)) if m else None
    return None


@dataclass
class _Unit:
    """What becomes one forward op: an ONNX node, or the nodes of one fused aten call."""
    op_type: str
    domain: str
    name: str
    inputs: list            # value names, "" for an absent optional input
    outputs: list
    attrs: dict
    module: str
    target: str
    has_subgraph: bool = False
    nodes: list = field(default_factory=list)


def _topo_order(graph, known: set[str]) -> list:
    """Nodes in an order where every input is produced before use (the given one if it is)."""
    nodes = list(graph.node)
    avail = set(known)
    ok = True
    for n in nodes:
        if any(i and i not in avail for i in n.input):
            ok = False
            break
        avail.update(o for o in n.output if o)
    if ok:
        return nodes
    producer = {o: k for k, n in enumerate(nodes) for o in n.output if o}
    deps = [{producer[i] for i in n.input if i and i in producer} for n in nodes]
    users: list[list[int]] = [[] for _ in nodes]
    for k, ds in enumerate(deps):
        for d in ds:
            users[d].append(k)
    indeg = [len(ds) for ds in deps]
    ready = deque(k for k, d in enumerate(indeg) if d == 0)
    order = []
    while ready:
        k = ready.popleft()
        order.append(nodes[k])
        for u in users[k]:
            indeg[u] -= 1
            if indeg[u] == 0:
                ready.append(u)
    if len(order) != len(nodes):
        raise FormatError("the ONNX graph has a cycle or reads values nothing produces",
                          hint="re-export the model")
    return order


# --------------------------------------------------------------------------------------------
# The import proper
# --------------------------------------------------------------------------------------------
class _Importer:
    def __init__(self, model, p: Path, hw: HardwareSpec, warnings: list[str]):
        self.model, self.p, self.hw, self.warnings = model, p, hw, warnings
        self.g = model.graph
        self.b = ProfileBuilder()
        self.tid: dict[str, int] = {}           # value name -> tensor id
        self.canonical: dict[str, str] = {}     # static pass-through value -> its parameter
        self.requires_grad: set[str] = set()
        self.vinfo: dict[str, tuple] = {}
        for vi in (*self.g.input, *self.g.output, *self.g.value_info):
            self.vinfo[vi.name] = _shape_of(vi)
        self.inits = {}
        for init in self.g.initializer:
            dtype = _ONNX_DTYPES.get(init.data_type, f"onnx_type_{init.data_type}")
            self.inits[init.name] = dtype
            self.vinfo[init.name] = (tuple(int(d) for d in init.dims), dtype,
                                     "x".join(map(str, init.dims)))
        self.graph_inputs = [i.name for i in self.g.input if i.name not in self.inits]
        self.inputs_checked = False

    # -- values --------------------------------------------------------------------------------
    def shape(self, name: str, node=None) -> tuple[int, ...]:
        shape, _, dims = self.vinfo.get(name, (None, None, "unknown"))
        if shape is None:
            where = f" (output of {node.op_type} node '{node.name}')" if node is not None else ""
            hint = SHAPE_HINT
            if self.inputs_checked:   # the inputs are static: inference itself gave up here
                hint = ("the inputs are static, but ONNX shape inference cannot follow this "
                        "value; re-export with torch.onnx.export(..., dynamo=True), or simplify "
                        "the graph first (e.g. with onnxsim)")
            raise InputError(f"{self.p}: the shape of '{name}'{where} is not static: {dims}",
                             hint=hint)
        return shape

    def dtype(self, name: str) -> str:
        return self.vinfo.get(name, (None, "float32", ""))[1]

    def size_bytes(self, shape, dtype) -> int:
        return prod(shape) * DTYPE_BYTES.get(dtype, 4)

    def add(self, name: str, kind: str, shape, dtype: str, **kw) -> int:
        """Add a tensor sized by ONNX's element sizes (a view's own size is 0)."""
        size = 0 if kw.get("alias_of") is not None else self.size_bytes(shape, dtype)
        return self.b.add_tensor(name, kind, shape, dtype, size_bytes=size, **kw)

    def tensor(self, name: str) -> int:
        """Tensor id of a value that exists before the current node (input, parameter, constant)."""
        name = self.canonical.get(name, name)
        if name in self.tid:
            return self.tid[name]
        if name in self.static:
            kind = "parameter" if name in self.trainable else "buffer"
        elif name in self.graph_inputs:
            kind = "input"
        else:  # pragma: no cover - topological order guarantees producers come first
            raise FormatError(f"{self.p}: value '{name}' is read before it is produced")
        self.tid[name] = self.add(name, kind, self.shape(name), self.dtype(name))
        return self.tid[name]

    # -- passes ----------------------------------------------------------------------------
    def check_inputs(self) -> None:
        bad = []
        for name in self.graph_inputs:
            shape, _, dims = self.vinfo[name]
            if shape is None:
                bad.append(f"{name} ({dims})")
        if bad:
            example = " ".join(f"--input-shape {n.split(' ')[0]}=..." for n in bad)
            raise InputError(f"{self.p}: input shapes are not static: {', '.join(bad)}",
                             hint=f"export with static input shapes, or pass {example} "
                                  "(e.g. --input-shape name=1x3x224x224)")
        self.inputs_checked = True

    def fold_constants(self, nodes) -> list:
        """Mark static values and which of them are trainable; return the nodes that do work.

        ONNX does not say which initializers are weights: exporters also store folded constants
        (rotary cos/sin tables, scaled masks, `x * 0.125`'s scalar) as initializers. Treating
        those as trainable would make e.g. `q * cos` save q for a gradient nobody wants. So a
        float initializer (or a constant folded from one, like a pre-transposed weight) counts
        as a parameter only where a weight sits: any operand of a matmul/conv, the table of a
        Gather, the scale and bias of a norm, or a per-channel vector (at most one dimension
        above 1) in an elementwise op (biases, RMSNorm and LayerScale weights). Scalars never.
        """
        self.static = set(self.inits)
        origin: dict[str, frozenset] = {n: frozenset([n]) for n, dt in self.inits.items()
                                        if dt in _FLOAT_DTYPES}
        work = []
        for node in nodes:
            has_subgraph = any(a.type in (5, 10) for a in node.attribute)  # GRAPH, GRAPHS
            rule = rule_for(node.op_type, node.domain)
            ins = [i for i in node.input if i]
            static = node.op_type == "Constant" or (
                not has_subgraph and not (rule is not None and rule.random) and (
                    (node.op_type in ("Shape", "Size") and ins
                     and self.vinfo.get(ins[0], (None,))[0] is not None)
                    or (ins and all(i in self.static for i in ins))))
            if not static:
                work.append(node)
                continue
            outs = [o for o in node.output if o]
            self.static.update(outs)
            roots = frozenset().union(*(origin.get(i, frozenset()) for i in ins))
            for o in outs:
                if roots and self.dtype(o) in _FLOAT_DTYPES:
                    origin[o] = roots
                    # a reshaped / transposed / cast weight is the same parameter
                    if (node.op_type in _PASS_THROUGH and ins and ins[0] in origin
                            and len(roots) == 1):
                        self.canonical[o] = self.canonical.get(ins[0], ins[0])
        trainable_roots: set[str] = set()
        for node in work:
            for i, name in enumerate(node.input):
                if name in origin and self._weight_slot(node, i, name):
                    trainable_roots |= origin[name]
        self.trainable = {n for n, roots in origin.items() if roots & trainable_roots
                          and prod(self.vinfo.get(n, (None,))[0] or (1,)) > 1}
        return work

    def _weight_slot(self, node, i: int, name: str) -> bool:
        op = node.op_type
        if rule_for(op, node.domain) is None:
            return True       # unknown op: conservatively a weight
        if op in _WEIGHT_OPS:
            return True
        if op in ("Gather", "GatherElements", "GatherND"):
            return i == 0
        if op in _NORM_OPS or op == "PRelu":
            return i in (1, 2)
        if op in _ELEMENTWISE:
            shape = self.vinfo.get(name, (None,))[0] or ()
            return sum(1 for d in shape if d > 1) <= 1
        return False

    def node_unit(self, node, k: int) -> _Unit:
        onnx = _onnx()
        return _Unit(op_type=node.op_type, domain=node.domain,
                     name=node.name or f"{node.op_type}_{k}", inputs=list(node.input),
                     outputs=list(node.output),
                     attrs={a.name: onnx.helper.get_attribute_value(a) for a in node.attribute
                            if a.type not in (5, 10)},
                     module=_module_of(node), target=_target(node),
                     has_subgraph=any(a.type in (5, 10) for a in node.attribute), nodes=[node])

    def view(self, u: _Unit) -> NodeView:
        node = u.nodes[-1] if len(u.nodes) == 1 else None
        return NodeView(
            op_type=u.op_type, attrs=u.attrs,
            in_shapes=tuple(self.shape(i) if i else None for i in u.inputs),
            in_dtypes=tuple(self.dtype(i) if i else None for i in u.inputs),
            out_shapes=tuple(self.shape(o, node) if o else None for o in u.outputs),
            out_dtypes=tuple(self.dtype(o) if o else None for o in u.outputs))

    def const_value(self, name: str):
        """The value of a small constant (inline initializer or Constant node), else None."""
        from onnx import numpy_helper
        if not hasattr(self, "_consts"):
            self._consts = {i.name: i for i in self.g.initializer
                            if i.data_location != 1 and prod(i.dims) <= 16}
            for n in self.g.node:
                if n.op_type == "Constant" and n.output:
                    for a in n.attribute:
                        if a.name == "value" and prod(a.t.dims) <= 16:
                            self._consts[n.output[0]] = a.t
        t = self._consts.get(name)
        return None if t is None else numpy_helper.to_array(t)

    def dropout_active(self, u: _Unit) -> bool:
        """A Dropout with ratio 0 or training_mode false is the identity, as torch runs it."""
        ratio = self.const_value(u.inputs[1]) if len(u.inputs) > 1 and u.inputs[1] else None
        if ratio is not None and float(ratio) == 0.0:
            return False
        train = self.const_value(u.inputs[2]) if len(u.inputs) > 2 and u.inputs[2] else None
        if len(u.inputs) > 2 and u.inputs[2] and train is not None and not bool(train):
            return False
        return True

    def units(self, work) -> list[_Unit]:
        """One unit per node, except the nodes of one fused aten call (see FUSED_ATEN)."""
        units = [self.node_unit(n, k) for k, n in enumerate(work)]
        groups: dict[str, list[int]] = {}
        for k, n in enumerate(work):
            call = _fx_call(n)
            if call and call[1] in FUSED_ATEN:
                groups.setdefault(call[0], []).append(k)
        if not groups:
            return units
        consumers: dict[str, list[int]] = {}
        for k, n in enumerate(work):
            for i in n.input:
                if i:
                    consumers.setdefault(i, []).append(k)
        graph_outputs = {o.name for o in self.g.output}
        replace: dict[int, _Unit | None] = {}
        for fx_name, members in groups.items():
            if len(members) < 2:
                continue
            inside = set(members)
            produced = {o for k in members for o in work[k].output if o}
            ext_in = list(dict.fromkeys(i for k in members for i in work[k].input
                                        if i and i not in produced))
            ext_out = [o for k in members for o in work[k].output if o and (
                o in graph_outputs or any(c not in inside for c in consumers.get(o, ())))]
            last = members[-1]
            # the fused op runs where its last node was: nobody outside may read its values earlier
            if not ext_out or any(c < last for o in ext_out for c in consumers.get(o, ())
                                  if c not in inside):
                continue
            inner = [self.view(units[k]) for k in members]
            rules = [rule_for(u.op_type, u.domain) or unknown_rule(u.op_type)
                     for u in (units[k] for k in members)]
            inner_flops = sum(r.fwd_flops(v) for r, v in zip(rules, inner))
            inner_mm = sum(r.fwd_flops(v) for r, v in zip(rules, inner)
                           if v.op_type in ("MatMul", "Gemm", "Einsum"))
            aten = _fx_call(work[last])[1]
            replace[last] = _Unit(op_type=aten, domain="aten", name=fx_name, inputs=ext_in,
                                  outputs=ext_out, attrs={"inner_flops": inner_flops,
                                                          "inner_mm_flops": inner_mm},
                                  module=_module_of(work[last]), target=f"onnx.aten.{aten}",
                                  nodes=[work[k] for k in members])
            for k in members[:-1]:
                replace[k] = None
        return [replace.get(k, u) for k, u in enumerate(units) if replace.get(k, u) is not None]

    def run(self) -> tuple[Profile, list[str]]:
        self.check_inputs()
        nodes = _topo_order(self.g, set(self.inits) | set(self.graph_inputs))
        work = self.fold_constants(nodes)
        if not work:
            raise InputError(f"{self.p}: the graph computes nothing from its inputs "
                             "(every node folds to a constant)")
        unknown: dict[str, int] = {}
        fwd = [self.forward_unit(u, unknown) for u in self.units(work)]
        if unknown:
            listed = ", ".join(f"{t} (x{c})" for t, c in sorted(unknown.items()))
            self.warnings.append(
                f"no backward rule for op type(s) {listed}: treated conservatively (every input "
                "saved, backward = 2x forward); saved bytes and times are estimates there")
        for u, *_ in fwd:
            if u.has_subgraph:
                self.warnings.append(f"{u.op_type} node '{u.name}' has a subgraph; its body "
                                     "is treated as one opaque op")
        self.backward(fwd)
        return self.build(), self.warnings

    def rule(self, u: _Unit, unknown: dict[str, int]):
        """The gradient rule of unit `u`; a unit without one is counted in `unknown` and gets
        the conservative rule."""
        if u.domain == "aten":
            rule = FUSED_ATEN[u.op_type]
        else:
            rule = rule_for(u.op_type, u.domain)
        if u.op_type == "Dropout" and not self.dropout_active(u):
            rule = rule_for("Identity")
        if rule is None:
            key = f"{u.domain}::{u.op_type}" if u.domain else u.op_type
            unknown[key] = unknown.get(key, 0) + 1
            rule = unknown_rule(u.op_type)
        return rule

    def forward_unit(self, u: _Unit, unknown: dict[str, int]) -> tuple:
        """Add unit `u`'s forward op and its output tensors to the profile; returns (unit,
        rule, view, in tids, out tids, extra tids) for `backward`."""
        b = self.b
        rule = self.rule(u, unknown)
        view = self.view(u)
        in_tids = [self.tensor(i) if i else None for i in u.inputs]
        grad_in = range(len(u.inputs)) if rule.grad_inputs is None else rule.grad_inputs
        in_needs = rule.differentiable and any(
            i < len(u.inputs) and u.inputs[i]
            and self.needs_grad(u.inputs[i]) for i in grad_in)
        out_tids: list[int | None] = []
        for j, o in enumerate(u.outputs):
            if not o:
                out_tids.append(None)
                continue
            alias_of, kind = None, "activation"
            if rule.alias and j == 0 and in_tids and in_tids[0] is not None:
                root = b.tensors[in_tids[0]]
                alias_of = in_tids[0] if root.alias_of is None else root.alias_of
                root_kind = b.tensors[alias_of].kind
                kind = "activation" if root_kind == "activation" else root_kind
            t = self.add(o, kind, self.shape(o), self.dtype(o),
                         recomputable=not rule.random, alias_of=alias_of)
            self.tid[o] = t
            out_tids.append(t)
            grad_out = rule.grad_outputs is None or j in rule.grad_outputs
            if in_needs and grad_out and self.dtype(o) in _FLOAT_DTYPES:
                self.requires_grad.add(o)
        extra_tids = []
        for e in rule.extras(view):
            if e.output is not None and e.output < len(u.outputs) and u.outputs[e.output]:
                extra_tids.append(out_tids[e.output])
            else:
                base = next((o for o in u.outputs if o), u.name)
                extra_tids.append(self.add(f"{base}.{e.suffix}", "activation", e.shape,
                                           e.dtype, recomputable=not rule.random))
        outs_all = [t for t in out_tids if t is not None]
        outs_all += [t for t in extra_tids if t not in outs_all]
        ins_all = [t for t in in_tids if t is not None]
        flops = rule.fwd_flops(view)
        if rule.alias:
            nbytes = 0
        elif rule.gather_like:   # reads as many data bytes as it writes, plus the indices
            nbytes = 2 * sum(b.tensors[t].size_bytes for t in outs_all) + sum(
                b.tensors[t].size_bytes for t in dict.fromkeys(ins_all[1:]))
        else:
            nbytes = self.touched(ins_all + outs_all)
        b.add_op(u.name, u.target, "forward", ins_all, outs_all, module=u.module,
                 flops=flops, bytes=nbytes, time_us=self.hw.roofline_us(flops, nbytes))
        return u, rule, view, in_tids, out_tids, extra_tids

    def build(self) -> Profile:
        """The profile, once forward and backward are in: workload, environment, summary."""
        b = self.b
        opset = next((o.version for o in self.model.opset_import if o.domain in ("", "ai.onnx")),
                     None)
        producer = " ".join(x for x in (self.model.producer_name, self.model.producer_version) if x)
        shapes = {n: list(self.shape(n)) for n in self.graph_inputs}
        workload = {"name": self.p.stem, "path": str(self.p.resolve()), "source": "onnx",
                    "input_shapes": shapes,
                    "input_dtypes": {n: self.dtype(n) for n in self.graph_inputs},
                    "loss": self.loss_desc}
        env = {"torch_version": None, "device": "onnx", "device_name": None,
               "hardware": self.hw.to_dict(), "onnx_opset": opset, "producer": producer or None}
        extra = {"forward_flops": sum(o.flops for o in b.ops if o.phase == "forward"),
                 "backward_flops": sum(o.flops for o in b.ops if o.phase == "backward"),
                 "warnings": list(self.warnings)}
        return b.build(workload=workload, env=env, summary_extra=extra)

    def needs_grad(self, name: str) -> bool:
        name = self.canonical.get(name, name)
        return name in self.requires_grad or name in self.trainable

    def touched(self, tids) -> int:
        """Bytes an op reads and writes: each distinct tensor once, views at their root's size."""
        total = 0
        for t in dict.fromkeys(tids):
            bt = self.b.tensors[t]
            total += (self.b.tensors[bt.alias_of].size_bytes if bt.alias_of is not None
                      else bt.size_bytes)
        return total

    # -- loss and backward -------------------------------------------------------------------
    def backward(self, fwd) -> None:
        b = self.b
        out_name = self.g.output[0].name
        out_name = self.canonical.get(out_name, out_name)
        if out_name not in self.requires_grad:
            raise InputError(f"{self.p}: the first graph output '{out_name}' does not depend on "
                             "any trainable parameter, so there is no training step to profile",
                             hint="export the model whose first output is the logits or the loss")
        out_t = self.tid[out_name]
        out_shape, out_dtype = self.shape(out_name), self.dtype(out_name)
        seed = b.add_tensor("grad_loss", "input", (), "float32")
        grad: dict[int, int] = {}
        if prod(out_shape) == 1:
            self.loss_desc = f"the graph output '{out_name}' (a scalar)"
            grad[out_t] = seed
        else:
            self.loss_desc = f"mean of the graph output '{out_name}'"
            loss = b.add_tensor("loss", "activation", (), "float32")
            n, size = prod(out_shape), b.tensors[out_t].size_bytes
            b.add_op("loss", "onnx.loss.mean", "forward", (out_t,), (loss,), flops=n,
                     bytes=size + 4, time_us=self.hw.roofline_us(n, size + 4))
            g = b.add_tensor(f"grad.{out_name}", "activation", out_shape, out_dtype)
            b.add_op("loss.backward", "onnx.loss.mean.backward", "backward", (seed,), (g,),
                     flops=n, bytes=size + 4, time_us=self.hw.roofline_us(n, size + 4))
            grad[out_t] = g

        for u, rule, view, in_tids, out_tids, extra_tids in reversed(fwd):
            if not rule.differentiable:
                continue
            gys = [grad[t] for j, t in enumerate(out_tids)
                   if t is not None and t in grad
                   and (rule.grad_outputs is None or j in rule.grad_outputs)]
            if not gys:
                continue   # no path from this node to the loss
            grad_in = range(len(u.inputs)) if rule.grad_inputs is None else rule.grad_inputs
            need = frozenset(i for i in grad_in if i < len(u.inputs) and u.inputs[i]
                             and self.needs_grad(u.inputs[i]))
            if not need:
                continue
            saved = []
            for kind, i in rule.saves(view, need):
                src = in_tids if kind == "in" else out_tids if kind == "out" else extra_tids
                if i < len(src) and src[i] is not None:
                    saved.append(src[i])
            outputs, accum, seen = [], [], set()
            for i in sorted(need):
                t = in_tids[i]
                if t in seen:            # the same tensor in two slots (x * x): one gradient
                    continue
                seen.add(t)
                if t in grad:            # another consumer already started this gradient
                    accum.append(grad[t])
                    continue
                ft = b.tensors[t]
                if ft.kind in ("parameter", "buffer", "input"):
                    g = b.add_tensor(f"grad.{ft.name}", "gradient", ft.shape, ft.dtype,
                                     recomputable=False)
                elif rule.alias and len(gys) == 1:   # a view's gradient is a view of the gradient
                    g = b.add_tensor(f"grad.{ft.name}", "activation", ft.shape, ft.dtype,
                                     size_bytes=0, alias_of=gys[0])
                else:
                    g = b.add_tensor(f"grad.{ft.name}", "activation", ft.shape, ft.dtype)
                grad[t] = g
                outputs.append(g)
            ins = list(dict.fromkeys(gys + saved + accum))
            flops = rule.bwd_flops(view, need) + sum(prod(b.tensors[a].shape) for a in accum)
            pure_view = rule.alias and not accum
            nbytes = 0 if pure_view else self.touched(ins + outputs)
            b.add_op(f"{u.name}.backward", f"{u.target}.backward", "backward", ins, outputs,
                     module=u.module, flops=flops, bytes=nbytes,
                     time_us=self.hw.roofline_us(flops, nbytes))


def _target(node) -> str:
    dom = node.domain if node.domain not in ("", "ai.onnx") else ""
    return f"onnx.{dom + '.' if dom else ''}{node.op_type}"
