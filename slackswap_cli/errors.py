"""Errors the library raises; only the CLI's error boundary (cli/boundary.py) turns them into
`Error:` / `Hint:` lines and exit codes.

Every error carries a message (what went wrong, naming the file, tensor or option) and a hint
(what the user can do about it). Exit codes: 2 bad input, 3 the model could not be traced or
run, 4 no plan fits the budget; `verify` exits 5 when it finds a mismatch (a finding, not an
error: the verify command says so itself).
"""
from __future__ import annotations

import os
from pathlib import Path


class SlackswapError(Exception):
    exit_code = 2

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:  # pragma: no cover - trivial
        return self.message if not self.hint else f"{self.message} (hint: {self.hint})"


class InputError(SlackswapError):
    """A file, option or argument the user gave is wrong."""


class FormatError(InputError):
    """A profile/plan/hardware file is not what it claims to be (format, version, ids)."""


class FingerprintMismatch(InputError):
    """A plan was made for another profile, or a model traces differently from its profile."""


class ModelChanged(SlackswapError):
    """`verify`: the model is not the one the plan was made for (a finding, like a mismatch)."""

    exit_code = 5


class VerifyFailed(SlackswapError):
    """`verify`: the patched run's values or memory differ from what the plan promises (a
    finding, raised after the report is shown)."""

    exit_code = 5


class CheckFailed(SlackswapError):
    """`check` (the library's verify): the patched step's values differ from eager's (a
    finding about the plan's run, like verify's mismatch)."""

    exit_code = 5


class TraceError(SlackswapError):
    """The workload could not be loaded, run or traced."""

    exit_code = 3


class InfeasibleError(SlackswapError):
    """No plan keeps activation memory under the budget."""

    exit_code = 4


def require_file(path: str | os.PathLike, what: str, hint: str | None = None, *,
                 dir_hint: str | None = None) -> Path:
    """`path` as a Path, when it names a file that exists; else an InputError: "{what} PATH
    does not exist" (with `hint`), or "PATH is a directory, not a/an {what}" (with `dir_hint`,
    else `hint`)."""
    p = Path(path)
    if not p.exists():
        raise InputError(f"{what} {p} does not exist", hint=hint)
    if p.is_dir():
        article = "an" if what[:1].lower() in "aeio" else "a"
        raise InputError(f"{p} is a directory, not {article} {what}", hint=dir_hint or hint)
    return p
