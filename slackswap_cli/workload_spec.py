"""`Workload`: what a workload file's `workload()` returns (torch-free, so `from slackswap_cli
import Workload` costs nothing)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable


@dataclass
class Workload:
    """What a workload file's `workload()` may return instead of a tuple.

    `inputs` is a tuple of positional arguments or a dict of keyword arguments for `model`;
    `loss_fn(output, inputs)` turns the output into a scalar loss (omit it when the output is
    the loss or has a `.loss` attribute). `autocast` ("bf16" or "fp16"): the step trains under
    `torch.autocast` in that dtype (forward and loss inside it, backward outside), so it is
    traced that way (`slackswap profile --autocast` says the same from the command line).
    `pipeline` (a workload that is one pipeline stage): e.g. `dict(pp=4, schedule="1F1B",
    microbatches=8)` (and `stages_per_rank` for Interleaved1F1B), recorded in the profile and
    read by `fit` and `simulate` where `--pp` and its flags are not given (a flag overrides).
    """

    model: Any
    inputs: Any
    loss_fn: Callable | None = None
    autocast: str | None = None
    pipeline: dict | None = None


def resolve_workload_path(path: str, near: str | None = None) -> str:
    """Where the workload file a profile or plan records lies.

    An absolute `path` is returned as it is. A relative one (the shipped sample profiles record
    `examples/gpt2_xl.py`, relative to the repository root) is looked up in the current
    directory, then in the folder of `near` (the profile's file) and each folder above it; the
    first that holds it wins. When none does, `path` comes back unchanged, for the caller's
    "does not exist" error.
    """
    p = Path(path)
    if p.is_absolute() or p.exists():
        return str(p)
    if near:
        for folder in Path(near).resolve().parents:
            if (folder / p).is_file():
                return str(folder / p)
    return str(p)
