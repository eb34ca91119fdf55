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

Where each step lives: 1 in `load`, 2 in `folding`, 3's grouping into ops in `op_units`, 3 to 5
as profile ops in `builder`; `graph_reader` answers shapes, dtypes and node metadata for all of
them. This module only composes them (`profile_onnx`).

This module does not import torch.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Mapping

from ..errors import InputError
from ..hardware import HardwareSpec
from ..schema import Profile
from .builder import StepBuilder
from .folding import ConstantFolding
from .graph_reader import GraphReader, topo_order
from .load import read_model
from .op_units import OpUnits


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
    model = read_model(p, warnings, input_shapes)
    return _import_step(model, p, hw, warnings)


def _import_step(model, p: Path, hw: HardwareSpec,
                 warnings: list[str]) -> tuple[Profile, list[str]]:
    """The steps of the module docstring in order, each done by its own object: read the graph
    (`GraphReader`), fold the constants (`ConstantFolding`), group the work into forward ops
    (`OpUnits`), then the forward ops, loss and backward into a profile (`StepBuilder`)."""
    reader = GraphReader(model, p)
    reader.check_inputs()
    nodes = topo_order(reader.g, set(reader.inits) | set(reader.graph_inputs))
    folding = ConstantFolding(reader)
    work = folding.fold(nodes)
    if not work:
        raise InputError(f"{p}: the graph computes nothing from its inputs "
                         "(every node folds to a constant)")
    ops = OpUnits(reader)
    step = StepBuilder(reader, folding, ops, hw, warnings)
    unknown: dict[str, int] = {}
    fwd = [step.forward_unit(u, unknown) for u in ops.units(work)]
    if unknown:
        listed = ", ".join(f"{t} (x{c})" for t, c in sorted(unknown.items()))
        warnings.append(
            f"no backward rule for op type(s) {listed}: treated conservatively (every input "
            "saved, backward = 2x forward); saved bytes and times are estimates there")
    for u, *_ in fwd:
        if u.has_subgraph:
            warnings.append(f"{u.op_type} node '{u.name}' has a subgraph; its body "
                            "is treated as one opaque op")
    step.backward(fwd)
    return step.build(), warnings
