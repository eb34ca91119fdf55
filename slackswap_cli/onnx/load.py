"""Reading an ONNX file: load it without its weights' data, check it, apply `--input-shape`
overrides, and run shape inference until every value it can follow has a static shape.

Step 1 of the import (see `importer`): what comes out is an `onnx.ModelProto` whose
`value_info` gives the shapes the rest of the import reads (`graph_reader`).

This module does not import torch. `onnx` is imported inside the functions (`require_onnx`), so
that a missing package is an `InputError` with the install hint, not an ImportError at start-up.
"""
from __future__ import annotations

from math import prod
from pathlib import Path
from typing import Mapping

import numpy as np

from ..errors import FormatError, InputError, require_file
from .grad_rules import rule_for
from .graph_reader import SHAPE_HINT, fmt_dims, shape_of


def read_model(p: Path, warnings: list[str],
               input_shapes: Mapping[str, tuple[int, ...]] | None = None):
    """The model in `p` with its inputs' dims overridden by `input_shapes`, its large weights'
    data dropped and its shapes inferred; problems that do not stop the import go to `warnings`."""
    model = _load(p, warnings)
    init_names = {i.name for i in model.graph.initializer}
    real_inputs = [i for i in model.graph.input if i.name not in init_names]
    if input_shapes:
        _override_input_shapes(model, real_inputs, input_shapes)
    _drop_weight_data(model)
    return _infer_shapes(model, p, warnings)


def require_onnx():
    try:
        import onnx
    except ImportError:  # pragma: no cover - onnx is a dev dependency here
        raise InputError("profiling an ONNX file needs the `onnx` package",
                         hint="pip install 'slackswap[onnx]'") from None
    return onnx


def _load(p: Path, warnings: list[str]):
    onnx = require_onnx()
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
                             hint=f"declared: {fmt_dims(tshape.dim)}")
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
    return sum(1 for vi in vis if shape_of(vi)[0] is None)


def _fold_small_constants(model):
    """A copy of `model` with small static values computed (by onnx's reference evaluator) and
    stored as initializers, or None when that cannot give any unknown shape a value."""
    onnx = require_onnx()   # onnx is optional: imported when a file is read, after this check
    from onnx import numpy_helper
    from onnx.reference import ReferenceEvaluator

    if not _unknown_shapes(model):
        return None
    g = model.graph
    shapes = {vi.name: shape_of(vi)[0] for vi in (*g.input, *g.value_info, *g.output)}
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
    onnx = require_onnx()
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

