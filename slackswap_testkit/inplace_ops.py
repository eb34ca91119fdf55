"""The in-place aten ops whose backward reads the value they overwrite or their own result,
read from torch's own derivatives (tests/test_inplace_ops.py runs each through plans).

`overwriting_ops()` loads the `derivatives.yaml` and `native_functions.yaml` shipped in
torchgen (`torchgen/packaged`) and matches them as torch's autograd codegen does
(`torchgen.api.autograd.match_differentiability_info`: an in-place op without a formula of its
own takes its out-of-place one). An in-place op's backward needs

- the value it overwrites when its formulas save `self` (the codegen saves
  `original_self = self.clone()`, a `clone` in the traced graph: `silu_`, `mul_.Tensor`);
- its own result when they save an output (`result`, saved as the written `self`: `exp_`,
  `sigmoid_`).

`OpsModel` applies every op it can call on small float tensors, each on a value made with
parameters of its own, so a wrong gradient names the op (`scale.<op>`, `other.<op>`).
"""
from __future__ import annotations

import functools
import os
import re

import torch

_FOREACH = re.compile(r"^_foreach_")


@functools.lru_cache(maxsize=None)
def overwriting_ops() -> tuple[tuple[str, bool, bool], ...]:
    """(overload name as torch.ops.aten spells it, e.g. "mul_.Tensor", reads the overwritten
    value, reads its result) for every in-place aten op whose backward reads one of them."""
    import torchgen
    from torchgen.api.autograd import match_differentiability_info
    from torchgen.gen import parse_native_yaml
    from torchgen.model import SchemaKind
    from torchgen.packaged.autograd.load_derivatives import load_derivatives
    base = os.path.join(os.path.dirname(torchgen.__file__), "packaged")
    native = os.path.join(base, "ATen", "native", "native_functions.yaml")
    tags = os.path.join(base, "ATen", "native", "tags.yaml")
    infos, _ = load_derivatives(os.path.join(base, "autograd", "derivatives.yaml"), native, tags)
    funcs = parse_native_yaml(native, tags).native_functions
    out = []
    for m in match_differentiability_info(funcs, infos):
        f = m.func
        name = str(f.func.name)
        if f.func.kind() != SchemaKind.inplace or not m.info or _FOREACH.match(name):
            continue
        ins = {str(s.nctype.name) for i in m.info.values() for s in i.all_saved_inputs}
        outs = {str(s.nctype.name) for i in m.info.values() for s in i.all_saved_outputs}
        if "self" in ins or outs:
            out.append((name if "." in name else name + ".default", "self" in ins, bool(outs)))
    return tuple(out)


def overload(name: str):
    packet, over = name.split(".")
    return getattr(getattr(torch.ops.aten, packet), over)


# Argument values by name, where the type alone does not give a valid one.
_BY_NAME = {"index": "index", "dim": 0, "n": 1, "p": 1, "reduce": "prod", "maxnorm": 0.5,
            "rounding_mode": "trunc", "include_self": True}


def call_args(name: str, x: torch.Tensor, other: torch.Tensor) -> tuple[list, dict]:
    """Arguments for in-place op `name` on `x`, by name: each argument without a default, and
    each optional number or tensor (clamp_'s min and max); a tensor is `other` (an index is
    `arange`), a number 0.3 (min, threshold) or 0.7, names in `_BY_NAME` as given there."""
    schema = overload(name)._schema
    kwargs: dict = {}
    for a in schema.arguments[1:]:
        t = str(a.type)
        optional_value = t.startswith("Optional[") and ("number" in t or "Tensor" in t
                                                         or "float" in t)
        if a.has_default_value() and not optional_value:
            continue
        if a.name in _BY_NAME:
            v = _BY_NAME[a.name]
            if v == "index":
                v = torch.arange(x.shape[0])
                if name.startswith("scatter"):          # (an index of self's rank)
                    v = v.unsqueeze(1).expand(x.shape).contiguous()
            elif a.name == "p" and "number" in t:
                v = 2.0
        elif "Tensor" in t:
            v = other
        elif "number" in t or "float" in t:
            v = 0.3 if a.name in ("min", "min_val", "lower", "threshold") else 0.7
        elif "bool" in t:
            v = False
        elif "int" in t:
            v = 1
        else:
            raise TypeError(f"{name}: no value for argument {a.name}: {t}")
        kwargs[a.name] = v
    return [x], kwargs


def takes_tensor(name: str) -> bool:
    """Does op `name` take a tensor operand besides `self` (an index aside)?"""
    return any("Tensor" in str(a.type) and a.name != "index"
               for a in overload(name)._schema.arguments[1:])


class OpsModel(torch.nn.Module):
    """h -> for each op: x = 0.1 + 0.8 sigmoid(h * scale[op]) (a second operand the same way
    with other[op], for an op that takes one), op_(x, ...), h = h + x; then a Linear, squared,
    the mean. Values stay in (0.1, 0.9), in each op's domain (log_, acos_, logit_, ...); each
    op has parameters of its own, so a wrong gradient names it."""

    def __init__(self, names, width: int = 4):
        super().__init__()
        self.names = list(names)
        self.key = [n.replace(".", "_") for n in self.names]
        ramp = torch.linspace(0.5, 1.5, width)
        self.scale = torch.nn.ParameterDict({k: torch.nn.Parameter(ramp.clone())
                                             for k in self.key})
        self.other = torch.nn.ParameterDict({k: torch.nn.Parameter(ramp.flip(0).clone())
                                             for n, k in zip(self.names, self.key)
                                             if takes_tensor(n)})
        self.head = torch.nn.Linear(width, 1)

    def forward(self, h):
        for name, k in zip(self.names, self.key):
            x = torch.sigmoid(h * self.scale[k]) * 0.8 + 0.1
            other = torch.sigmoid(h * self.other[k]) * 0.8 + 0.1 if k in self.other else None
            args, kwargs = call_args(name, x, other)
            overload(name)(*args, **kwargs)
            h = h + x
        return self.head(h).square().mean()


@functools.lru_cache(maxsize=None)
def callable_ops() -> tuple[list[str], dict[str, str]]:
    """(ops `OpsModel` runs, {op: why not} for the others): an op is run when a step of a
    one-op model gives finite values and gradients for every parameter, all of them
    differentiable (not random: the plans would differ only in whether the draw repeats)."""

    good, skipped = [], {}
    for name, _, _ in overwriting_ops():
        op = overload(name)
        if torch.Tag.nondeterministic_seeded in op.tags:
            skipped[name] = "random"
            continue
        torch.manual_seed(0)
        m = OpsModel([name])
        try:
            loss = m(torch.randn(2, 4))
            loss.backward()
        except Exception as exc:       # any refusal: the op is listed as skipped
            skipped[name] = str(exc).splitlines()[0][:100]
            continue
        grads = [p.grad for p in m.parameters()]
        if not torch.isfinite(loss) or any(g is None or not torch.isfinite(g).all()
                                           for g in grads):
            skipped[name] = "not finite, or no gradient"
            continue
        good.append(name)
    return good, skipped
