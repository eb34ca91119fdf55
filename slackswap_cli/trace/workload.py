"""Find and run a workload file: `model.py` defines `workload(**args)` returning what to train.

A workload file is plain Python. Its entry function (``workload`` unless ``--entry`` names
another) returns

- ``(model, inputs)``: ``model(*inputs)`` (tuple/list), ``model(**inputs)`` (dict) or
  ``model(inputs)`` (one tensor) gives the loss, or an object whose ``.loss`` is the loss
  (Hugging Face models given labels);
- ``(model, inputs, loss_fn)``: ``loss_fn(output, inputs)`` gives the loss;
- or a ``slackswap_cli.Workload`` with the same fields (and ``autocast="bf16"``/``"fp16"`` when
  the step trains under ``torch.autocast``).

``--arg key=value`` options become keyword arguments of the entry function. Values are Python
literals (``4``, ``0.1``, ``True``, ``None``, ``'bert'``, ``(1, 2)``); a bare word that is not a
literal (``dtype=bfloat16``) is taken as a string, so shell quoting is rarely needed.

A file may set a module-level ``NAME = "..."`` to name the workload in profiles; otherwise the
file's stem is its name.

With a FakeTensorMode, the entry function runs inside it, so the model's parameters and the
inputs are FakeTensors: a 7B-parameter model is "built" without allocating a byte. It also runs
under ``fake_build`` (fake_build.py), so ``model.to(torch.bfloat16)``, ``.half()`` and
value-dependent init such as ``trunc_normal_`` work on those FakeTensors as written.
"""
from __future__ import annotations

import ast
import dataclasses
import hashlib
import importlib.util
import inspect
import re
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
)

from ..errors import InputError, SlackswapError, TraceError, require_file
from ..workload_spec import Workload
from .fake_build import fake_build
from .joint import autocast_name

_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_BARE_WORD = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-/]*$")
_DTYPE_HINT = ("build the model in its dtype instead: pass dtype= to the layers, call "
               "torch.set_default_dtype() before building it, or use "
               "AutoModel.from_config(config, dtype=...) for transformers models")
_CPU_HINT = ("build the model and inputs on the CPU (the default device): --device fake needs "
             "no GPU, and for --device cuda slackswap moves them itself")


def parse_workload_args(items: list[str] | None) -> dict:
    """``["n_layer=2", "name='x'", "dtype=bfloat16"]`` -> ``{"n_layer": 2, "name": "x", "dtype": "bfloat16"}``.

    Each item is ``key=value``; the value is read with ``ast.literal_eval``, and a bare word
    that is not a literal is kept as a string. A key given twice is an error (which one was
    meant?).
    """
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not _KEY.match(key):
            raise InputError(f"bad --arg {item!r}: expected key=value with a Python identifier as key",
                             hint="e.g. --arg n_layer=2 --arg dtype=bfloat16")
        if key in out:
            raise InputError(f"--arg {key} is given twice", hint="give each argument once")
        text = text.strip()
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            if not _BARE_WORD.match(text):
                raise InputError(
                    f"bad --arg {item!r}: {text!r} is not a Python literal",
                    hint="values are Python literals: 4, 0.5, True, None, 'text', (1, 2); "
                         "quote strings with spaces or symbols, e.g. --arg \"name='a b'\"") from None
            value = text
        out[key] = value
    return out


def import_file(path: Path):
    """Import `path` as a fresh module (a new name each call, so two files named model.py never clash)."""
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
    name = f"slackswap_workload_{path.stem.replace('-', '_')}_{digest}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise InputError(f"{path} cannot be imported as Python", hint="pass a .py workload file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look modules up by name
    # the file may import its siblings, like a script run from its own folder
    folder = str(path.parent)
    added = folder not in sys.path
    if added:
        sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    except SyntaxError as exc:
        sys.modules.pop(name, None)
        where = f" at line {exc.lineno}" if exc.lineno else ""   # null bytes have no line
        raise InputError(f"{path} has a syntax error{where}: {exc.msg}",
                         hint="fix the workload file; `python FILE` shows the same error") from None
    except SlackswapError as exc:  # a workload that raises our own error keeps it
        sys.modules.pop(name, None)
        raise exc
    except KeyboardInterrupt:
        sys.modules.pop(name, None)
        raise
    except BaseException as exc:
        sys.modules.pop(name, None)
        raise TraceError(f"importing {path} failed: {_one_line(exc)}",
                         hint="run `python FILE` to see the full error; missing packages must be "
                              "installed in the environment slackswap runs in") from None
    finally:
        if added:
            try:
                sys.path.remove(folder)
            except ValueError:
                pass
    return module


