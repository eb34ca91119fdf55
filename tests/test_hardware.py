import dataclasses
from pathlib import Path

import orjson
import pytest

from slackswap_cli.errors import FormatError, InputError
from slackswap_cli.hardware import PRESETS, HardwareSpec, load_hardware

A100 = PRESETS["a100-pcie4"]


def test_presets_have_the_required_ones_with_sane_numbers():
    for name in ("a100-pcie4", "h100-pcie5", "h200-pcie5", "gh200-c2c", "rtx4090-pcie4"):
        spec = PRESETS[name]
        assert spec.name == name
        assert 0 < spec.matmul_efficiency <= 1 and 0 < spec.hbm_efficiency <= 1
        # a host link is always far slower than HBM
        assert spec.h2d_bytes_per_s < spec.hbm_bytes_per_s / 5
    assert PRESETS["gh200-c2c"].h2d_bytes_per_s > 10 * PRESETS["a100-pcie4"].h2d_bytes_per_s


def test_roofline_by_hand():
    # a 4096x4096x4096 bf16 matmul: 2*4096^3 FLOPs, reads 2 and writes 1 matrix of 32 MiB
    flops = 2 * 4096**3
    nbytes = 3 * 4096 * 4096 * 2
    compute_us = flops / (312e12 * 0.869) * 1e6         # 506.9 us: compute bound
    assert A100.roofline_us(flops, nbytes) == pytest.approx(compute_us + 2.0)
    # an elementwise op on 64 MiB in and out: memory bound
    nbytes = 2 * 64 * 2**20
    assert A100.roofline_us(1e6, nbytes) == pytest.approx(nbytes / (2039e9 * 0.85) * 1e6 + 2.0)
    # a view touches nothing and costs nothing
    assert A100.roofline_us(0, 0) == 0.0


def test_copy_time_by_hand():
    size = 257 * 10**6  # 257 MB at 25.7 GB/s = 10 ms
    assert A100.copy_us(size, "d2h") == pytest.approx(8.0 + 10_000.0)
    assert A100.copy_us(size, "h2d", contended=True) == pytest.approx(8.0 + 10_000.0 / 0.85)


def test_load_preset_and_json(tmp_path):
    assert load_hardware("h100-pcie5") is PRESETS["h100-pcie5"]
    assert load_hardware(None).name == "a100-pcie4"
    custom = dataclasses.asdict(A100) | {"name": "my-gpu", "h2d_bytes_per_s": 12e9}
    path = tmp_path / "gpu.json"
    path.write_bytes(orjson.dumps(custom))
    spec = load_hardware(str(path))
    assert isinstance(spec, HardwareSpec) and spec.h2d_bytes_per_s == 12e9


def test_bad_hardware_inputs(tmp_path):
    with pytest.raises(InputError, match="unknown hardware preset"):
        load_hardware("tpu-v9")
    with pytest.raises(InputError, match="does not exist"):
        load_hardware(str(tmp_path / "nope.json"))
    path = tmp_path / "bad.json"
    path.write_bytes(orjson.dumps({"name": "x", "peak_flops_per_s": 1e12}))
    with pytest.raises(FormatError, match="missing hardware field"):
        load_hardware(str(path))
    path.write_bytes(orjson.dumps(dataclasses.asdict(A100) | {"bogus": 1}))
    with pytest.raises(FormatError, match="unknown hardware field"):
        load_hardware(str(path))
    path.write_bytes(orjson.dumps(dataclasses.asdict(A100) | {"hbm_efficiency": 1.5}))
    with pytest.raises(FormatError, match="hbm_efficiency"):
        load_hardware(str(path))


@pytest.mark.parametrize("field,value", [
    ("h2d_bytes_per_s", 5e-324), ("d2h_bytes_per_s", True), ("hbm_bytes_per_s", 1e300),
    ("copy_latency_us", 1e308), ("kernel_overhead_us", 1e308), ("peak_flops_per_s", 0),
    ("matmul_efficiency", 1e-300), ("duplex_derate", 1.5), ("memory_bytes", 1.5),
    ("memory_bytes", -1), ("name", 7), ("name", ["a"]), ("name", {"a": 1}), ("name", ""),
    ("description", 3), ("fp32_flops_per_s", 1), ("tf32_flops_per_s", 1e3),
    ("fp8_flops_per_s", 0.5), ("fp32_flops_per_s", -1), ("bf16_sustained_fraction", 0),
    ("bf16_sustained_fraction", 1.2),
])
def test_hardware_numbers_are_bounded(field, value):
    data = PRESETS["a100-pcie4"].to_dict() | {"name": "mine", field: value}
    with pytest.raises(FormatError, match=field):
        HardwareSpec.from_dict(data)


