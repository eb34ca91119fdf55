"""The output sink: a command hands its result here once, and the sink decides how it shows.

A command computes a `Result`: the data `--json` prints (a dict, a dataclass such as a Plan)
and the views that show it to a person (the render package's tables, built only when shown, so render
and what it needs are imported only then). `Sink.show` prints it one of three ways:

- human (the default): the views on stdout (Rich), then the closing lines (`wrote ...`);
  while the command works, status lines on stderr and a spinner on a terminal;
- `--json`: the data as one JSON document on stdout and nothing else there; no status lines,
  no spinner (a script reads stdout, and stderr stays for errors and warnings);
- `--quiet`: nothing on stdout and no status lines: the exit code and the files written say it.

Warnings go to stderr in every mode (they are about the result, not its progress). Errors
are `error_lines` (`Error:` / `Hint:` on stderr, whatever the mode) and an exit code (the
error boundary's, boundary.py). This module is the CLI's only printer (the library speaks
through run/notes.py); only the error boundary exits (tests/test_rules.py holds both).
"""
from __future__ import annotations

import sys
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import orjson
from rich.console import Console
from rich.markup import escape

out = Console(highlight=False, soft_wrap=False)
err = Console(stderr=True, highlight=False, soft_wrap=True)


@dataclass(frozen=True)
class Result:
    """What one command produced, in both of its forms."""

    data: Any
    """What --json prints: a dict, or a dataclass (a Plan, a verify report); or a function
    returning it, where making it costs what a person does not need (`version`)."""

    views: Callable[[], Iterable] | None = None
    """The renderables that show it to a person (the render package's), made only when shown."""

    lines: Sequence[str] = ()
    """Plain lines after the views (`wrote model.plan.json`), printed as written."""

    indent: bool = False
    """Indent the JSON (`hardware --json`: the start of a hand-edited file)."""


class Sink:
    """Where a command's status lines go while it works, and its `Result` when it is done."""

    def __init__(self, as_json: bool = False, quiet: bool = False):
        self.as_json = as_json
        self.quiet = quiet

    @property
    def human(self) -> bool:
        return not (self.as_json or self.quiet)

    def status(self, message: str) -> None:
        """A progress line on stderr, for a person only."""
        if self.human:
            err.print(f"[dim]{escape(message)}[/]", markup=True)

    @property
    def progress(self) -> Callable[[str], None] | None:
        """For library code that reports steps: `status` where no spinner shows them (stderr
        is not a terminal), else None."""
        return self.status if self.human and not err.is_terminal else None

    def working(self, message: str):
        """A spinner with the elapsed time on stderr while a slow step runs, for a person at a
        terminal only (scripts and pipes see nothing)."""
        if not self.human or not err.is_terminal:
            return nullcontext()
        # rich.progress loads only when a spinner shows (the CLI's start-up stays short)
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
        progress = Progress(SpinnerColumn(), TextColumn("{task.description}"),
                            TimeElapsedColumn(), console=err, transient=True)
        progress.add_task(message, total=None)
        return progress

    def warn(self, message: str) -> None:
        err.print(f"[yellow]Warning:[/] {escape(message)}", markup=True)

    def show(self, result: Result) -> None:
        """Print the command's result: tables and lines, JSON, or nothing."""
        if self.as_json:
            data = result.data() if callable(result.data) else result.data
            write_json(data, indent=result.indent)
        elif not self.quiet:
            for view in (result.views() if result.views is not None else ()):
                out.print(view, markup=False)
            for line in result.lines:
                out.print(line, markup=False)


def write_json(data: Any, indent: bool = False) -> None:
    """One JSON document on stdout (schema.dumps: dataclasses, numpy scalars, non-str keys)."""
    from ..schema import dumps
    text = (orjson.dumps(data, option=orjson.OPT_INDENT_2) if indent else dumps(data)).decode()
    sys.stdout.write(text + "\n")


def error_lines(message: str, hint: str | None) -> None:
    """`Error: ...` and `Hint: ...` on stderr, in every mode (the CLI exits after them)."""
    err.print(f"[bold red]Error:[/] {escape(message)}", markup=True, highlight=False)
    if hint:
        err.print(f"[bold]Hint:[/] {escape(hint)}", markup=True, highlight=False)
