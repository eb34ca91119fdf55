"""The training step as a profile: forward ops and their tensors, the loss, then backward ops
that read what each op's gradient rule saves and write the gradients of its inputs.

Steps 4 and 5 of the import (see `importer`): the units of `op_units` go in one by one
(`forward_unit`), then `backward` and `build`. FLOPs and bytes come from the static shapes,
times from the hardware roofline.

This module does not import torch.
"""
from __future__ import annotations

from math import prod

from ..errors import FormatError, InputError
from ..hardware import HardwareSpec
from ..profile_build import ProfileBuilder
from ..schema import Profile
from .folding import ConstantFolding
from .grad_rules import FUSED_ATEN, rule_for, unknown_rule
from .graph_reader import FLOAT_DTYPES, GraphReader
from .op_units import OpUnits, Unit


class StepBuilder:
    """Adds forward and backward ops to a `ProfileBuilder` and builds the profile: tensor ids
    by value name, which values need a gradient, and each op's FLOPs, bytes and time."""

    def __init__(self, reader: GraphReader, folding: ConstantFolding, ops: OpUnits,
                 hw: HardwareSpec, warnings: list[str]):
        self.reader, self.folding, self.ops = reader, folding, ops
        self.hw, self.warnings = hw, warnings
        self.b = ProfileBuilder()
        self.tid: dict[str, int] = {}           # value name -> tensor id
        self.requires_grad: set[str] = set()

    def add(self, name: str, kind: str, shape, dtype: str, **kw) -> int:
        """Add a tensor sized by ONNX's element sizes (a view's own size is 0)."""
        size = 0 if kw.get("alias_of") is not None else self.reader.size_bytes(shape, dtype)
        return self.b.add_tensor(name, kind, shape, dtype, size_bytes=size, **kw)

    def tensor(self, name: str) -> int:
        """Tensor id of a value that exists before the current node (input, parameter, constant)."""
        name = self.folding.canonical.get(name, name)
        if name in self.tid:
            return self.tid[name]
        if name in self.folding.static:
            kind = "parameter" if name in self.folding.trainable else "buffer"
        elif name in self.reader.graph_inputs:
            kind = "input"
        else:  # pragma: no cover - topological order guarantees producers come first
            raise FormatError(f"{self.reader.p}: value '{name}' is read before it is produced")
        self.tid[name] = self.add(name, kind, self.reader.shape(name), self.reader.dtype(name))
        return self.tid[name]

    def rule(self, u: Unit, unknown: dict[str, int]):
        """The gradient rule of unit `u`; a unit without one is counted in `unknown` and gets
        the conservative rule."""
        if u.domain == "aten":
            rule = FUSED_ATEN[u.op_type]
        else:
            rule = rule_for(u.op_type, u.domain)
        if u.op_type == "Dropout" and not self.ops.dropout_active(u):
            rule = rule_for("Identity")
        if rule is None:
            key = f"{u.domain}::{u.op_type}" if u.domain else u.op_type
            unknown[key] = unknown.get(key, 0) + 1
            rule = unknown_rule(u.op_type)
        return rule

    def forward_unit(self, u: Unit, unknown: dict[str, int]) -> tuple:
        """Add unit `u`'s forward op and its output tensors to the profile; returns (unit,
        rule, view, in tids, out tids, extra tids) for `backward`."""
        b = self.b
        rule = self.rule(u, unknown)
        view = self.ops.view(u)
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
            t = self.add(o, kind, self.reader.shape(o), self.reader.dtype(o),
                         recomputable=not rule.random, alias_of=alias_of)
            self.tid[o] = t
            out_tids.append(t)
            grad_out = rule.grad_outputs is None or j in rule.grad_outputs
            if in_needs and grad_out and self.reader.dtype(o) in FLOAT_DTYPES:
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
        opset = next((o.version for o in self.reader.model.opset_import if o.domain in ("", "ai.onnx")),
                     None)
        producer = " ".join(x for x in (self.reader.model.producer_name, self.reader.model.producer_version) if x)
        shapes = {n: list(self.reader.shape(n)) for n in self.reader.graph_inputs}
        workload = {"name": self.reader.p.stem, "path": str(self.reader.p.resolve()), "source": "onnx",
                    "input_shapes": shapes,
                    "input_dtypes": {n: self.reader.dtype(n) for n in self.reader.graph_inputs},
                    "loss": self.loss_desc}
        env = {"torch_version": None, "device": "onnx", "device_name": None,
               "hardware": self.hw.to_dict(), "onnx_opset": opset, "producer": producer or None}
        extra = {"forward_flops": sum(o.flops for o in b.ops if o.phase == "forward"),
                 "backward_flops": sum(o.flops for o in b.ops if o.phase == "backward"),
                 "warnings": list(self.warnings)}
        from ..op_cost import price_profile
        return price_profile(b.build(workload=workload, env=env, summary_extra=extra), self.hw)

    def needs_grad(self, name: str) -> bool:
        name = self.folding.canonical.get(name, name)
        return name in self.requires_grad or name in self.folding.trainable

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
        out_name = self.reader.g.output[0].name
        out_name = self.folding.canonical.get(out_name, out_name)
        if out_name not in self.requires_grad:
            raise InputError(f"{self.reader.p}: the first graph output '{out_name}' does not depend on "
                             "any trainable parameter, so there is no training step to profile",
                             hint="export the model whose first output is the logits or the loss")
        out_t = self.tid[out_name]
        out_shape, out_dtype = self.reader.shape(out_name), self.reader.dtype(out_name)
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

