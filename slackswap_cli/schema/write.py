"""Writing a profile or plan: orjson bytes (`dumps`), checked to read back (`save`), written
atomically (`write_atomic`: a temp file beside the target, then a rename).
"""
from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path
from typing import Any

import orjson

from ..errors import FormatError, InputError
from .load import plan_from_dict, profile_from_dict
from .types import Plan, Profile


def dumps(obj: Any) -> bytes:
    if dataclasses.is_dataclass(obj) and hasattr(obj, "to_dict"):
        obj = obj.to_dict()
    return orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY)


def write_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Write to a temp file beside `path`, then rename: no half-written file is ever left."""
    p = Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    except OSError as exc:
        raise InputError(f"cannot write {p}: {exc.strerror or exc}",
                         hint="choose an output path in a directory you can write to") from None
    try:
        # mkstemp creates the file 0600; give it the mode a plain open() would (or keep the
        # mode of the file it replaces), so profiles and plans can be shared like other files
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, _target_mode(p))
        os.replace(tmp, p)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(exc, OSError):
            raise InputError(f"cannot write {p}: {exc.strerror or exc}",
                             hint="choose an output path in a directory you can write to, "
                                  "with free space") from None
        raise


def check_target(path: str | os.PathLike) -> None:
    """Refuse, before anything is written, a target that is a directory."""
    p = Path(path)
    if p.is_dir():
        raise InputError(f"cannot write {p}: it is a directory; nothing was written",
                         hint=f"give a file path, e.g. {p / p.name}")


def _target_mode(p: Path) -> int:
    try:
        return p.stat().st_mode & 0o777
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def save(obj: Profile | Plan, path: str | os.PathLike) -> None:
    """Write a profile or plan atomically, after checking that the bytes read back: a value the
    loaders would refuse (a non-finite time from extreme hardware numbers, say) is reported
    here, and no file the tool writes is one it cannot read again."""
    data = dumps(obj)
    reload = profile_from_dict if isinstance(obj, Profile) else plan_from_dict
    try:
        reload(orjson.loads(data), source=f"the {type(obj).__name__.lower()} to write to {path}")
    except FormatError as exc:
        raise InputError(f"{exc.message}; nothing was written",
                         hint="check the hardware numbers and the inputs this was made from "
                              "for extreme values") from None
    write_atomic(path, data)
