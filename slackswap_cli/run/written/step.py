"""The whole-step module (`step_module(model)` of a patched file): the plan written out as code.

`slackswap apply` writes the joint graph, split by the plan's layout, as a forward step and a
backward step (`run/written/code.py`); `PatchedStep` runs them as one `autograd.Function`, with
a `StepStore` (`run/swap.py`) holding what forward keeps and swaps. It runs only the profiled
shapes; `verify` uses it to check the plan op for op and to measure its memory timeline.
"""
from __future__ import annotations

import copy
import weakref
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode

from ...errors import FingerprintMismatch, InputError
from ...trace.joint import capture_joint
from ...trace.retrace import joint_fingerprint
from ...trace.workload import load_workload
from ..generated import check_generated
from ..rng import forked_rng
from ..swap import StepStore

__all__ = ["PatchedStep"]


def _traced_mode():
    """Grad mode on, as when the step was traced: some kernels read it.

    Inside an autograd.Function grad mode is off, and kernels that check it skip what only
    backward needs: the CPU (mkldnn) RNN kernels then leave their workspace output undefined,
    and their backward fails on it. The step's own ops run on detached tensors (`_detached`),
    so grad mode on records no autograd graph and saves nothing.
    """
    return torch.enable_grad()


def _detached(flat) -> list[torch.Tensor]:
    """The step's tensors without autograd history (same storages: in-place updates land)."""
    return [t.detach() for t in flat]


class _StepFunction(torch.autograd.Function):
    """Forward runs the plan's forward step, backward its backward step (one autograd node)."""

    @staticmethod
    def forward(ctx, step: "PatchedStep", *flat: torch.Tensor) -> torch.Tensor:
        store = StepStore(exclude=list(flat))
        device = flat[0].device
        # the graph already holds every cast the model makes; autocast must not add more.
        # Grad mode is on, as in the traced step (see `_traced_mode`).
        with torch.autocast(device.type, enabled=False), _traced_mode():
            loss = step.forward_fn(store, device, *_detached(flat))
        ctx.store, ctx.step, ctx.flat = store, step, flat
        step.last_store = weakref.ref(store)
        step.held_bytes_after_forward = store.held_device_bytes()
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss: torch.Tensor):
        step, flat, store = ctx.step, ctx.flat, ctx.store
        if store is None:
            raise InputError("this patched step already ran its backward, which frees (or hands "
                             "back to the host pool) everything forward saved; "
                             "backward(retain_graph=True) twice is not supported",
                             hint="run forward again before a second backward")
        with torch.autocast(flat[0].device.type, enabled=False), _traced_mode():
            grads = step.backward_fn(store, flat[0].device, *_detached(flat), grad_loss.detach())
        ctx.store = ctx.flat = None
        out: list[Any] = [None] * len(flat)
        for i, g in zip(step.meta["grad_param_index"], grads):
            out[i] = g
        return (None, *out)


def _mismatch(message: str, hint: str = "re-run `slackswap profile`, `slackswap plan` and "
                                         "`slackswap apply` for this model and these inputs"):
    return FingerprintMismatch(message, hint=hint)


