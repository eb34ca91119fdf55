"""Reading an ONNX graph: the shape and dtype of every value, small constant values, an order
of the nodes where producers come first, and what exporters record on a node (its module path,
the aten call it came from, the op's profile target). Nothing here decides what is work or what
needs a gradient (`folding`, `builder`).

This module does not import torch.
"""
from __future__ import annotations

import ast
import re
from collections import deque
from math import prod
from pathlib import Path

from ..errors import FormatError, InputError
from ..profile_build import dtype_bytes

SHAPE_HINT = "export with static input shapes, or pass --input-shape name=1x3x224x224"

# onnx.TensorProto.DataType -> our dtype name (its size: profile_build.DTYPE_BYTES)
ONNX_DTYPES = {
    1: "float32", 2: "uint8", 3: "int8", 4: "uint16", 5: "int16", 6: "int32", 7: "int64",
    9: "bool", 10: "float16", 11: "float64", 12: "uint32", 13: "uint64", 14: "complex64",
    15: "complex128", 16: "bfloat16", 17: "float8_e4m3fn", 18: "float8_e4m3fnuz",
    19: "float8_e5m2", 20: "float8_e5m2fnuz",
}
FLOAT_DTYPES = {"float32", "float16", "float64", "bfloat16", "float8_e4m3fn",
                "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz"}


class GraphReader:
    """One shape-inferred graph's values: shape, dtype and size by name, small constants' values,
    and the check that the graph's inputs are static. Read-only after construction."""

    def __init__(self, model, p: Path):
        self.model, self.p = model, p
        self.g = model.graph
        self.vinfo: dict[str, tuple] = {}
        for vi in (*self.g.input, *self.g.output, *self.g.value_info):
            self.vinfo[vi.name] = shape_of(vi)
        self.inits = {}
        for init in self.g.initializer:
            dtype = ONNX_DTYPES.get(init.data_type, f"onnx_type_{init.data_type}")
            self.inits[init.name] = dtype
            self.vinfo[init.name] = (tuple(int(d) for d in init.dims), dtype,
                                     "x".join(map(str, init.dims)))
        self.graph_inputs = [i.name for i in self.g.input if i.name not in self.inits]
        self.inputs_checked = False

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
        return prod(shape) * dtype_bytes(dtype)

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

    def const_value(self, name: str):
        """The value of a small constant (inline initializer or Constant node), else None."""
        # deferred: onnx loads only when a file is imported (load.require_onnx checked it is there)
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


def fmt_dims(dims) -> str:
    return "x".join(str(d.dim_value) if d.HasField("dim_value") else (d.dim_param or "?")
                    for d in dims) or "(scalar)"


def shape_of(vi):
    """(shape tuple or None when not fully static, dtype name, printable dims)."""
    if vi.type.HasField("sequence_type") or vi.type.HasField("optional_type"):
        return None, "float32", ("a sequence, not a tensor (sequence ops are not supported; "
                                 "torch's dynamo exporter emits them with optimize=False, "
                                 "its default optimize=True removes them)")
    tt = vi.type.tensor_type
    dtype = ONNX_DTYPES.get(tt.elem_type, f"onnx_type_{tt.elem_type}")
    if not vi.type.HasField("tensor_type") or not tt.HasField("shape"):
        return None, dtype, "unknown rank"
    dims = tt.shape.dim
    if all(d.HasField("dim_value") and d.dim_value > 0 for d in dims):
        return tuple(int(d.dim_value) for d in dims), dtype, fmt_dims(dims)
    return None, dtype, fmt_dims(dims)


def module_of(node) -> str:
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


def fx_call(node) -> tuple[str, str] | None:
    """(fx node name, aten op) the dynamo exporter recorded for a node, if any."""
    for prop in node.metadata_props:
        if prop.key == "pkg.torch.onnx.fx_node":
            m = _FX_NODE.match(prop.value)
            return (m.group(1), m.group(2)) if m else None
    return None


def topo_order(graph, known: set[str]) -> list:
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



def target_of(node) -> str:
    dom = node.domain if node.domain not in ("", "ai.onnx") else ""
    return f"onnx.{dom + '.' if dom else ''}{node.op_type}"
