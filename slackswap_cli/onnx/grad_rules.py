"""Backward rules for ONNX op types: what a training step would save, and what backward costs.

An ONNX file holds the forward graph only. To profile a training step from it we need, for each
forward node, what reverse-mode autodiff would do with it. A `GradRule` answers four questions
for one op type, from the node's static shapes and attributes (a `NodeView`):

- `fwd_flops`: the forward FLOPs (matmul 2*M*N*K, conv 2*N*Cout*Hout*Wout*Cin/groups*kh*kw,
  elementwise a few per element, norms about 8 per element, softmax about 5);
- `grad_inputs` / `grad_outputs`: which inputs receive a gradient and which outputs carry one
  (Gather's indices, Reshape's shape, BatchNormalization's running statistics do not);
- `saves(view, need)`: the forward values backward reads, given the set `need` of inputs whose
  gradient is wanted. These follow what PyTorch's autograd saves for the matching aten op, so the
  saved bytes of an exported model agree with the eager model's: MatMul/Gemm/Conv keep the other
  operand of each input that needs a gradient; Relu/Sigmoid/Tanh/Exp/Sqrt/Softmax keep their
  output; Gelu/Erf/Log keep their input; LayerNormalization and BatchNormalization keep their
  input and per-row / per-channel statistics; Dropout keeps its mask; MaxPool keeps its input and
  int64 argmax indices; Add/Sub/Concat/Reshape keep nothing. Reshape, Squeeze, Unsqueeze,
  Flatten, Identity and Transpose are views (`alias`): they share their input's storage.
  A saved value is a reference: `("in", i)`, `("out", i)` or `("extra", k)`;
- `extras(view)`: values the forward op must write for backward that the node may not expose
  (LayerNormalization's mean/inv-std, BatchNormalization's batch statistics, Dropout's mask,
  MaxPool's indices). Each names the node output that holds it when present (then that output is
  used), otherwise the importer adds it as an extra output of the forward op;
- `bwd_flops(view, need)`: the backward FLOPs (a matmul's input- and weight-gradient each cost
  one forward matmul, so 2x forward when both are needed).

Ops not in `RULES` are handled by `unknown_rule`: every input saved, backward = 2x forward, and
the importer lists their op types in its warnings.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Callable


@dataclass(frozen=True)
class NodeView:
    """One node with static shapes: what a rule may look at."""
    op_type: str
    attrs: dict
    in_shapes: tuple        # per input: tuple of ints, or None for an absent optional input
    in_dtypes: tuple
    out_shapes: tuple
    out_dtypes: tuple

    def numel_in(self, i: int) -> int:
        s = self.in_shapes[i] if i < len(self.in_shapes) else None
        return prod(s) if s is not None else 0

    def numel_out(self, i: int = 0) -> int:
        s = self.out_shapes[i] if i < len(self.out_shapes) else None
        return prod(s) if s is not None else 0

    def has_in(self, i: int) -> bool:
        return i < len(self.in_shapes) and self.in_shapes[i] is not None


@dataclass(frozen=True)
class Extra:
    """A value backward needs that the forward op writes; `output` is the node output holding it."""
    suffix: str
    shape: tuple
    dtype: str
    output: int | None = None


def _none(v, need=frozenset()):
    return []


@dataclass(frozen=True)
class GradRule:
    fwd_flops: Callable[[NodeView], int]
    saves: Callable[[NodeView, frozenset], list] = _none
    bwd_flops: Callable[[NodeView, frozenset], int] = lambda v, need: 0
    grad_inputs: tuple[int, ...] | None = None    # None: every input
    grad_outputs: tuple[int, ...] | None = (0,)   # None: every output
    differentiable: bool = True
    alias: bool = False          # output 0 is a view of input 0 (no bytes, no time)
    random: bool = False         # outputs cannot be recomputed (a new mask each run)
    gather_like: bool = False    # reads only as many data bytes as it writes
    extras: Callable[[NodeView], list] = _none


# -- helpers --------------------------------------------------------------------------------
def _elem(c: float):
    return lambda v: int(c * v.numel_out(0))


def _per_need(c: float):
    """Backward of an elementwise op: c FLOPs per output element for each input needing grad."""
    return lambda v, need: int(c * v.numel_out(0) * max(1, len(need)))


def _keep_out(v, need):
    return [("out", 0)]


def _keep_in0(v, need):
    return [("in", 0)]


def _keep_all_in(v, need):
    return [("in", i) for i in range(len(v.in_shapes)) if v.has_in(i)]


def _keep_other(v, need):
    """Mul-like: the gradient of each operand needs the other operand(s)."""
    return [("in", j) for i in need for j in range(len(v.in_shapes)) if j != i and v.has_in(j)]


def _matmul_flops(v):
    a = v.in_shapes[0]
    k = a[-1] if a else 1
    return 2 * v.numel_out(0) * k


def _gemm_k(v):
    a = v.in_shapes[0]
    return a[0] if v.attrs.get("transA", 0) else a[1]


def _gemm_flops(v):
    return 2 * v.numel_out(0) * _gemm_k(v) + (v.numel_out(0) if v.has_in(2) else 0)


def _gemm_bwd(v, need):
    mm = 2 * v.numel_out(0) * _gemm_k(v)
    return sum(mm for i in need if i in (0, 1)) + (v.numel_out(0) if 2 in need else 0)


def _conv_core(v):
    w = v.in_shapes[1]
    return 2 * v.numel_out(0) * w[1] * prod(w[2:])


def _conv_flops(v):
    return _conv_core(v) + (v.numel_out(0) if v.has_in(2) else 0)


def _conv_bwd(v, need):
    return sum(_conv_core(v) for i in need if i in (0, 1)) + (v.numel_out(0) if 2 in need else 0)


def _convt_core(v):
    w = v.in_shapes[1]   # (Cin, Cout/groups, *k)
    return 2 * v.numel_in(0) * w[1] * prod(w[2:])


def _mm_saves(v, need):
    # d/dA needs B, d/dB needs A (and the bias gradient needs nothing).
    out = []
    if 0 in need:
        out.append(("in", 1))
    if 1 in need:
        out.append(("in", 0))
    return out


def _norm_stats_shape(v):
    x = v.in_shapes[0]
    axis = v.attrs.get("axis", -1)
    axis = axis + len(x) if axis < 0 else axis
    return tuple(x[:axis]) + (1,) * (len(x) - axis)


def _ln_extras(v):
    s = _norm_stats_shape(v)
    return [Extra("mean", s, "float32", 1), Extra("invstd", s, "float32", 2)]


def _rms_extras(v):
    return [Extra("invrms", _norm_stats_shape(v), "float32", None)]


def _bn_extras(v):
    c = (v.in_shapes[0][1],)
    # ONNX's BatchNormalization outputs 1, 2 are the *running* statistics, not the batch ones
    # backward needs; the batch statistics are always extra values.
    return [Extra("save_mean", c, "float32", None), Extra("save_invstd", c, "float32", None)]


def _group_extras(v):
    x = v.in_shapes[0]
    g = v.attrs.get("num_groups", x[1]) if v.op_type == "GroupNormalization" else x[1]
    s = (x[0], g)
    return [Extra("mean", s, "float32", None), Extra("invstd", s, "float32", None)]


def _keep_in0_and_extras(n):
    return lambda v, need: [("in", 0)] + [("extra", k) for k in range(n)]


def _dropout_extras(v):
    return [Extra("mask", v.out_shapes[0], "bool", 1)]


def _maxpool_extras(v):
    return [Extra("indices", v.out_shapes[0], "int64", 1)]


def _pool_flops(v):
    k = v.attrs.get("kernel_shape") or [1]
    return v.numel_out(0) * prod(k)


def _einsum_flops(v):
    eq = v.attrs.get("equation", "")
    if isinstance(eq, bytes):
        eq = eq.decode()
    lhs = eq.replace(" ", "").split("->")[0]
    if "..." in lhs:
        return 2 * v.numel_out(0)
    sizes: dict[str, int] = {}
    for term, shape in zip(lhs.split(","), v.in_shapes):
        for ch, d in zip(term, shape or ()):
            sizes[ch] = d
    return 2 * prod(sizes.values()) if sizes else 0


def _sce_extras(v):
    return [Extra("log_prob", v.in_shapes[0], v.in_dtypes[0], 1)]


# -- the table -------------------------------------------------------------------------------
RULES: dict[str, GradRule] = {}


def _add(names, rule):
    for n in names.split():
        RULES[n] = rule


# Views: same bytes as their input, metadata only. Transpose too: torch's transpose/permute is
# a view, and where a consumer needs another layout the copy is that consumer's business (a
# batched matmul copies its operand and saves the copy: the same bytes as the view's root).
_add("Reshape Squeeze Unsqueeze Flatten Identity Transpose",
     GradRule(fwd_flops=lambda v: 0, grad_inputs=(0,), alias=True))

# Linear algebra.
_add("MatMul", GradRule(fwd_flops=_matmul_flops, saves=_mm_saves,
                        bwd_flops=lambda v, need: _matmul_flops(v) * len(need & {0, 1})))
_add("Gemm", GradRule(fwd_flops=_gemm_flops, saves=_mm_saves, bwd_flops=_gemm_bwd))
_add("Conv", GradRule(fwd_flops=_conv_flops, saves=_mm_saves, bwd_flops=_conv_bwd))
_add("ConvTranspose", GradRule(
    fwd_flops=lambda v: _convt_core(v) + (v.numel_out(0) if v.has_in(2) else 0), saves=_mm_saves,
    bwd_flops=lambda v, need: _convt_core(v) * len(need & {0, 1})
    + (v.numel_out(0) if 2 in need else 0)))
_add("Einsum", GradRule(fwd_flops=_einsum_flops, saves=_keep_all_in,
                        bwd_flops=lambda v, need: _einsum_flops(v) * len(need)))

# Elementwise, nothing saved (the gradient is a copy, a negation, a broadcast reduction).
_add("Add Sub Sum Mean", GradRule(fwd_flops=_elem(1), bwd_flops=_per_need(0.5)))
_add("Neg", GradRule(fwd_flops=_elem(1), bwd_flops=_per_need(1)))
_add("Cast CastLike", GradRule(fwd_flops=lambda v: 0, grad_inputs=(0,)))
# Elementwise, the gradient needs the other operand(s).
_add("Mul", GradRule(fwd_flops=_elem(1), saves=_keep_other, bwd_flops=_per_need(1)))
_add("Div", GradRule(fwd_flops=_elem(1),
                     saves=lambda v, need: [("in", 1)] + ([("in", 0)] if 1 in need else []),
                     bwd_flops=_per_need(2)))
_add("Pow", GradRule(fwd_flops=_elem(4),
                     saves=lambda v, need: [("in", 0), ("in", 1)]
                     + ([("out", 0)] if 1 in need else []),
                     bwd_flops=_per_need(5)))
_add("Max Min", GradRule(fwd_flops=_elem(1), saves=_keep_all_in, bwd_flops=_per_need(2)))
_add("Where", GradRule(fwd_flops=_elem(1), saves=lambda v, need: [("in", 0)],
                       bwd_flops=_per_need(1), grad_inputs=(1, 2)))
# Unary, the gradient needs the output.
_add("Relu", GradRule(fwd_flops=_elem(1), saves=_keep_out, bwd_flops=_per_need(1)))
_add("Sigmoid Tanh", GradRule(fwd_flops=_elem(4), saves=_keep_out, bwd_flops=_per_need(3)))
_add("Exp", GradRule(fwd_flops=_elem(1), saves=_keep_out, bwd_flops=_per_need(1)))
_add("Sqrt Reciprocal", GradRule(fwd_flops=_elem(1), saves=_keep_out, bwd_flops=_per_need(2)))
_add("Elu Selu Celu", GradRule(fwd_flops=_elem(3), saves=_keep_out, bwd_flops=_per_need(3)))
# Unary, the gradient needs the input.
_add("Gelu", GradRule(fwd_flops=_elem(8), saves=_keep_in0, bwd_flops=_per_need(10)))
_add("Erf", GradRule(fwd_flops=_elem(4), saves=_keep_in0, bwd_flops=_per_need(4)))
_add("Log Abs Sin Cos Softplus Softsign Mish", GradRule(fwd_flops=_elem(2), saves=_keep_in0,
                                                       bwd_flops=_per_need(3)))
_add("LeakyRelu PRelu HardSigmoid HardSwish ThresholdedRelu",
     GradRule(fwd_flops=_elem(2), saves=_keep_all_in, bwd_flops=_per_need(2)))
_add("Clip", GradRule(fwd_flops=_elem(2), saves=_keep_in0, bwd_flops=_per_need(2),
                      grad_inputs=(0,)))
# Normalisation: input and statistics.
_add("LayerNormalization", GradRule(fwd_flops=_elem(8), saves=_keep_in0_and_extras(2),
                                    bwd_flops=_per_need(4), extras=_ln_extras))
_add("RMSNormalization SimplifiedLayerNormalization",
     GradRule(fwd_flops=_elem(5), saves=_keep_in0_and_extras(1), bwd_flops=_per_need(3),
              extras=_rms_extras))
_add("BatchNormalization", GradRule(fwd_flops=_elem(8), saves=_keep_in0_and_extras(2),
                                    bwd_flops=_per_need(4), grad_inputs=(0, 1, 2),
                                    extras=_bn_extras))
_add("InstanceNormalization GroupNormalization",
     GradRule(fwd_flops=_elem(8), saves=_keep_in0_and_extras(2), bwd_flops=_per_need(4),
              grad_inputs=(0, 1, 2), extras=_group_extras))
_add("Softmax LogSoftmax", GradRule(fwd_flops=_elem(5), saves=_keep_out, bwd_flops=_per_need(4),
                                    grad_inputs=(0,)))
# ONNX's own fused attention (opset 23): costed like torch's flash attention (see FUSED_ATEN).
def _attention_flops(v):
    tk = v.in_shapes[1][-2]
    return 2 * tk * (v.numel_in(0) + v.numel_out(0))


def _attention_extras(v):
    y = v.out_shapes[0]
    if len(y) == 4:
        return [Extra("logsumexp", tuple(y[:-1]), "float32", None)]
    heads = v.attrs.get("q_num_heads") or 1
    return [Extra("logsumexp", (y[0], heads, y[1]), "float32", None)]


_add("Attention", GradRule(
    fwd_flops=_attention_flops,
    saves=lambda v, need: [("in", i) for i in range(min(4, len(v.in_shapes))) if v.has_in(i)]
    + [("out", 0), ("extra", 0)],
    bwd_flops=lambda v, need: int(2.5 * _attention_flops(v)), grad_inputs=(0, 1, 2),
    extras=_attention_extras))
# Random: the mask is the only thing backward needs, and it cannot be recomputed.
_add("Dropout", GradRule(fwd_flops=_elem(2), saves=lambda v, need: [("extra", 0)],
                         bwd_flops=_per_need(1), grad_inputs=(0,), random=True,
                         extras=_dropout_extras))
# Data movement: no FLOPs; backward moves the gradient back (a scatter, a slice, a sum).
_add("Concat Split Pad Tile Trilu Resize DepthToSpace SpaceToDepth ReverseSequence",
     GradRule(fwd_flops=lambda v: 0, grad_inputs=(0,), grad_outputs=None))
RULES["Concat"] = GradRule(fwd_flops=lambda v: 0, grad_inputs=None)
_add("Expand", GradRule(fwd_flops=lambda v: 0, bwd_flops=_per_need(1), grad_inputs=(0,)))
_add("Slice", GradRule(fwd_flops=lambda v: 0, grad_inputs=(0,), gather_like=True))
_add("Gather GatherElements GatherND",
     GradRule(fwd_flops=lambda v: 0, saves=lambda v, need: [("in", 1)],
              bwd_flops=lambda v, need: v.numel_out(0), grad_inputs=(0,), gather_like=True))
_add("ScatterND ScatterElements", GradRule(fwd_flops=lambda v: 0,
                                           saves=lambda v, need: [("in", 1)],
                                           grad_inputs=(0, 2)))
_add("CumSum", GradRule(fwd_flops=_elem(1), bwd_flops=_per_need(1), grad_inputs=(0,)))
# Reductions.
_add("ReduceSum ReduceMean", GradRule(fwd_flops=lambda v: v.numel_in(0),
                                      bwd_flops=lambda v, need: v.numel_in(0),
                                      grad_inputs=(0,)))
_add("ReduceMax ReduceMin ReduceL2 ReduceL1 ReduceLogSumExp ReduceProd",
     GradRule(fwd_flops=lambda v: 2 * v.numel_in(0),
              saves=lambda v, need: [("in", 0), ("out", 0)],
              bwd_flops=lambda v, need: 2 * v.numel_in(0), grad_inputs=(0,)))
_add("ReduceSumSquare", GradRule(fwd_flops=lambda v: 2 * v.numel_in(0), saves=_keep_in0,
                                 bwd_flops=lambda v, need: 2 * v.numel_in(0), grad_inputs=(0,)))
# Pooling.
_add("MaxPool", GradRule(fwd_flops=_pool_flops,
                         saves=lambda v, need: [("in", 0), ("extra", 0)],
                         bwd_flops=lambda v, need: v.numel_out(0), extras=_maxpool_extras))
# torch's avg_pool2d / adaptive_avg_pool2d backward take the input (for its geometry), so
# autograd keeps it alive: saved, to agree with the eager model.
_add("AveragePool", GradRule(fwd_flops=_pool_flops, saves=_keep_in0,
                             bwd_flops=lambda v, need: _pool_flops(v)))
_add("GlobalAveragePool", GradRule(fwd_flops=lambda v: v.numel_in(0), saves=_keep_in0,
                                   bwd_flops=lambda v, need: v.numel_in(0)))
_add("GlobalMaxPool", GradRule(fwd_flops=lambda v: v.numel_in(0),
                               saves=lambda v, need: [("in", 0), ("out", 0)],
                               bwd_flops=lambda v, need: v.numel_in(0)))
_add("TopK", GradRule(fwd_flops=lambda v: 2 * v.numel_in(0), saves=lambda v, need: [("out", 1)],
                      grad_inputs=(0,)))
# Losses an export may include.
_add("SoftmaxCrossEntropyLoss",
     GradRule(fwd_flops=lambda v: 6 * v.numel_in(0),
              saves=lambda v, need: [("extra", 0), ("in", 1)],
              bwd_flops=lambda v, need: 2 * v.numel_in(0), grad_inputs=(0,),
              extras=_sce_extras))
_add("NegativeLogLikelihoodLoss", GradRule(fwd_flops=lambda v: v.numel_in(1),
                                           saves=lambda v, need: [("in", 1)],
                                           bwd_flops=lambda v, need: v.numel_in(0),
                                           grad_inputs=(0,)))
# No gradient at all: comparisons, logic, index and shape producers, random sources.
_add("Shape Size Equal Less LessOrEqual Greater GreaterOrEqual Not And Or Xor ArgMax ArgMin "
     "NonZero Range ConstantOfShape IsNaN IsInf Sign Floor Ceil Round Mod BitShift OneHot "
     "EyeLike Hardmax BitwiseNot BitwiseAnd BitwiseOr BitwiseXor",
     GradRule(fwd_flops=_elem(1), differentiable=False))
_add("RandomNormal RandomUniform RandomNormalLike RandomUniformLike Bernoulli Multinomial",
     GradRule(fwd_flops=_elem(2), differentiable=False, random=True))


def unknown_rule(op_type: str) -> GradRule:
    """Conservative stand-in: keeps every input, backward costs twice the forward."""
    return GradRule(fwd_flops=_elem(1), saves=_keep_all_in,
                    bwd_flops=lambda v, need: 2 * max(1, v.numel_out(0)), grad_outputs=None)


def rule_for(op_type: str, domain: str = "") -> GradRule | None:
    """The rule for an op type, or None when the op type is unknown (use `unknown_rule`)."""
    if domain not in ("", "ai.onnx"):
        return None
    return RULES.get(op_type)


# -- aten ops the dynamo exporter decomposes into several ONNX nodes ---------------------------
# torch's dynamo exporter records the aten call each ONNX node came from. Where one aten op
# became several nodes and torch runs it as one fused kernel, the importer merges the nodes into
# one op with the aten op's rule: its intermediates (the T x T attention matrix, the sigmoid in
# SiLU) are never materialised, and backward saves what the fused kernel saves. A fused view's
# attrs carry `inner_flops` (the nodes' FLOPs summed) and `inner_mm_flops` (their matmuls').
def _sdpa_extras(v):
    out = v.out_shapes[0]
    return [Extra("logsumexp", tuple(out[:-1]), "float32", None)]


def _fused_saves_inputs_out_extra(v, need):
    return ([("in", i) for i in range(len(v.in_shapes)) if v.has_in(i)]
            + [("out", 0), ("extra", 0)])


FUSED_ATEN: dict[str, GradRule] = {}
# Flash / memory-efficient attention keeps q, k, v, the output and the row log-sum-exp; its
# backward recomputes Q K^T (half the forward matmuls) and runs four more: 2.5x forward.
_sdpa = GradRule(fwd_flops=lambda v: v.attrs["inner_flops"], saves=_fused_saves_inputs_out_extra,
                 bwd_flops=lambda v, need: int(2.5 * v.attrs["inner_mm_flops"])
                 + 2 * (v.attrs["inner_flops"] - v.attrs["inner_mm_flops"]),
                 extras=_sdpa_extras)
for _name in ("scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
              "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
              "_scaled_dot_product_flash_attention_for_cpu"):
    FUSED_ATEN[_name] = _sdpa
FUSED_ATEN["silu"] = GradRule(fwd_flops=lambda v: v.attrs["inner_flops"], saves=_keep_in0,
                              bwd_flops=_per_need(5), grad_inputs=(0,))
FUSED_ATEN["mish"] = FUSED_ATEN["silu"]
