"""Per-layer rows: runs of identical repeated blocks collapsed into one row.

A model of 48 identical blocks should read as one row, not 48. `layers` finds the
repeated blocks from the module paths (`transformer.h.3.mlp` is in block `transformer.h.3`;
outside the blocks, a short prefix such as `transformer.wte` or `lm_head` names the row).
Consecutive blocks with the same structure (op count, saved bytes) and times within 25%
(measured times jitter) collapse into one row,
`transformer.h.0-47 (x48)`, showing per-block values.
"""
from __future__ import annotations

from ...layers import layer_index
from ...schema import Profile


# --------------------------------------------------------------------------------------------
# layers (found by `layers`)
# --------------------------------------------------------------------------------------------
def close_enough(a: float, b: float, tol: float = 0.25) -> bool:
    return abs(a - b) <= tol * max(abs(a), abs(b), 1e-9)


def collapse_rows(rows: list[tuple[str, tuple]], container: str | None,
              same) -> list[tuple[str, int, tuple]]:
    """Merge runs of consecutive numbered blocks whose values `same(a, b)` agree.
    Returns (label, count, values of the run's first block averaged) per row."""
    out: list[tuple[str, int, list]] = []
    run: list[tuple[int, tuple]] = []

    def flush():
        if not run:
            return
        first, last = run[0][0], run[-1][0]
        n = len(run)
        pre = f"{container}." if container else ""
        label = f"{pre}{first}" if n == 1 else f"{pre}{first}-{last} (x{n})"
        vals = tuple(sum(v[k] for _, v in run) / n if isinstance(run[0][1][k], float)
                     else run[0][1][k] for k in range(len(run[0][1])))
        out.append((label, n, vals))
        run.clear()

    for name, vals in rows:
        idx = layer_index(name, container)
        if idx is not None and run and idx == run[-1][0] + 1 and same(run[0][1], vals):
            run.append((idx, vals))
            continue
        flush()
        if idx is not None:
            run.append((idx, vals))
        else:
            out.append((name, 1, vals))
    flush()
    return out


def ordered_layers(profile: Profile, layers: list[str]) -> list[str]:
    seen: dict[str, None] = {}
    for i in range(len(profile.ops)):
        seen.setdefault(layers[i], None)
    return list(seen)
