"""Constant folding: which values of the graph are constants (not work), which of those are
trainable parameters, and which static values are one parameter under another name.

Step 2 of the import (see `importer`). An inference runtime folds initializers, `Constant`
nodes, `Shape` of a statically shaped value and every node computed only from those: they are
not timed. What remains is the work, handed on to `op_units`.

This module does not import torch.
"""
from __future__ import annotations

from math import prod

from .grad_rules import rule_for
from .graph_reader import FLOAT_DTYPES, GraphReader

# Static nodes whose output is (a reshaped / retyped copy of) their single input: when that input
# is a parameter, the output is the same parameter, so gradients accumulate into one tensor.
_PASS_THROUGH = {"Identity", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Transpose", "Cast"}
# Where a float initializer is a weight (see `ConstantFolding.fold`).
_WEIGHT_OPS = {"MatMul", "Gemm", "Conv", "ConvTranspose", "Einsum"}
_NORM_OPS = {"LayerNormalization", "BatchNormalization", "InstanceNormalization",
             "GroupNormalization", "RMSNormalization", "SimplifiedLayerNormalization"}
_ELEMENTWISE = {"Add", "Sub", "Mul", "Div", "Sum", "Max", "Min", "Where"}


class ConstantFolding:
    """Splits a graph's nodes into constants and work. After `fold`: `static` (the constant
    values), `trainable` (those that are parameters) and `canonical` (a static pass-through
    value -> the parameter it is)."""

    def __init__(self, reader: GraphReader):
        self.reader = reader
        self.static: set[str] = set()
        self.trainable: set[str] = set()
        self.canonical: dict[str, str] = {}     # static pass-through value -> its parameter

    def fold(self, nodes) -> list:
        """Mark static values and which of them are trainable; return the nodes that do work.

        ONNX does not say which initializers are weights: exporters also store folded constants
        (rotary cos/sin tables, scaled masks, `x * 0.125`'s scalar) as initializers. Treating
        those as trainable would make e.g. `q * cos` save q for a gradient nobody wants. So a
        float initializer (or a constant folded from one, like a pre-transposed weight) counts
        as a parameter only where a weight sits: any operand of a matmul/conv, the table of a
        Gather, the scale and bias of a norm, or a per-channel vector (at most one dimension
        above 1) in an elementwise op (biases, RMSNorm and LayerScale weights). Scalars never.
        """
        self.static = set(self.reader.inits)
        origin: dict[str, frozenset] = {n: frozenset([n]) for n, dt in self.reader.inits.items()
                                        if dt in FLOAT_DTYPES}
        work = []
        for node in nodes:
            has_subgraph = any(a.type in (5, 10) for a in node.attribute)  # GRAPH, GRAPHS
            rule = rule_for(node.op_type, node.domain)
            ins = [i for i in node.input if i]
            static = node.op_type == "Constant" or (
                not has_subgraph and not (rule is not None and rule.random) and (
                    (node.op_type in ("Shape", "Size") and ins
                     and self.reader.vinfo.get(ins[0], (None,))[0] is not None)
                    or (ins and all(i in self.static for i in ins))))
            if not static:
                work.append(node)
                continue
            outs = [o for o in node.output if o]
            self.static.update(outs)
            roots = frozenset().union(*(origin.get(i, frozenset()) for i in ins))
            for o in outs:
                if roots and self.reader.dtype(o) in FLOAT_DTYPES:
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
                          and prod(self.reader.vinfo.get(n, (None,))[0] or (1,)) > 1}
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
            shape = self.reader.vinfo.get(name, (None,))[0] or ()
            return sum(1 for d in shape if d > 1) <= 1
        return False

