"""The views of a profile (`profile`, `show PROFILE`): totals, per layer, the largest saved
activations."""
from __future__ import annotations

from rich.table import Table
from rich.text import Text

from ...layers import op_layers
from ...schema import Profile
from ...units import MIB, fmt_bytes, fmt_us
from .format import Fit, kv_table, rows_table, short_target
from .layer_rows import close_enough, collapse_rows, ordered_layers


# --------------------------------------------------------------------------------------------
# profile
# --------------------------------------------------------------------------------------------
def profile_views(profile: Profile, top: int = 10) -> list:
    """Totals, a per-layer table, and the largest saved activations."""
    layers = op_layers(profile)
    return [_profile_totals(profile), _profile_per_layer(profile, layers),
            _biggest_saved(profile, layers[1], top)]


def _profile_costs(profile: Profile) -> str:
    """Where the op times come from: measured on a device, or a hardware roofline."""
    ops = profile.ops
    hw = profile.env.get("hardware")
    hw = hw.get("name") if isinstance(hw, dict) else hw
    device = profile.env.get("device_name") or profile.env.get("device")
    if all(o.time_source == "measured" for o in ops) and ops:
        return f"op times measured on {device or '?'}"
    if hw:
        return f"{hw} roofline" + (f"; traced with {device}" if device else "")
    return f"- (traced on {device})" if device else "-"


def _profile_totals(profile: Profile) -> Table:
    ops = profile.ops
    nf = profile.n_forward
    saved = profile.saved_activations
    sources: dict[str, int] = {}
    for o in ops:
        sources[o.time_source] = sources.get(o.time_source, 0) + 1
    step_us, sum_us = (profile.summary.get("measured_step_us"),
                       profile.summary.get("op_sum_us"))
    wl = profile.workload.get("name") or profile.workload.get("path") or "?"
    return kv_table("Profile", [
        ("workload", str(wl)),
        ("ops", f"{len(ops)} ({nf} forward, {len(ops) - nf} backward)"),
        ("forward time", fmt_us(sum(o.time_us for o in ops[:nf]))),
        ("backward time", fmt_us(sum(o.time_us for o in ops[nf:]))),
        ("saved activations", f"{fmt_bytes(sum(t.size_bytes for t in saved))} in "
                              f"{len(saved)} tensors"),
        ("keep-all peak", fmt_bytes(profile.keep_all_peak_bytes)),
        ("time source", ", ".join(f"{k} ({v} ops)" for k, v in sorted(sources.items())) or "-"),
        ("hardware", _profile_costs(profile)),
        *([("whole step", _step_check(step_us, sum_us))] if step_us and sum_us else []),
        ("fingerprint", profile.fingerprint),
    ])


def _profile_per_layer(profile: Profile, op_layers_: tuple[list[str], str | None]) -> Table:
    layers, container = op_layers_
    nf = profile.n_forward
    stats: dict[str, list] = {name: [0.0, 0.0, 0, 0, 0] for name in ordered_layers(profile,
                                                                                       layers)}
    for o in profile.ops:
        s = stats[layers[o.id]]
        s[0 if o.id < nf else 1] += o.time_us
        s[4] += 1
    for t in profile.saved_activations:
        s = stats[layers[t.producer]]
        s[2] += t.size_bytes
        s[3] += 1
    rows = [(name, (float(v[0]), float(v[1]), v[2], v[3], v[4])) for name, v in stats.items()]
    merged = collapse_rows(rows, container,
                       lambda a, b: a[2:] == b[2:] and close_enough(a[0], b[0]) and close_enough(a[1], b[1]))
    per_layer = Table(title="Per layer" + (" (collapsed rows show one block)"
                                           if any(n > 1 for _, n, _ in merged) else ""),
                      title_justify="left")
    per_layer.add_column("layer")
    for col in ("ops", "forward", "backward", "saved", "tensors"):
        per_layer.add_column(col, justify="right")
    for label, _, v in merged:
        per_layer.add_row(label, str(v[4]), fmt_us(v[0]), fmt_us(v[1]), fmt_bytes(v[2]),
                          str(v[3]))
    return per_layer


def _biggest_saved(profile: Profile, container: str | None, top: int) -> "Fit":
    ops = profile.ops
    saved = profile.saved_activations
    title = f"Largest saved activations (top {min(top, len(saved))} of {len(saved)})"
    cols = (("tensor", "left"), ("shape", "left"), ("dtype", "left"), ("size", "right"),
            ("producer", "left"), ("module", "left"), ("recompute", "right"),
            ("per MiB", "right"))
    rows = []
    for t in sorted(saved, key=lambda t: (-t.size_bytes, t.id))[:top]:
        op = ops[t.producer]
        rc = op.time_us
        per_mib = rc / (t.size_bytes / MIB) if t.size_bytes else None
        rows.append((t.name, "x".join(map(str, t.shape)) or "()", t.dtype,
                     fmt_bytes(t.size_bytes), short_target(op.target), op.module or "-",
                     fmt_us(rc) if t.recomputable else "no (random)",
                     fmt_us(per_mib) if per_mib is not None and t.recomputable else "-"))
    # narrow terminals: drop producer and dtype (the tensor's name and shape say most of it)
    # and shorten module paths inside the blocks (transformer.h.3.mlp -> h.3.mlp)
    narrow_keep = (0, 1, 3, 5, 6, 7)
    narrow_rows = [[_short_module(r[i], container) if i == 5 else r[i] for i in narrow_keep]
                   for r in rows]
    return Fit(rows_table(title, cols, rows),
                rows_table(title, [cols[i] for i in narrow_keep], narrow_rows, compact=True))


def _short_module(module: str, container: str | None) -> str:
    if container and module.startswith(container + "."):
        return container.rsplit(".", 1)[-1] + module[len(container):]
    return module


def _step_check(step_us: float, sum_us: float) -> Text:
    """A measured profile's two clocks: the whole step and the sum of its ops. Python dispatch
    between ops makes the step somewhat longer; far apart, the machine was busy while it was
    timed and the per-op times are not to be trusted."""
    text = Text(f"{fmt_us(step_us)} measured end to end; ops sum to {fmt_us(sum_us)}")
    ratio = max(step_us, sum_us) / min(step_us, sum_us)
    if ratio > 2:
        text.append(f" ({ratio:.0f}x apart: timing was noisy, re-profile on an idle machine)",
                    style="yellow")
    return text
