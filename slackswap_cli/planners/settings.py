"""Planner settings: one frozen dataclass per planner, checked when it is made.

A planner's tuning (how many tries a pass may take, how much of the copy slack to trust, the
MILP's limits) lives in one frozen dataclass with a docstring per field, not in module
constants: `SlackswapSettings` (slackswap.py), `OptimalSettings` (optimal.py), both extending
`StaticSettings` (common.py: the recompute greedy and the copy schedule they share).

Options given to `planners.make_plan` / `run_planner` become the planner's settings through
`from_options`: an option the dataclass has no field for, a value of the wrong type or out of
range is an `InputError` naming it. Every settings class is a `Settings`, whose
`__post_init__` checks each field against its annotation and the class's `_check_ranges`.
"""
from __future__ import annotations

import types
import typing
from dataclasses import dataclass, fields

from ..errors import InputError


@dataclass(frozen=True)
class Settings:
    """Base of the planners' settings: type checks from the annotations, then ranges."""

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in fields(self):
            value = getattr(self, f.name)
            if not _is_a(value, hints[f.name]):
                raise InputError(f"{self._planner()} option {f.name}={value!r} is not "
                                 f"{_describe(hints[f.name])}",
                                 hint=f"default: {f.name}={f.default!r}")
        self._check_ranges()

    def _check_ranges(self) -> None:
        """Subclasses raise through `_require` where a value is out of range."""

    def _require(self, ok: bool, name: str, what: str) -> None:
        if not ok:
            raise InputError(f"{self._planner()} option {name}={getattr(self, name)!r} is out "
                             f"of range: it must be {what}")

    @classmethod
    def _planner(cls) -> str:
        return f"{cls.__name__.removesuffix('Settings').lower() or 'planner'}"

    @classmethod
    def option_names(cls) -> list[str]:
        return sorted(f.name for f in fields(cls))


def from_options(planner: str, cls: type[Settings] | None, options: dict) -> Settings | None:
    """`cls(**options)`, with an option `cls` has no field for (or any option, for a planner
    without settings) an InputError naming it and listing the accepted ones."""
    accepted = cls.option_names() if cls is not None else []
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise InputError(f"planner '{planner}' takes no option {', '.join(unknown)}",
                         hint=f"its options: {', '.join(accepted) or 'none'}")
    return cls(**options) if cls is not None else None


def _is_a(value, hint) -> bool:
    """Whether `value` has the annotated type: int, float (an int is one too), bool, str,
    unions (`int | None`) and tuples (`tuple[float, bool]`, `tuple[X, ...]`)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_is_a(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if origin is tuple:
        args = typing.get_args(hint)
        if not isinstance(value, tuple):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_is_a(v, args[0]) for v in value)
        return len(value) == len(args) and all(_is_a(v, h) for v, h in zip(value, args))
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def _describe(hint) -> str:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(h) for h in typing.get_args(hint))
    if hint is type(None):
        return "None"
    if origin is tuple:
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:
            return f"a tuple of ({_describe(args[0])})"
        return f"a tuple ({', '.join(_describe(h) for h in args)})"
    return {float: "a number", int: "an integer", bool: "True or False"}.get(
        hint, getattr(hint, "__name__", str(hint)))
