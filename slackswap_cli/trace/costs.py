"""What one aten op costs: FLOPs from torch's own formulas, and bytes read plus written.

FLOPs come from `torch.utils.flop_counter.flop_registry` (matmuls, convolutions, attention),
evaluated on the shapes the tracer recorded in each node's `meta["val"]`. Ops without a
formula (elementwise, norms, softmax, reductions) count 0 FLOPs: their time is set by memory
traffic, which is what the roofline's byte term charges them for. Two additions:

- the CPU flash-attention kernels (`_scaled_dot_product_flash_attention_for_cpu` and its
  backward), which the CPU build of torch picks for `scaled_dot_product_attention` and which
  the registry lacks, get the same formula as the CUDA flash kernels;
- causal attention counts half the FLOPs of full attention, because flash kernels skip the
  blocks above the diagonal.

Bytes (see `graph_profile`, which knows the aliasing) are each distinct input tensor read once
plus each output written; views move nothing.

`is_random_op` (does re-running this node draw other numbers?) lives here too, next to
`bound_args` which it needs, so that both the tracer (`joint`) and the profile builder can use it.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.utils import flop_counter

_CPU_FLASH = "_scaled_dot_product_flash_attention_for_cpu"
_CPU_FLASH_BWD = "_scaled_dot_product_flash_attention_for_cpu_backward"


def bound_args(op: Any, args: tuple, kwargs: dict) -> dict:
    """Arguments of an OpOverload call by schema name (defaults filled in where known)."""
    schema = getattr(op, "_schema", None)
    if schema is None:
        return dict(kwargs)
    out: dict[str, Any] = {}
    for i, arg in enumerate(schema.arguments):
        if i < len(args) and not arg.kwarg_only:
            out[arg.name] = args[i]
        elif arg.name in kwargs:
            out[arg.name] = kwargs[arg.name]
        elif arg.has_default_value():
            out[arg.name] = arg.default_value
    return out


def _val(x):
    return x.meta.get("val") if isinstance(x, fx.Node) else x


def node_flops(node: fx.Node) -> int:
    """FLOPs of one call_function node (0 for ops without a formula or without recorded shapes)."""
    op = node.target
    packet = getattr(op, "overloadpacket", None)
    if packet is None:
        return 0
    try:
        args, kwargs = pytree.tree_map(_val, (node.args, node.kwargs))
        out = node.meta.get("val")
        name = packet.__name__
        if name == _CPU_FLASH:
            q, k, v = args[:3]
            flops = flop_counter.sdpa_flop_count(q.shape, k.shape, v.shape)
        elif name == _CPU_FLASH_BWD:
            grad_out, q, k, v = args[:4]
            flops = flop_counter.sdpa_backward_flop_count(grad_out.shape, q.shape, k.shape, v.shape)
        elif packet in flop_counter.flop_registry:
            flops = flop_counter.flop_registry[packet](*args, **kwargs, out_val=out)
        else:
            return 0
        if "attention" in name and bound_args(op, args, kwargs).get("is_causal") is True:
            flops //= 2
        return int(flops)
    except Exception:
        return 0


def tensor_nbytes(t: torch.Tensor) -> int:
    """Bytes a tensor's elements span (numel x itemsize)."""
    return int(t.numel()) * t.element_size()


def is_random_op(node: fx.Node) -> bool:
    """Does this node draw random numbers (so re-running it gives another result)?"""
    return is_random_call(node.target, node.args, node.kwargs)


def is_random_call(target, args, kwargs) -> bool:
    """`is_random_op` for a call (graph node or recorded eager call): seeded-random ops, and
    attention kernels only when their `dropout_p` is not 0."""
    tags = getattr(target, "tags", ())
    if torch.Tag.nondeterministic_seeded not in tags:
        return False
    schema = getattr(target, "_schema", None)
    if schema is not None and any(a.name == "dropout_p" for a in schema.arguments):
        p = bound_args(target, args, kwargs).get("dropout_p", 0.0)
        return not (isinstance(p, (int, float)) and p == 0)
    return True
