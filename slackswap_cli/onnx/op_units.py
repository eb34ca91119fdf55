"""Forward ops from the work nodes: one unit per ONNX node, except the nodes the dynamo
exporter made from one fused aten call (SDPA, SiLU; see `grad_rules.FUSED_ATEN`), which become
one unit; and the `NodeView` of a unit that the gradient rules read.

Step 3 of the import (see `importer`), before `builder` turns each unit into profile ops.

This module does not import torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .grad_rules import FUSED_ATEN, NodeView, rule_for, unknown_rule
from .graph_reader import GraphReader, fx_call, module_of, target_of
from .load import require_onnx


@dataclass
class Unit:
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


class OpUnits:
    """The units (future forward ops) of a graph's work nodes, and what a rule sees of one."""

    def __init__(self, reader: GraphReader):
        self.reader = reader

    def node_unit(self, node, k: int) -> Unit:
        onnx = require_onnx()
        return Unit(op_type=node.op_type, domain=node.domain,
                    name=node.name or f"{node.op_type}_{k}", inputs=list(node.input),
                    outputs=list(node.output),
                    attrs={a.name: onnx.helper.get_attribute_value(a) for a in node.attribute
                           if a.type not in (5, 10)},
                    module=module_of(node), target=target_of(node),
                    has_subgraph=any(a.type in (5, 10) for a in node.attribute), nodes=[node])

    def view(self, u: Unit) -> NodeView:
        node = u.nodes[-1] if len(u.nodes) == 1 else None
        return NodeView(
            op_type=u.op_type, attrs=u.attrs,
            in_shapes=tuple(self.reader.shape(i) if i else None for i in u.inputs),
            in_dtypes=tuple(self.reader.dtype(i) if i else None for i in u.inputs),
            out_shapes=tuple(self.reader.shape(o, node) if o else None for o in u.outputs),
            out_dtypes=tuple(self.reader.dtype(o) if o else None for o in u.outputs))


    def dropout_active(self, u: Unit) -> bool:
        """A Dropout with ratio 0 or training_mode false is the identity, as torch runs it."""
        ratio = self.reader.const_value(u.inputs[1]) if len(u.inputs) > 1 and u.inputs[1] else None
        if ratio is not None and float(ratio) == 0.0:
            return False
        train = self.reader.const_value(u.inputs[2]) if len(u.inputs) > 2 and u.inputs[2] else None
        if len(u.inputs) > 2 and u.inputs[2] and train is not None and not bool(train):
            return False
        return True

    def units(self, work) -> list[Unit]:
        """One unit per node, except the nodes of one fused aten call (see FUSED_ATEN)."""
        units = [self.node_unit(n, k) for k, n in enumerate(work)]
        groups: dict[str, list[int]] = {}
        for k, n in enumerate(work):
            call = fx_call(n)
            if call and call[1] in FUSED_ATEN:
                groups.setdefault(call[0], []).append(k)
        if not groups:
            return units
        consumers: dict[str, list[int]] = {}
        for k, n in enumerate(work):
            for i in n.input:
                if i:
                    consumers.setdefault(i, []).append(k)
        graph_outputs = {o.name for o in self.reader.g.output}
        replace: dict[int, Unit | None] = {}
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
            aten = fx_call(work[last])[1]
            replace[last] = Unit(op_type=aten, domain="aten", name=fx_name, inputs=ext_in,
                                 outputs=ext_out, attrs={"inner_flops": inner_flops,
                                                         "inner_mm_flops": inner_mm},
                                 module=module_of(work[last]), target=f"onnx.aten.{aten}",
                                 nodes=[work[k] for k in members])
            for k in members[:-1]:
                replace[k] = None
        return [replace.get(k, u) for k, u in enumerate(units) if replace.get(k, u) is not None]