def _one_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return (text.splitlines() or [type(exc).__name__])[0][:300]


def load_entry(path, entry: str = "workload", args: dict | None = None, *, fake_mode=None,
          device=None) -> tuple[Workload, Any]:
    """load_workload, also returning the imported module (for its NAME)."""
    p = require_file(Path(path).expanduser(), "workload file", hint="check the path",
                     dir_hint="pass a .py file").resolve()
    module = import_file(p)
    fn = getattr(module, entry, None)
    if fn is None or not callable(fn):
        found = sorted(n for n, v in vars(module).items()
                       if inspect.isfunction(v) and v.__module__ == module.__name__
                       and not n.startswith("_"))
        what = "no function" if fn is None else "a non-callable"
        raise InputError(f"{p.name} has {what} named '{entry}'",
                         hint=(f"functions in the file: {', '.join(found)}; choose one with --entry NAME"
                               if found else "define `def workload(): return model, inputs`"))
    args = dict(args or {})
    try:
        inspect.signature(fn).bind(**args)
    except TypeError as exc:
        raise InputError(f"{entry}() does not take these arguments: {exc}",
                         hint=f"{entry}{inspect.signature(fn)}") from None
    except ValueError:  # no signature (a builtin): let the call decide
        pass
    try:
        if fake_mode is not None:
            with fake_build(fake_mode), fake_mode:
                result = fn(**args)
        else:
            result = fn(**args)
    except SlackswapError:
        raise
    except Exception as exc:
        text = str(exc)
        if "not linked with support for cuda" in text or "Torch not compiled with CUDA" in text:
            raise InputError(f"{entry}() in {p.name} puts tensors on CUDA, which this torch "
                             "build lacks", hint=_CPU_HINT) from None
        if fake_mode is not None and "Couldn't swap" in text:
            raise TraceError(
                f"{entry}() in {p.name} converts a module (.to/.half/.bfloat16) whose "
                "parameters something else holds a weak reference to, which torch cannot do "
                "with fake tensors", hint=_DTYPE_HINT) from None
        if fake_mode is not None and _data_dependent(exc):
            raise TraceError(
                f"{entry}() in {p.name} reads a tensor's values while building ({_where(exc)}), "
                "and fake tensors (--device fake) have none",
                hint="guard value-dependent setup code with `if not isinstance(t, "
                     "torch._subclasses.FakeTensor)`, or profile with --device cpu") from None
        raise TraceError(f"{entry}() in {p.name} raised {_one_line(exc)}",
                         hint="run the workload eagerly to see the full traceback") from None
    work = as_workload(result, entry)
    try:
        work = dataclasses.replace(work, autocast=autocast_name(work.autocast))
    except InputError as exc:
        raise TraceError(f"{entry}() in {p.name} returned a Workload with {exc.message}",
                         hint=exc.hint) from None
    if fake_mode is not None:
        work = _to_fake(work, fake_mode)
    if device is not None:
        work = _to_device(work, torch.device(device))
    return work, module


def _data_dependent(exc: BaseException) -> bool:
    return (isinstance(exc, (DataDependentOutputException, DynamicOutputShapeException))
            or "data-dependent" in str(exc))


