"""--budget parsing and the floor check, with answers worked out by hand."""
import pytest

from slackswap_cli.budget import check_budget, fraction_bytes, keep_all_of, parse_budget
from slackswap_cli.errors import InfeasibleError, InputError
from slackswap_cli.simulate import budget_floor_bytes
from slackswap_cli.units import fmt_bytes, fmt_us
from slackswap_testkit.synthetic import chain_profile


@pytest.fixture(scope="module")
def prof():
    return chain_profile(4, act_bytes=1 << 20)   # keep-all peak: four 1 MiB tensors + 4 B loss


def test_fraction_of_keep_all_peak(prof):
    peak = prof.summary["peak_activation_bytes"]
    assert peak == (4 << 20) + 4
    assert parse_budget("0.5", prof) == ((2 << 20) + 2, 0.5)
    assert parse_budget("1", prof) == (peak, 1.0)
    assert parse_budget("1.0", prof) == (peak, 1.0)
    assert parse_budget(0.25, prof) == ((1 << 20) + 1, 0.25)
    assert parse_budget("50%", prof) == ((2 << 20) + 2, 0.5)


def test_fraction_to_bytes_and_back():
    # the one conversion (parse_budget, re-planning in a step, verify): rounded down; the
    # keep-all peak a patched module's budget and fraction stand for comes back to within the
    # rounding (less than 1 / fraction bytes)
    assert fraction_bytes(0.5, (4 << 20) + 4) == (2 << 20) + 2
    assert fraction_bytes(0.3, 10) == 3 and fraction_bytes(0.39, 10) == 3
    for peak in (7, 1000, (4 << 20) + 4, 123_456_789_012):
        for frac in (0.1, 0.25, 0.5, 0.77, 1.0):
            assert abs(keep_all_of(fraction_bytes(frac, peak), frac) - peak) <= 1 / frac
    assert keep_all_of((2 << 20) + 2, 0.5) == (4 << 20) + 4


@pytest.mark.parametrize("text,expected", [
    ("20GiB", 20 * 2**30), ("512MiB", 512 * 2**20), ("20GB", 20 * 10**9),
    ("1.5e9", 1_500_000_000), ("123456789", 123456789), ("64 KiB", 64 * 1024),
    ("2g", 2 * 2**30), ("1000B", 1000), ("2", 2),
])
def test_absolute_sizes(prof, text, expected):
    assert parse_budget(text, prof) == (expected, None)


@pytest.mark.parametrize("text,needle", [
    ("", "cannot read"), ("half", "cannot read"), ("-0.5", "positive"), ("-1GiB", "positive"), ("0", "positive"),
    ("1e400", "finite"),
    ("12 parsecs", "unknown unit"), ("1.5", "above 1"), ("0.5GiBx", "unknown unit"),
    ("150%", "100%"), ("0%", "100%"),
])
def test_bad_budgets_raise_input_error_with_hint(prof, text, needle):
    with pytest.raises(InputError, match=needle) as exc:
        parse_budget(text, prof)
    assert exc.value.hint


def test_check_budget_names_the_floor(prof):
    floor = budget_floor_bytes(prof)
    check_budget(floor, prof)                  # exactly the floor is allowed
    with pytest.raises(InfeasibleError, match="below the floor") as exc:
        check_budget(floor - 1, prof)
    assert str(floor) in exc.value.hint
    # the suggested fraction, rounded up, is itself accepted
    suggested = float(exc.value.hint.split("at least ")[1].split(" ")[0])
    check_budget(parse_budget(str(suggested), prof)[0], prof)


def test_units():
    assert fmt_bytes(512) == "512 B"
    assert fmt_bytes(1536) == "1.50 KiB"
    assert fmt_bytes(3 * 2**30) == "3.00 GiB"
    assert fmt_us(12.34) == "12.3 us" and fmt_us(1234) == "1.23 ms" and fmt_us(4.56e6) == "4.56 s"
