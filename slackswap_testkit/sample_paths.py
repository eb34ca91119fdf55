"""Make the shipped sample profiles record their workload file relative to the repository root.

`slackswap profile` records the workload file's absolute path, which for a shipped profile is
the path on the machine that made it. `make samples` runs this after profiling, so the samples
say `examples/gpt2_xl.py`; apply resolves that against the current directory and the folders
above the profile (`slackswap_cli.workload_spec.resolve_workload_path`). Only `workload.path`
changes: every other byte of the file stays as it was (the fingerprint and ops included).

    python -m slackswap_testkit.sample_paths sample_profiles/*.json
"""
from __future__ import annotations

import sys
from pathlib import Path

import orjson

from slackswap_cli.schema import load_profile, write_atomic

ROOT = Path(__file__).resolve().parent.parent


def relative_workload_path(profile_path: str | Path, root: Path = ROOT) -> str:
    """Rewrite `workload.path` of the profile file relative to `root`; returns the new path.

    A path already relative is left alone; an absolute one must lie under `root`, or under a
    folder whose `examples/...` tail exists under `root` (a profile made in another checkout).
    """
    raw = Path(profile_path).read_bytes()
    data = orjson.loads(raw)
    if orjson.dumps(data) != raw.rstrip(b"\n"):
        raise ValueError(f"{profile_path}: not written the way slackswap writes profiles")
    old = Path(data["workload"]["path"])
    if not old.is_absolute():
        return str(old)
    new = _under(old, root)
    data["workload"]["path"] = new
    out = orjson.dumps(data) + (b"\n" if raw.endswith(b"\n") else b"")
    write_atomic(profile_path, out)
    load_profile(profile_path)  # still a profile
    return new


def _under(path: Path, root: Path) -> str:
    try:
        return path.relative_to(root.resolve()).as_posix()
    except ValueError:
        pass
    parts = path.parts
    for i in range(1, len(parts)):  # the longest tail that names a file under root
        tail = Path(*parts[i:])
        if (root / tail).is_file():
            return tail.as_posix()
    raise ValueError(f"{path} is not a file under {root}")


if __name__ == "__main__":
    for name in sys.argv[1:]:
        print(f"{name}: workload.path {relative_workload_path(name)}")