def _where(exc: BaseException) -> str:
    """`file.py:12` of the innermost frame outside torch that led to `exc`."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if "/torch/" not in f.filename and f.filename != __file__]
    if not frames:
        return type(exc).__name__
    f = frames[-1]
    return f"{Path(f.filename).name}:{f.lineno}"


def load_workload(path, entry: str = "workload", args: dict | None = None, *, fake_mode=None,
                  device=None) -> Workload:
    """Import the workload file at `path`, call `entry(**args)`, return a checked `Workload`.

    `fake_mode`: a FakeTensorMode to build model and inputs in (nothing allocated). `device`:
    move model and inputs there. Errors: a missing file or entry, or bad arguments ->
    InputError; a file or workload that raises, or returns the wrong thing -> TraceError.
    """
    return load_entry(path, entry, args, fake_mode=fake_mode, device=device)[0]


def workload_name(module, path) -> str:
    name = getattr(module, "NAME", None)
    return name if isinstance(name, str) and name else Path(path).stem


def as_workload(result: Any, entry: str) -> Workload:
    expected = "return (model, inputs), (model, inputs, loss_fn) or slackswap_cli.Workload(...)"
    if isinstance(result, Workload):
        work = result
    elif isinstance(result, (tuple, list)) and len(result) in (2, 3):
        work = Workload(*result)
    else:
        got = (f"a {type(result).__name__} of length {len(result)}"
               if isinstance(result, (tuple, list)) else f"a {type(result).__name__}")
        raise TraceError(f"{entry}() returned {got}", hint=expected)
    if not isinstance(work.model, torch.nn.Module):
        raise TraceError(f"{entry}() returned a {type(work.model).__name__} as the model, "
                         "not a torch.nn.Module", hint=expected)
    if work.loss_fn is not None and not callable(work.loss_fn):
        raise TraceError(f"{entry}()'s loss_fn is a {type(work.loss_fn).__name__}, not callable",
                         hint="loss_fn(output, inputs) must return the scalar loss")
    if not isinstance(work.inputs, (tuple, list, dict, torch.Tensor)):
        raise TraceError(f"{entry}() returned inputs of type {type(work.inputs).__name__}",
                         hint="inputs: a tuple of positional arguments, a dict of keyword "
                              "arguments, or one tensor")
    if not any(isinstance(x, torch.Tensor) for x in pytree.tree_leaves(work.inputs)):
        raise TraceError(f"{entry}() returned inputs without any tensor",
                         hint="pass the batch (e.g. token ids) as inputs")
    return work


def _to_fake(work: Workload, fake_mode) -> Workload:
    """Real tensors the workload made outside the mode (say at import time) become fake too."""
    def conv(t):
        if isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor):
            return fake_mode.from_tensor(t)
        return t

    real = [n for n, t in [*work.model.named_parameters(), *work.model.named_buffers()]
            if not isinstance(t, FakeTensor)]
    if real:
        raise TraceError(
            f"with --device fake the model must be built inside workload(), but {real[0]} "
            f"(and {len(real) - 1} more) was created outside it" if len(real) > 1 else
            f"with --device fake the model must be built inside workload(), but {real[0]} was "
            "created outside it",
            hint="construct the model in the entry function, or profile with --device cpu")
    inputs = pytree.tree_map(conv, work.inputs)
    work, inputs = _off_meta(work, inputs, fake_mode)
    # Fake CUDA tensors on a torch without CUDA abort the whole process (a C++ terminate) at
    # the first op that needs a device guard: refuse them while we still can. A CUDA build on
    # a machine without a GPU (PyPI's wheels) gets here too: it makes fake CUDA tensors
    # without complaint, so the CPU build's own "not compiled with CUDA" error never comes.
    if not torch.cuda.is_available():
        tensors = [*work.model.parameters(), *work.model.buffers(),
                   *(x for x in pytree.tree_leaves(inputs) if isinstance(x, torch.Tensor))]
        on = sorted({t.device.type for t in tensors} - {"cpu"})
        if on:
            raise InputError(
                f"the workload puts tensors on {', '.join(on)}, but this torch sees no CUDA "
                "device (a build without CUDA, or no GPU)",
                hint=_CPU_HINT)
    return dataclasses.replace(work, inputs=inputs)


def _off_meta(work: Workload, inputs, fake_mode) -> tuple[Workload, Any]:
    """(work, inputs) with what is on the meta device (a model built under
    `torch.device("meta")`, described before it is materialised) as FakeTensors on the CPU:
    ops refuse to mix meta tensors with the CPU inputs, and the fake trace stands for the model
    materialised (`--device fake` traces on the CPU)."""
    def meta(t):
        return isinstance(t, torch.Tensor) and t.device.type == "meta"

    def conv(t):
        if not meta(t):
            return t
        with fake_mode:
            return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device="cpu")

    if any(meta(t) for t in [*work.model.parameters(), *work.model.buffers()]):
        with fake_build(fake_mode), fake_mode:
            work.model.to_empty(device="cpu")       # fake tensors: nothing is allocated
    return work, pytree.tree_map(conv, inputs)


class MetaModelError(TraceError):
    """The workload's model is on the meta device, and the step was to run for real."""


def _to_device(work: Workload, device: torch.device) -> Workload:
    def move(t):
        return t.to(device) if isinstance(t, torch.Tensor) else t
    if any(t.device.type == "meta" for t in work.model.parameters()):
        raise MetaModelError(
            f"the model is on the meta device (built under torch.device('meta')): its "
            f"parameters have no values, so its step cannot be run and measured on {device}",
            hint="profile it with --device fake --hardware PRESET (a fake trace: the roofline "
                 "of PRESET costs every op), or materialise it in workload() "
                 "(model.to_empty(device=...), then initialise its weights)")
    try:
        model = work.model.to(device)
    except Exception as exc:
        raise TraceError(f"moving the model to {device} failed: {_one_line(exc)}",
                         hint="check that the device exists and the model fits in its memory") from None
    return dataclasses.replace(work, model=model, inputs=pytree.tree_map(move, work.inputs))
