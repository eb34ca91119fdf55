"""Every InfeasibleError hint works when followed as printed: the budget it names, as the
printed fraction and as the printed bytes, plans (fractions are rounded up, so the bytes they
stand for are never below the ones named), for every planner."""
import re

import pytest
import torch
from helpers import two_us_kernels

import slackswap_cli as slackswap
from slackswap_cli.budget import fraction_at_least, fraction_bytes
from slackswap_cli.errors import InfeasibleError
from slackswap_cli.planners import PLANNERS
from slackswap_cli.simulate import budget_floor_bytes

FIRST_FITS = re.compile(r"planner (\S+) first fits at [^(]*\((\d+) bytes; fraction ([\d.]+)\)")
FLOOR = re.compile(r"the floor is [^(]*\((\d+) bytes; fraction ([\d.]+)\)")
FROM_FLOOR = re.compile(r"`planner=(\S+)` fits every budget from there up")
BELOW = re.compile(r"raise the budget to at least ([\d.]+) \(fraction\) or [^(]*\((\d+) bytes\)")


def _model():
    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [torch.nn.Linear(48, 48), torch.nn.LayerNorm(48), torch.nn.GELU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(48, 4)), (torch.randn(16, 48),)


def _loss(out, inputs):
    return out.pow(2).mean()


def _plan(budget, planner):
    model, inputs = _model()
    return slackswap.plan_model(model, inputs, budget=budget, loss_fn=_loss,
                                device="fake:cpu", planner=planner)


def _followed(figures, planner):
    """Plan at each (fraction, bytes) pair as printed; each must fit."""
    for frac, nbytes in figures:
        for budget in (float(frac), int(nbytes)):
            plan = _plan(budget, planner)
            assert plan.feasible, (planner, budget)


def test_fractions_round_up_to_the_bytes_named():
    for peak in (1000, 4_000_037, 123_456_789):
        for nbytes in (1, peak // 3, peak // 3 + 1, peak - 1, peak):
            f = fraction_at_least(nbytes, peak)
            assert fraction_bytes(f, peak) >= nbytes
            assert f == 0.001 or fraction_bytes(round(f - 0.001, 3), peak) < nbytes


@pytest.mark.parametrize("planner", sorted(PLANNERS))
def test_each_planners_hint_followed_as_printed_plans(planner, monkeypatch):
    two_us_kernels(monkeypatch)       # plans that recompute as well as swap (see helpers)
    prof = _plan(1.0, "slackswap").profile
    floor, peak = budget_floor_bytes(prof), prof.keep_all_peak_bytes
    # below the floor: the budget the hint names is not below it
    with pytest.raises(InfeasibleError) as e:
        _plan(max(1, floor // 2), planner)
    frac, nbytes = BELOW.search(e.value.hint).groups()
    assert int(nbytes) == floor and fraction_bytes(float(frac), peak) >= floor
    # just above the floor: where the planner first fits, or the planner that fits from it
    try:
        _plan(floor, planner)
        return                               # (it fits at the floor: nothing to follow)
    except InfeasibleError as exc:
        text = f"{exc.message} {exc.hint}"
    fits = FIRST_FITS.search(text)
    if fits is not None:
        assert fits.group(1) == planner
        _followed([(fits.group(3), fits.group(2))], planner)
    else:                  # (a planner too slow for a budget search: the floor's planner)
        f_bytes, f_frac = FLOOR.search(text).groups()
        _followed([(f_frac, f_bytes)], FROM_FLOOR.search(text).group(1))
