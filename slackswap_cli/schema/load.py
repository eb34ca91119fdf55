"""Reading a profile or plan file: the JSON, its format and version, every field's JSON type,
the dataclasses built from it and then checked (`validate`). A bad file is a `FormatError`
that names it; a missing or unreadable one an `InputError`.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

import orjson

from ..errors import FormatError, InputError, require_file
from .types import (
    ACTIONS,
    CORRUPT_HINT,
    PLAN_FORMAT,
    PLAN_VERSION,
    PROFILE_FORMAT,
    PROFILE_VERSION,
    Decision,
    Op,
    Plan,
    Predicted,
    Profile,
    ScheduleEvent,
    Tensor,
)
from .validate import is_int, require, validate_plan, validate_profile

_CHECKS = {
    "int": is_int,
    "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
    "bool": lambda v: isinstance(v, bool),
    "dict": lambda v: isinstance(v, dict),
}
_CHECKS["tuple[int, ...]"] = lambda v: isinstance(v, tuple) and all(map(is_int, v))
_CHECKS["tuple[str, ...]"] = lambda v: isinstance(v, tuple) and all(isinstance(x, str) for x in v)
for _t in ("int", "float", "str"):
    _CHECKS[f"{_t} | None"] = (lambda c: lambda v: v is None or c(v))(_CHECKS[_t])
_TYPE_NAMES = {"tuple[int, ...]": "a list of integers", "tuple[str, ...]": "a list of strings",
               "dict": "an object", "int": "an integer", "float": "a number",
               "str": "a string", "bool": "true or false"}
_FIELD_CHECKS: dict[type, list] = {}


def _check_types(obj, source: str, what: str) -> None:
    """Every field of a schema dataclass holds the JSON type its annotation names: a file
    edited by hand (a string where a number belongs) is refused here, by name, instead of
    failing later deep inside the simulator or a renderer."""
    checks = _FIELD_CHECKS.get(type(obj))
    if checks is None:
        checks = _FIELD_CHECKS[type(obj)] = [
            (f.name, str(f.type), _CHECKS[str(f.type)]) for f in dataclasses.fields(obj)
            if str(f.type) in _CHECKS]
    for name, typ, ok in checks:
        value = getattr(obj, name)
        if not ok(value):
            base = typ.replace(" | None", "")
            expected = _TYPE_NAMES.get(base, base) + (" or null" if "None" in typ else "")
            raise FormatError(f"{source}: {what}.{name} is {value!r:.60}, expected {expected}",
                              hint=CORRUPT_HINT)


def _malformed(source: str, exc: Exception) -> FormatError:
    """A field of the wrong type (a string where a number belongs, null ids...) surfaces as a
    TypeError/ValueError deep in construction or validation: name the file, not the line."""
    return FormatError(f"{source}: malformed content ({type(exc).__name__}: {exc})",
                       hint=CORRUPT_HINT)


def _read_json(path: str | os.PathLike) -> Any:
    p = require_file(path, "file", hint="check the path",
                     dir_hint="pass a profile or plan JSON file inside it")
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise InputError(f"cannot read {p}: {exc.strerror or exc}",
                         hint="check the file's permissions") from None
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise FormatError(f"{p} is not valid JSON ({exc})",
                          hint="pass a file written by `slackswap profile` or `slackswap plan`") from None


def _check_header(data: Any, fmt: str, version: int, source: str) -> None:
    what = "profile" if fmt == PROFILE_FORMAT else "plan"
    origin = "profiles come from `slackswap profile`, plans from `slackswap plan`"
    if not isinstance(data, dict):
        raise FormatError(f"{source} is not a slackswap {what}: it holds a JSON "
                          f"{type(data).__name__}, not an object", hint=origin)
    got = data.get("format")
    if got is None:
        raise FormatError(f'{source} is not a slackswap {what}: it has no "format" field',
                          hint=origin)
    require(got == fmt, source, f"format is {got!r}, expected {fmt!r}", hint=origin)
    v = data.get("version")
    require(isinstance(v, int), source, f"version {v!r} is not an integer")
    require(v <= version, source, f"{fmt} version {v} is newer than this slackswap reads ({version})",
             hint="upgrade slackswap")
    require(v >= 1, source, f"unknown {fmt} version {v}")


def _build(cls, raw: Any, source: str, what: str, tuples: tuple[str, ...] = ()):
    require(isinstance(raw, dict), source, f"{what} is not an object")
    names = {f.name for f in dataclasses.fields(cls)}
    required = {f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    missing = required - set(raw)
    require(not missing, source, f"{what} lacks {', '.join(sorted(missing))}")
    kwargs = {k: v for k, v in raw.items() if k in names}
    for k in tuples:
        if k in kwargs:
            require(isinstance(kwargs[k], list), source, f"{what}.{k} is not a list")
            kwargs[k] = tuple(kwargs[k])
    obj = cls(**kwargs)
    _check_types(obj, source, what)
    return obj


def profile_from_dict(data: Any, source: str = "profile") -> Profile:
    _check_header(data, PROFILE_FORMAT, PROFILE_VERSION, source)
    for key in ("fingerprint", "workload", "env", "summary", "ops", "tensors"):
        require(key in data, source, f"missing key '{key}'")
    require(isinstance(data["ops"], list) and isinstance(data["tensors"], list), source,
             "'ops' and 'tensors' must be lists")
    ops = tuple(_build(Op, o, source, f"ops[{i}]", ("inputs", "outputs"))
                for i, o in enumerate(data["ops"]))
    tensors = tuple(_build(Tensor, t, source, f"tensors[{i}]", ("consumers", "shape"))
                    for i, t in enumerate(data["tensors"]))
    prof = Profile(fingerprint=data["fingerprint"], workload=data["workload"], env=data["env"],
                   summary=data["summary"], ops=ops, tensors=tensors,
                   format=data["format"], version=data["version"])
    _check_types(prof, source, "profile")
    require(len(ops) > 0, source, "the profile has no ops: there is nothing to plan")
    validate_profile(prof, source)
    return prof


def load_profile(path: str | os.PathLike) -> Profile:
    data = _read_json(path)
    try:
        return profile_from_dict(data, source=str(path))
    except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
        raise _malformed(str(path), exc) from None


def plan_from_dict(data: Any, source: str = "plan") -> Plan:
    _check_header(data, PLAN_FORMAT, PLAN_VERSION, source)
    for key in ("profile_fingerprint", "planner", "hardware", "budget_bytes", "feasible",
                "decisions", "predicted"):
        require(key in data, source, f"missing key '{key}'")
    for key in ("decisions", "schedule"):
        require(isinstance(data.get(key, []), list), source, f"'{key}' must be a list")
    decisions = tuple(_build(Decision, d, source, f"decisions[{i}]")
                      for i, d in enumerate(data["decisions"]))
    for d in decisions:
        require(d.action in ACTIONS, source, f"tensor {d.tensor} has action {d.action!r}",
                 hint=f"actions are {', '.join(ACTIONS)}")
    schedule = tuple(_build(ScheduleEvent, e, source, f"schedule[{i}]")
                     for i, e in enumerate(data.get("schedule", [])))
    predicted = _build(Predicted, data["predicted"], source, "predicted")
    kwargs = {k: data[k] for k in ("profile_fingerprint", "planner", "hardware", "budget_bytes",
                                   "feasible")}
    require(isinstance(data.get("notes", []), list), source, "notes is not a list")
    plan = Plan(**kwargs, budget_fraction=data.get("budget_fraction"), decisions=decisions,
                schedule=schedule, predicted=predicted, solve_ms=data.get("solve_ms", 0.0),
                notes=tuple(data.get("notes", ())), profile_path=data.get("profile_path"),
                model_path=data.get("model_path"), format=data["format"],
                version=data["version"])
    _check_types(plan, source, "plan")
    validate_plan(plan, source)
    return plan


def load_plan(path: str | os.PathLike) -> Plan:
    data = _read_json(path)
    try:
        return plan_from_dict(data, source=str(path))
    except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
        raise _malformed(str(path), exc) from None


def sniff_format(path: str | os.PathLike) -> str:
    """'slackswap.profile' or 'slackswap.plan' (for `show`, which takes either)."""
    data = _read_json(path)
    fmt = data.get("format") if isinstance(data, dict) else None
    if fmt not in (PROFILE_FORMAT, PLAN_FORMAT):
        found = (f"its format is {fmt!r}" if fmt is not None else
                 'it has no "format" field' if isinstance(data, dict) else
                 f"it holds a JSON {type(data).__name__}")
        raise FormatError(f"{path} is not a slackswap profile or plan: {found}",
                          hint="profiles come from `slackswap profile`, plans from `slackswap plan`")
    return fmt
