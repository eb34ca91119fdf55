"""The error boundary every command runs behind: the app's click group.

Library code raises `SlackswapError(message, hint)`; here it becomes `Error: ...` / `Hint: ...`
on stderr and the error's exit code (2 bad input, 3 tracing failed, 4 no plan fits, 5 verify
found a mismatch, after its report). Commands have no error handling of their own: this is the
one handler. Usage errors (a missing option, an unknown command) get the same two lines and exit 2. Any
other exception is a bug in slackswap: users see `Error: internal error ...` and exit 1, never
a raw traceback, unless SLACKSWAP_DEBUG=1 asks for it. This module alone exits (commands
raise, findings included: tests/test_rules.py).
"""
from __future__ import annotations

import errno
import os
import sys
import traceback

import typer
from typer.core import TyperGroup

from ..errors import SlackswapError
from .output import error_lines

DEBUG_ENV = "SLACKSWAP_DEBUG"


class BoundaryGroup(TyperGroup):
    """Runs every command behind one error boundary (see the module docstring)."""

    def invoke(self, ctx):
        try:   # typer >= 0.2x vendors click; older ones use click itself
            from typer._click.exceptions import ClickException, UsageError
        except ImportError:  # pragma: no cover
            from click.exceptions import ClickException, UsageError
        try:
            return super().invoke(ctx)
        except (typer.Exit, typer.Abort):
            raise
        except UsageError as exc:
            sub = exc.ctx.command_path if exc.ctx is not None else "slackswap"
            error_lines(exc.format_message(), f"see `{sub} --help`")
            raise typer.Exit(2) from None
        except ClickException:
            raise
        except SlackswapError as exc:      # the one handler of every command's errors
            _fail(exc)
        except KeyboardInterrupt:
            error_lines("interrupted", None)
            raise typer.Exit(130) from None
        except SystemExit as exc:          # our exits are typer.Exit: this one is user code's
            if isinstance(exc.__context__, BrokenPipeError):
                _closed_pipe()             # Rich's exit when stdout closed early (`| head`)
            who = ("the patched module or the workload" if ctx.invoked_subcommand == "verify"
                   else "the workload")
            error_lines(f"{who} called sys.exit({exc.code!r}) while slackswap ran it",
                        "a module slackswap imports must not exit: put script code under "
                        "`if __name__ == \"__main__\":`")
            raise typer.Exit(3) from None
        except OSError as exc:
            if exc.errno == errno.EPIPE:   # `slackswap show ... | head`: not an error
                _closed_pipe()
            _internal_error(exc)
        except ModuleNotFoundError as exc:
            if (exc.name or "").split(".")[0] != "torch":
                _internal_error(exc)
            error_lines(f"`slackswap {ctx.invoked_subcommand or ''}` needs torch, which is not "
                        "installed", "pip install 'slackswap[torch]' (or a torch build for your "
                        "CUDA version from pytorch.org); plan, show, simulate and compare run "
                        "without it")
            raise typer.Exit(2) from None
        except Exception as exc:
            _internal_error(exc)


def _closed_pipe() -> None:
    """Stdout was closed by the reader (`slackswap show ... | head -1`): a normal end. Point
    stdout at /dev/null so the interpreter's final flush does not fail, and exit 0."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # pragma: no cover - stdout without a descriptor
        pass
    raise typer.Exit(0)


def _fail(exc: SlackswapError) -> None:
    error_lines(exc.message, exc.hint)
    raise typer.Exit(exc.exit_code)


def _internal_error(exc: BaseException) -> None:
    if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
        hint = "this is a bug in slackswap; please report it with the traceback above"
    else:
        hint = (f"this is a bug in slackswap, not in your input; please report it with the "
                f"command you ran (run it again with {DEBUG_ENV}=1 to print the traceback)")
    text = str(exc).splitlines()[0][:300] if str(exc) else ""
    error_lines(f"internal error: {type(exc).__name__}" + (f": {text}" if text else ""), hint)
    raise typer.Exit(1)
