"""How sizes and durations are written for people: one place, so every message agrees.

Bytes in binary units (how allocators and nvidia-smi count): `1.50 GiB`, `512 B`.
Durations given in microseconds: `12.3 us`, `1.23 ms`, `4.56 s`. A dtype by its profile name
(`dtype_name`: "float32").
"""
from __future__ import annotations

# binary units: the one definition (budget parsing, the views)
KIB, MIB, GIB, TIB = 2**10, 2**20, 2**30, 2**40


def fmt_bytes(n: float | int | None) -> str:
    """Binary units with two decimals: 1.50 GiB, 12.00 MiB, 512 B."""
    if n is None:
        return "-"
    x = float(n)
    if abs(x) < 1024:
        return f"{int(x)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        x /= 1024.0
        if abs(x) < 1024 or unit == "TiB":
            return f"{x:.2f} {unit}"
    raise AssertionError("unreachable")


def fmt_us(us: float | None) -> str:
    """A duration given in microseconds: 12.3 us, 1.23 ms, 4.56 s."""
    if us is None:
        return "-"
    a = abs(us)
    if a < 1000:
        return f"{us:.1f} us"
    if a < 1e6:
        return f"{us / 1e3:.2f} ms"
    return f"{us / 1e6:.2f} s"


def dtype_name(dtype) -> str:
    """A profile's dtype name ("float32") of a torch dtype or of its `str()` ("torch.float32",
    as a patched module's META records parameters). No torch needed. (Here, not in
    profile_build.py, so the eager runtime reads it without the profile's modules.)"""
    return str(dtype).removeprefix("torch.")
