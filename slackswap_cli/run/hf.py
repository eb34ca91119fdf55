"""The Hugging Face Trainer's way in: `Trainer(..., callbacks=[SlackswapCallback(budget=0.5)])`.

The callback plans on the first training batch the model is called with, in the Trainer's own
process and on its device (`plan_model`), patches the model in place (`patch`) and runs that
batch under the plan, checked first (`check`: eager against patched on its first samples,
once; `SlackswapCallback(check=False)` skips it): nothing else of the Trainer changes. It hooks
in at the first `on_step_begin` (after `accelerator.prepare`, which may wrap the model's
forward) by giving the model a one-call forward; a call in eval mode or without grad passes
through untouched.
"""
from __future__ import annotations

import torch
from transformers import TrainerCallback

from ..budget import ceil3
from ..errors import InfeasibleError, InputError
from ..simulate import budget_floor_bytes
from .api import patch, plan_model
from .eager.inplace import patched_state

__all__ = ["SlackswapCallback"]


class SlackswapCallback(TrainerCallback):
    """Plan the model on its first training batch and patch it (see the module docstring).

    Keyword arguments are `plan_model`'s (`budget` is required); `budget="auto"` counts the
    Trainer's own optimizer. After the first step, `.plan` is the Plan (`.plan.save(path)`
    writes the files the CLI reads). `check` (default True): that first batch is checked
    first (`slackswap_cli.check` on its first samples: eager against patched, bitwise;
    CheckFailed stops training when they differ), its CheckReport then `.check_report`."""

    def __init__(self, *, budget, check: bool = True, **plan_kwargs):
        self.plan_kwargs = {"budget": budget, **plan_kwargs}
        self.check = check
        self.plan = None
        self.check_report = None
        self._hooked = False

    def on_step_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if self._hooked or model is None:
            return
        self._hooked = True
        options = dict(self.plan_kwargs)
        if options["budget"] == "auto" and optimizer is not None:
            options.setdefault("optimizer", getattr(optimizer, "optimizer", optimizer))
        model.forward = _PlanOnFirstCall(model, options, self)


class _PlanOnFirstCall:
    """A model's forward for one training call: plan at that call's inputs, patch, run it."""

    def __init__(self, model: torch.nn.Module, options: dict, owner: SlackswapCallback):
        self.model, self.options, self.owner = model, options, owner
        self.previous = model.__dict__.get("forward")   # an instance forward (accelerate's)

    @property
    def __wrapped__(self):
        """What `inspect.signature(model.forward)` reads (the Trainer looks at it)."""
        return self.previous or type(self.model).forward.__get__(self.model)

    def _restore(self) -> None:
        if self.previous is None:
            self.model.__dict__.pop("forward", None)
        else:
            self.model.forward = self.previous

    def __call__(self, *args, **kwargs):
        model = self.model
        if not (model.training and torch.is_grad_enabled()):
            return self.__wrapped__(*args, **kwargs)
        self._restore()
        if args and kwargs:
            raise InputError("the model's first training call mixes positional and keyword "
                             "tensors", hint="call it with one kind (the Trainer calls "
                                             "model(**inputs)) to let slackswap plan it")
        inputs = dict(kwargs) if kwargs else tuple(args)
        try:
            self.owner.plan = plan_model(model, inputs, **self.options)
        except InfeasibleError as exc:
            raise _infeasible(exc, self.options["budget"]) from None
        patch(model, self.owner.plan, check=self.owner.check)
        out = model.forward(*args, **kwargs)
        self.owner.check_report = patched_state(model).check_report
        return out


def _infeasible(exc: InfeasibleError, budget) -> InfeasibleError:
    """`plan_model`'s InfeasibleError as the callback's: named for the callback, and below the
    floor (memory no plan can free: in small models with large vocabularies the logits and
    log-softmax the loss's backward reads at once, often more than half the peak) a hint with
    the budget to pass to it."""
    plan = getattr(exc, "plan", None)
    hint = exc.hint
    if plan is not None and plan.profile.keep_all_peak_bytes:
        prof = plan.profile
        floor = budget_floor_bytes(prof)
        if plan.budget_bytes < floor:
            hint = (f"SlackswapCallback(budget={ceil3(floor / prof.keep_all_peak_bytes)}) "
                    f"or more: this model's floor is {floor} bytes of its keep-all peak "
                    f"{prof.keep_all_peak_bytes}")
    out = InfeasibleError(f"SlackswapCallback(budget={budget!r}) at the first training batch: "
                          f"{exc.message}", hint=hint)
    out.plan = plan
    return out
