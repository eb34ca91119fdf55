"""The layout of the files `slackswap apply` writes, and the check that a file has it.

GENERATOR_VERSION is written into every patched module's META. Code that runs such a file
(`patch`, `step_module`, `verify`, `load_patched`) refuses one written with another layout:
its tables would be read by the wrong columns, silently. Raise it whenever META, TABLE or
GRAPH_TABLE change shape (their rows: `table_rows.py`).
"""
from __future__ import annotations

from ..errors import InputError

# 3: the file imports one runtime module, run/door.py (2: run.inplace, run.step and
# table_rows; its op rows `table_rows.OpRow` / `GraphRow`; 1: positional lists)
GENERATOR_VERSION = 3


def check_generated(meta) -> None:
    """InputError unless `meta` (a patched module's META) was written with this layout."""
    found = meta.get("generator_version") if isinstance(meta, dict) else None
    if found == GENERATOR_VERSION:
        return
    said = ("records no layout version" if found is None
            else f"was written with layout version {found!r}")
    by = meta.get("slackswap_version") if isinstance(meta, dict) else None
    if by is not None:
        said += f" (by slackswap {by})"
    raise InputError(f"this patched module {said}; this slackswap runs layout version "
                     f"{GENERATOR_VERSION} only",
                     hint="write it again with `slackswap apply PLAN.json -o FILE` "
                          "(the plan and profile files are unchanged)")
