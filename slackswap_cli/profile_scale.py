"""A profile at another batch size, derived from two traced ones (what `fit` sweeps with).

Tracing dominates `fit` (a Llama-7B step is 7,000 graph nodes), while the step's structure does
not change with the batch: the same ops read and write the same tensors, and only the sizes
grow. `derive(pa, a, pb, b, x, hw)` takes the profiles traced at batches `a` and `b` and writes
the one at batch `x` without tracing, **only where that is exact**:

- both profiles have the same op sequence (targets, phases, modules, wiring) and the same
  tensors (kinds, dtypes, aliases, producers, consumers, saved, recomputable);
- every tensor's shape differs between them in at most one dimension (a tensor with two
  dimensions that grow with the batch, say in-batch similarity logits (B, B), would grow
  quadratically: refused), and that dimension, every size in bytes, every op's FLOPs and
  bytes moved and every input shape are affine in the batch with an integer value at `x`
  (refused otherwise);
- every op was costed by the roofline (fake tensors): its time at `x` is what the cost model
  (`op_cost`) prices its FLOPs, bytes, dtype and output shape at there, exactly what tracing
  at `x` computes. A measured profile is refused.

Where these hold, a FakeTensor trace at `x` records these same numbers (the cost model is
linear in each op's shapes); the tests compare derived profiles with direct traces field by
field on several models, and `benchmarks/fit_speed.py` does so for Llama-7B. What it cannot
see is a workload whose code branches on the batch size between the traced batches and `x`:
`fit --profile-each` traces every batch. None is returned where a rule fails, and `fit` then
traces that batch.
"""
from __future__ import annotations

import dataclasses
from fractions import Fraction

from .schema import Op, Profile, Tensor, op_fingerprint


def affine(va: int, vb: int, a: int, b: int, x: int) -> int | None:
    """The value at x of the line through (a, va) and (b, vb), when it is a non-negative integer."""
    v = va + Fraction(vb - va, b - a) * (x - a)
    return int(v) if v.denominator == 1 and v >= 0 else None


def _shape(sa, sb, a: int, b: int, x: int) -> tuple[int, ...] | None:
    if len(sa) != len(sb):
        return None
    grow = [k for k in range(len(sa)) if sa[k] != sb[k]]
    if len(grow) > 1:
        return None
    out = list(sa)
    for k in grow:
        v = affine(sa[k], sb[k], a, b, x)
        if v is None:
            return None
        out[k] = v
    return tuple(out)


def _same_op(p: Op, q: Op) -> bool:
    return (p.target, p.phase, p.module, p.inputs, p.outputs, p.time_source) == \
        (q.target, q.phase, q.module, q.inputs, q.outputs, q.time_source)


def _same_tensor(t: Tensor, u: Tensor) -> bool:
    return (t.kind, t.dtype, t.alias_of, t.producer, t.consumers, t.saved, t.recomputable) == \
        (u.kind, u.dtype, u.alias_of, u.producer, u.consumers, u.saved, u.recomputable)


def derive(pa: Profile, a: int, pb: Profile, b: int, x: int, hw,
           batch_arg: str = "batch") -> Profile | None:
    """The profile at batch `x` from those at `a` and `b` (a != b), or None (see the docstring)."""
    if a == b or len(pa.ops) != len(pb.ops) or len(pa.tensors) != len(pb.tensors):
        return None
    if any(op.time_source != "roofline" for op in pa.ops):
        return None
    ops = []
    for p, q in zip(pa.ops, pb.ops):
        if not _same_op(p, q):
            return None
        flops, moved = affine(p.flops, q.flops, a, b, x), affine(p.bytes, q.bytes, a, b, x)
        if flops is None or moved is None:
            return None
        ops.append(dataclasses.replace(p, flops=flops, bytes=moved,
                                       time_us=hw.roofline_us(flops, moved)))
    tensors = []
    for t, u in zip(pa.tensors, pb.tensors):
        if not _same_tensor(t, u):
            return None
        shape, size = _shape(t.shape, u.shape, a, b, x), affine(t.size_bytes, u.size_bytes, a, b, x)
        if shape is None or size is None:
            return None
        tensors.append(dataclasses.replace(t, shape=shape, size_bytes=size))
    workload = _workload(pa.workload, pb.workload, a, b, x, batch_arg)
    if workload is None:
        return None
    return _priced(pa, ops, tensors, workload, hw, a, b)


def _priced(pa: Profile, ops: list, tensors: list, workload: dict, hw,
            a: int, b: int) -> Profile:
    """The derived profile, its ops priced as a trace prices them (`op_cost.price_profile`)."""
    from .op_cost import price_profile

    ops_t, tensors_t = tuple(ops), tuple(tensors)
    prof = Profile(fingerprint=op_fingerprint(ops_t, tensors_t), workload=workload,
                   env=dict(pa.env, hardware=hw.to_dict()), summary={}, ops=ops_t,
                   tensors=tensors_t)
    summary = dict(pa.summary,
                   forward_us=sum(o.time_us for o in ops_t if o.phase == "forward"),
                   backward_us=sum(o.time_us for o in ops_t if o.phase == "backward"),
                   saved_bytes=sum(t.size_bytes for t in prof.saved_activations),
                   peak_activation_bytes=prof.keep_all_peak_bytes,
                   flops=sum(o.flops for o in ops_t), profile_s=0.0,
                   derived_from_batches=[a, b])
    return price_profile(dataclasses.replace(prof, summary=summary), hw)


def _workload(wa: dict, wb: dict, a: int, b: int, x: int, batch_arg: str) -> dict | None:
    shapes = {}
    for k, sa in (wa.get("input_shapes") or {}).items():
        sb = (wb.get("input_shapes") or {}).get(k)
        s = None if sb is None else _shape(tuple(sa), tuple(sb), a, b, x)
        if s is None:
            return None
        shapes[k] = list(s)
    return dict(wa, args=dict(wa.get("args") or {}, **{batch_arg: x}), input_shapes=shapes)
