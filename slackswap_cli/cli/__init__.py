"""The `slackswap` command and its presentation: parse options, call the library (the core,
the top level of slackswap_cli, and the torch side: trace/, run/, onnx/), hand the result to
the output sink, map errors to exit codes.

A command computes its result (the data --json prints, and the render views that show it)
and hands it once to `output.Sink`, which decides how it shows (tables, --json, --quiet):
commands do not branch on the output format. `output.py` alone prints; the error boundary
(`boundary.py`, the one handler of every command's errors) alone turns errors into
`Error:` / `Hint:` lines and exit codes.

- common.py: the Typer `app` and what the commands share
- cmd_*.py: the commands, one module per command or pair of related commands
- output.py: the output sink; render/: the views; chrome_trace.py: the
  Perfetto trace of `simulate --trace`

Planner names, the default planner and what each planner takes come from the registry
(`planners.PLANNERS`, light to import). Imports of heavy modules (torch, the tracer, the
planners' code, render) happen inside the commands, so `plan`, `show`, `simulate` and
`compare` start without importing torch.
"""
from __future__ import annotations

# The commands register on `app` as their modules are imported, and `slackswap --help`
# lists them in this order: keep it (isort would sort it alphabetically).
# isort: off
from . import cmd_profile, cmd_plan, cmd_compare, cmd_fit, cmd_simulate  # noqa: F401
from . import cmd_apply, cmd_info  # noqa: F401
# isort: on
from .common import app

__all__ = ["app", "main"]


def main() -> None:
    app()