class PatchedStep(torch.nn.Module):
    """`model`'s training step under a plan: forward(inputs) -> loss, backward as usual.

    Holds `model` as a submodule, so `parameters()`/`buffers()` are the model's own tensors.
    Checks at construction that the model has the parameters and buffers the plan was made for
    (names, shapes, dtypes, device type) and, with `check_trace`, that it traces to the
    profile's graph; checks at every call that the inputs have the profiled shapes.
    After each forward, `held_bytes_after_forward` is what the step keeps on the device for
    backward and `last_store` a weak reference to its store.
    """

    def __init__(self, model: torch.nn.Module, meta: dict, forward_fn, backward_fn,
                 check_trace: bool = True):
        check_generated(meta)
        super().__init__()
        self.model = model
        self.meta = meta
        self.forward_fn = forward_fn
        self.backward_fn = backward_fn
        self.last_store = None
        self.held_bytes_after_forward = 0
        self._spec = pytree.treespec_loads(meta["input_spec"])
        self._check_model()
        if check_trace:
            self._check_trace()

    # -- checks ----------------------------------------------------------------------------
    def _check_model(self) -> None:
        got_p = [[n, list(p.shape), str(p.dtype)] for n, p in self.model.named_parameters()]
        got_b = [[n, list(b.shape), str(b.dtype)] for n, b in self.model.named_buffers()]
        for what, got, want in (("parameters", got_p, self.meta["params"]),
                                ("buffers", got_b, self.meta["buffers"])):
            if got != want:
                diff = next(((g, w) for g, w in zip(got, want) if g != w), None)
                detail = (f"{diff[0][0]} {diff[0][1]} {diff[0][2]} where the plan has "
                          f"{diff[1][0]} {diff[1][1]} {diff[1][2]}" if diff else
                          f"{len(got)} {what} where the plan has {len(want)}")
                raise _mismatch(f"this model's {what} differ from those the plan was made for: {detail}")
        params = list(self.model.parameters())
        if params and params[0].device.type != self.meta["device_type"]:
            raise _mismatch(f"the model is on {params[0].device.type}, the patched module was made "
                            f"for {self.meta['device_type']}",
                            hint=f"profile and apply on {params[0].device.type} "
                                 f"(`slackswap profile --device {params[0].device.type}`)")

    def _check_trace(self) -> None:
        """Re-trace this model with fake tensors and compare its profile fingerprint.

        The workload file is run again for its inputs and loss function; it may seed the RNG,
        so the caller's RNG state is saved and restored around it.
        """
        with forked_rng():      # NumPy's and Python's generators too (run/rng.py)
            self._check_trace_inner()

    def _check_trace_inner(self) -> None:
        w = self.meta["workload"]
        expected = self.meta.get("trace_fingerprint")
        if expected is None:  # the workload could not be traced with fake tensors at apply time
            return
        try:
            fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
            work = load_workload(w["path"], w["entry"], w["args"], fake_mode=fake_mode)
        except Exception:
            return
        memo = {}
        for t in [*self.model.parameters(), *self.model.buffers()]:
            fake = fake_mode.from_tensor(t)
            memo[id(t)] = torch.nn.Parameter(fake, t.requires_grad) \
                if isinstance(t, torch.nn.Parameter) else fake
        shadow = copy.deepcopy(self.model, memo)
        inputs = work.inputs
        if self.meta["device_type"] != "cpu":
            inputs = pytree.tree_map(lambda x: x.to(self.meta["device_type"])
                                     if isinstance(x, torch.Tensor) else x, inputs)
        joint = capture_joint(shadow, inputs, work.loss_fn, autocast=self.meta.get("autocast"),
                              target_device=self.meta.get("target_device"))
        fp = joint_fingerprint(joint)
        if fp != expected:
            raise _mismatch(f"this model traces to graph {fp}, the plan was made for graph "
                            f"{expected}")

    def _flat_inputs(self, args, kwargs) -> list[torch.Tensor]:
        leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
        if spec != self._spec:
            raise _mismatch("the patched step was called with inputs of another structure than "
                            "the profiled workload's",
                            hint="call it with the workload's inputs in the same form "
                                 "(step(*inputs) for a tuple, step(**inputs) for a dict)")
        tensors = []
        want = iter(self.meta["input_tensors"])
        for i, (x, is_t) in enumerate(zip(leaves, self.meta["input_is_tensor"])):
            if is_t:
                shape, dtype = next(want)
                if not isinstance(x, torch.Tensor) or list(x.shape) != shape or str(x.dtype) != dtype:
                    got = (f"{list(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor)
                           else type(x).__name__)
                    raise _mismatch(f"input {i} is {got}, the plan was made for {shape} {dtype}",
                                    hint="slackswap plans one fixed input shape: re-profile at this "
                                         "shape, or pad batches to the profiled one")
                tensors.append(x)
            elif repr(x) != self.meta["input_constants"][i]:
                raise _mismatch(f"input {i} is {x!r}, the plan was made with "
                                f"{self.meta['input_constants'][i]}")
        return tensors

    # -- the step --------------------------------------------------------------------------
    def forward(self, *args, **kwargs) -> torch.Tensor:
        if not self.model.training:
            raise InputError("the patched module runs training steps, but the model is in eval mode",
                             hint="call model.train() first, or call the model itself for evaluation")
        dev_type = self.meta["device_type"]
        if torch.is_autocast_enabled(dev_type) and not self.meta.get("autocast"):
            raise InputError("the patched step was called under torch.autocast, but the profile "
                             "was traced without it",
                             hint="re-profile with `slackswap profile --autocast bf16` (or fp16), "
                                  "so the casts are part of the traced step")
        inputs = self._flat_inputs(args, kwargs)
        if any(x.requires_grad for x in inputs):
            raise InputError("an input of the patched step requires grad, but the traced step "
                             "computes gradients of the parameters only",
                             hint="detach the inputs, or make the tensor that needs a gradient a "
                                  "parameter of the model")
        flat = [*self.model.parameters(), *self.model.buffers(), *inputs]
        return _StepFunction.apply(self, *flat)
