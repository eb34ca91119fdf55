"""What a split backward holds between a microbatch's input pass and its weight pass.

ZBVZeroBubble, DualPipeV and InterleavedZeroBubble run each microbatch's backward in two
halves (torch/distributed/pipelining/_backward.py): the input pass (I) is `autograd.grad` to
the stage's inputs with `retain_graph=True`, which captures the gradients flowing into the
nodes where a parameter's path joins the input's (a Linear's `addmm`, a norm's node: the
"intermediates" of each parameter group) and keeps them, with the output's gradient received,
until the weight pass (W) runs autograd again from those nodes to the parameters. The first
stage (no input gradient to send) does nothing at I and its whole backward at W, holding the
received gradient until then. Between I and W the microbatch thus holds, beyond what its plan
keeps (the graph is retained: kept saved tensors stay, swapped ones stay on the host,
recomputed ones are made again at W), those gradients: `split_held_bytes` measures them on
one microbatch (`Boundary.split` in slackswap_cli/pipeline/stages.py counts them).
"""
from __future__ import annotations

import copy

import torch

from ...trace.storage import storage_key, storage_nbytes

__all__ = ["split_held_bytes"]


def split_held_bytes(module: torch.nn.Module, inputs, loss_fn, first: bool,
                     last: bool) -> int:
    """Bytes one microbatch of stage `module` holds from its input pass to its weight pass
    beyond its saved activations: the gradients captured at the parameter groups'
    intermediates and the output's gradient received (each storage once); on the first
    stage, the received gradient alone. Measured on a copy of the module, unpatched."""
    from torch.distributed.pipelining._backward import stage_backward_input
    work = copy.deepcopy(module)
    args = inputs if isinstance(inputs, tuple) else (inputs,)
    args = tuple(a.detach().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor)
                 else a for a in args)
    out = work(*args)
    outs = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    grads = [] if last else [torch.ones_like(t) for t in outs]
    if first:
        return sum(storage_nbytes(g) for g in grads)
    stage_out = [loss_fn(out, args)] if last else outs
    _, groups = stage_backward_input(stage_out, None if last else grads, list(args),
                                     work.parameters())
    held = {storage_key(g): storage_nbytes(g) for g in grads}
    for group in groups:
        for got in group.get("grads") or ():
            for g in got or ():
                if isinstance(g, torch.Tensor):
                    held[storage_key(g)] = storage_nbytes(g)
    return sum(held.values())