def test_a_custom_file_may_not_reuse_a_presets_name_with_other_figures(tmp_path):
    """Plans and reports show the name: `a100-pcie4` must mean the preset's figures."""
    from helpers import assert_clean_error
    from typer.testing import CliRunner

    from slackswap_cli.cli import app
    edited = PRESETS["a100-pcie4"].to_dict() | {"h2d_bytes_per_s": 1e9}
    path = tmp_path / "mine.json"
    path.write_bytes(orjson.dumps(edited))
    with pytest.raises(InputError, match="a preset's name") as exc:
        load_hardware(str(path))
    assert "h2d_bytes_per_s" in exc.value.message and "name of its own" in exc.value.hint
    # the name may also come from the file's stem
    stem = tmp_path / "a100-pcie4.json"
    stem.write_bytes(orjson.dumps({k: v for k, v in edited.items() if k != "name"}))
    with pytest.raises(InputError, match="a preset's name"):
        load_hardware(str(stem))
    r = CliRunner().invoke(app, ["hardware", str(path)])
    assert_clean_error(r, 2, "a preset's name")
    # an exact copy of the preset, and an edited copy with a name of its own, are fine
    path.write_bytes(orjson.dumps(PRESETS["a100-pcie4"].to_dict()))
    assert load_hardware(str(path)) == PRESETS["a100-pcie4"]
    path.write_bytes(orjson.dumps(edited | {"name": "a100-slow-host"}))
    spec = load_hardware(str(path))
    assert spec.name == "a100-slow-host" and spec.h2d_bytes_per_s == 1e9


def test_rates_that_may_be_zero_are_zero_or_a_real_rate():
    """0 means "not given" for the FP32, TF32 and FP8 peaks; anything else is held to the
    floor of the rate it stands in for (an FP32 peak of 1 FLOP/s would price a step at years)."""
    data = PRESETS["a100-pcie4"].to_dict() | {"name": "mine"}
    for field in ("fp32_flops_per_s", "tf32_flops_per_s", "fp8_flops_per_s"):
        assert getattr(HardwareSpec.from_dict(data | {field: 0}), field) == 0
        assert getattr(HardwareSpec.from_dict(data | {field: 1e6}), field) == 1e6


def test_every_plan_written_loads_again(tmp_path):
    """What the loaders accept, `plan` either refuses with a hint that works or writes a plan
    that loads: a step that could outlast what a plan records (`schema.MAX_US`) on the
    hardware asked for is refused before planning, not written and refused when read."""
    from helpers import assert_clean_error
    from typer.testing import CliRunner

    from slackswap_cli import schema
    from slackswap_cli.cli import app
    runner = CliRunner()
    profile = Path(__file__).resolve().parents[1] / "sample_profiles" / "resnet50.json"
    out = tmp_path / "out.plan.json"
    slow = PRESETS["a100-pcie4"].to_dict() | {"name": "slow", "fp32_flops_per_s": 1}
    hw = tmp_path / "slow.json"
    hw.write_bytes(orjson.dumps(slow))
    plan = ["plan", str(profile), "--budget", "0.5", "--planner", "recompute-only",
            "--hardware", str(hw), "-o", str(out)]
    assert_clean_error(runner.invoke(app, plan), 2, "fp32_flops_per_s")
    # every figure at its floor: a valid hardware file, but ResNet-50's step on it would take
    # millennia
    floors = slow | {"fp32_flops_per_s": 1e6, "peak_flops_per_s": 1e6, "tf32_flops_per_s": 0,
                     "matmul_efficiency": 1e-3, "hbm_bytes_per_s": 1e6, "hbm_efficiency": 1e-3}
    hw.write_bytes(orjson.dumps(floors))
    assert runner.invoke(app, ["hardware", str(hw), "--json"]).exit_code == 0
    r = runner.invoke(app, plan)
    assert_clean_error(r, 2, "past the 1e+15 us a plan can record")
    assert not out.exists()
    # the hint: start from a preset's figures
    assert "slackswap hardware a100-pcie4 --json" in r.stderr
    preset = runner.invoke(app, ["hardware", "a100-pcie4", "--json"])
    hw.write_bytes(orjson.dumps(orjson.loads(preset.stdout) | {"name": "mine"}))
    r = runner.invoke(app, plan)
    assert r.exit_code == 0, r.stderr
    assert schema.load_plan(out).predicted.step_us < schema.MAX_US


def test_500w_h100_between_its_two_datasheets():
    # torchtitan's 500 W H100: one third of the way from H100 NVL (400 W) to SXM5 (700 W)
    hw = PRESETS["h100-sxm-96gb"]
    assert hw.peak_flops_per_s == pytest.approx(835e12 + (989e12 - 835e12) / 3, abs=1e9)
    assert hw.fp8_flops_per_s == pytest.approx(1671e12 + (1979e12 - 1671e12) / 3, abs=1e9)
    assert PRESETS["h100-sxm"].peak_flops_per_s > hw.peak_flops_per_s > 835e12


def test_a_file_without_the_sustained_fraction_keeps_the_rates_as_given():
    data = {k: v for k, v in PRESETS["a100-pcie4"].to_dict().items()
            if k != "bf16_sustained_fraction"}
    assert HardwareSpec.from_dict(data | {"name": "mine"}).bf16_sustained_fraction == 1.0


def test_the_hardware_view_says_the_sustained_fraction_is_fitted():
    from typer.testing import CliRunner

    from slackswap_cli.cli import app
    out = " ".join(CliRunner().invoke(app, ["hardware", "a100-pcie4"]).output.split())
    assert "x 0.830 sustained: fitted to published training runs" in out
    assert "not a datasheet figure" in out
    assert "sustained" not in CliRunner().invoke(app, ["hardware", "l4"]).output
