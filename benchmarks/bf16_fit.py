"""The one fitted bf16 constant: what fraction of the sourced tensor-core rates a training step
sustains (`slackswap_cli.hardware.BF16_SUSTAINED_FRACTION`, hardware.py's [FIT]).

Given measured tokens/s m_i of some runs and a predictor p_i(f) (tokens/s predicted with the
presets' bf16/fp16 tensor-core rates times f), the fitted f minimises the sum of squared log
errors, sum_i (log m_i - log p_i(f))^2, over [LOW, HIGH]: a golden-section search (the sum is
unimodal in f: every p_i falls as f falls), to `TOL`, then rounded to `DIGITS` places, the
precision it is printed and committed at. Leaving runs out is the same fit over the others
(`leave_one_out`, `leave_kind_out`). Used by benchmarks/published_runs.py, which holds the
runs and their predictor.
"""
from __future__ import annotations

import math

LOW, HIGH, TOL, DIGITS = 0.5, 1.0, 1e-6, 3
_GOLD = (math.sqrt(5) - 1) / 2


def squared_log_error(measured: dict, predict, f: float) -> float:
    """sum over runs of (log measured - log predicted at f)^2 (`measured`: run -> tokens/s,
    `predict(run, f)`: predicted tokens/s)."""
    return sum((math.log(m) - math.log(predict(run, f))) ** 2 for run, m in measured.items())


def fit_fraction(measured: dict, predict) -> float:
    """The f in [LOW, HIGH] that minimises `squared_log_error`, rounded to `DIGITS` places."""
    a, b = LOW, HIGH
    c, d = b - _GOLD * (b - a), a + _GOLD * (b - a)
    fc, fd = (squared_log_error(measured, predict, x) for x in (c, d))
    while b - a > TOL:
        if fc <= fd:
            b, d, fd = d, c, fc
            c = b - _GOLD * (b - a)
            fc = squared_log_error(measured, predict, c)
        else:
            a, c, fc = c, d, fd
            d = a + _GOLD * (b - a)
            fd = squared_log_error(measured, predict, d)
    return round((a + b) / 2, DIGITS)


def leave_one_out(measured: dict, predict) -> dict:
    """run -> (the fraction fitted on the other runs, this run's error at it: predicted /
    measured - 1)."""
    out = {}
    for run, m in measured.items():
        f = fit_fraction({r: v for r, v in measured.items() if r != run}, predict)
        out[run] = (f, predict(run, f) / m - 1)
    return out


def leave_kind_out(measured: dict, kind: dict, predict) -> dict:
    """kind -> (the fraction fitted on the runs of every other kind, {run of this kind: its
    error at it}) (`kind`: run -> its GPU kind)."""
    out = {}
    for k in sorted(set(kind.values())):
        f = fit_fraction({r: v for r, v in measured.items() if kind[r] != k}, predict)
        out[k] = (f, {r: predict(r, f) / measured[r] - 1 for r in measured if kind[r] == k})
    return out
