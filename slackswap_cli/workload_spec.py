"""`Workload`: what a workload file's `workload()` returns (torch-free, so `from slackswap_cli
import Workload` costs nothing)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass
class Workload:
    """What a workload file's `workload()` may return instead of a tuple.

    `inputs` is a tuple of positional arguments or a dict of keyword arguments for `model`;
    `loss_fn(output, inputs)` turns the output into a scalar loss (omit it when the output is
    the loss or has a `.loss` attribute). `autocast` ("bf16" or "fp16"): the step trains under
    `torch.autocast` in that dtype (forward and loss inside it, backward outside), so it is
    traced that way (`slackswap profile --autocast` says the same from the command line).
    """

    model: Any
    inputs: Any
    loss_fn: Callable | None = None
    autocast: str | None = None
