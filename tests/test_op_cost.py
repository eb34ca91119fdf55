"""The cost model (slackswap_cli/op_cost.py): op times by hand per dtype and precision, the
precision a profile records, the refusal to plan a profile priced by other constants, and the
fitting script reproducing the committed constants (benchmarks/fit_costs.py, seconds)."""
import dataclasses
import json
from pathlib import Path

import pytest
from helpers import assert_clean_error, load_benchmark
from typer.testing import CliRunner

from slackswap_cli import schema
from slackswap_cli.cli import app
from slackswap_cli.errors import InputError
from slackswap_cli.hardware import BF16_SUSTAINED_FRACTION, PRESETS, HardwareSpec
from slackswap_cli.op_cost import (
    COSTS_FILE,
    Precision,
    check_cost_model,
    cost_model_from_dict,
    default_cost_model,
    fp32_clock_factor,
    is_backward_kernel,
    memory_rate,
    op_class,
    op_time_us,
    price_profile,
    wave_utilisation,
)
from slackswap_cli.profile_build import ProfileBuilder

ROOT = Path(__file__).resolve().parents[1]
# hand-made constants: every class at half its peak, 3 us a kernel
HALF = cost_model_from_dict({
    "fp32_efficiency": {"gemm": 0.5, "bgemm": 0.25},
    "memory_efficiency": {c: 0.5 for c in ("gemm", "bgemm", "attention", "conv", "elementwise",
                                           "norm", "softmax", "reduction", "embedding", "loss")},
    "kernel_overhead_us": 3.0})
N = 4096
GEMM_FLOPS = 2 * N**3            # 1.374e11
A100 = PRESETS["a100-80gb-pcie"]  # 312 TF bf16, 156 TF32, 19.5 FP32, 1935 GB/s, 108 SMs, eff 0.811
S = BF16_SUSTAINED_FRACTION       # the fitted fraction of bf16/fp16 tensor-core rates (presets)


@pytest.mark.parametrize("dtype, precision, expected_us", [
    # bf16 tensor cores: 1.374e11 / (312e12 x 0.811 x S), + 3 us
    ("bfloat16", Precision(), GEMM_FLOPS / (312e12 * 0.811 * S) * 1e6 + 3),
    ("float16", Precision(), GEMM_FLOPS / (312e12 * 0.811 * S) * 1e6 + 3),
    # TF32 allowed: 156e12 x 0.811 -> 1086.3 us
    ("float32", Precision(tf32_matmul=True), GEMM_FLOPS / (156e12 * 0.811) * 1e6 + 3),
    # fp32 FMA: 19.5e12 x 0.5 x waves (32 x 32 = 1024 tiles over 108 SMs: 10 waves, 1024/1080)
    ("float32", Precision(), GEMM_FLOPS / (19.5e12 * 0.5 * 1024 / 1080) * 1e6 + 3),
    # fp8 on an A100 (none): the bf16 figure, without the fraction fitted on bf16 runs
    ("float8_e4m3fn", Precision(), GEMM_FLOPS / (312e12 * 0.811) * 1e6 + 3),
])
def test_gemm_time_by_dtype_by_hand(dtype, precision, expected_us):
    got = op_time_us(A100, HALF, "gemm", dtype, GEMM_FLOPS, 3 * N * N * 2, precision, (N, N))
    assert got == pytest.approx(expected_us, rel=1e-9)


def test_fp32_is_sixteen_times_bf16_and_fp8_twice_on_h100():
    h100 = PRESETS["h100-sxm"]   # 989 TF bf16, 1979 FP8, 494.7 TF32, 67 FP32, eff 0.803
    t = {dt: op_time_us(h100, HALF, "gemm", dt, GEMM_FLOPS, 0, Precision(), (N, N)) - 3
         for dt in ("bfloat16", "float8_e5m2", "float32")}
    assert t["bfloat16"] == pytest.approx(GEMM_FLOPS / (989e12 * 0.803 * S) * 1e6)
    assert t["float8_e5m2"] == pytest.approx(GEMM_FLOPS / (1979e12 * 0.803) * 1e6)
    # 1024 tiles over 132 SMs: 8 waves, 1024 / 1056
    assert t["float32"] == pytest.approx(GEMM_FLOPS / (67e12 * 0.5 * 1024 / 1056) * 1e6)


def test_memory_bound_ops_and_free_views_by_hand():
    h100 = PRESETS["h100-sxm"]
    # 1 GB through 3350 GB/s at half: 597.0 us, + 3 us; the dtype does not matter
    for dtype in ("float32", "bfloat16"):
        assert op_time_us(h100, HALF, "elementwise", dtype, 0, 1e9) == \
            pytest.approx(1e9 / (3350e9 * 0.5) * 1e6 + 3)
    assert op_time_us(h100, HALF, "elementwise", "float32", 0, 0) == 0.0
    # a batched GEMM's compute at its own class's efficiency (0.25), no waves for 8 x 1 tiles
    # under 132 SMs: 8 tiles fill 8 of 132 slots
    assert wave_utilisation((8, 128, 128), 132) == pytest.approx(8 / 132)
    assert wave_utilisation((N, N), 0) == 1.0


def test_fp32_clock_factor_and_the_l2_by_hand():
    wide = dataclasses.replace(HALF, wide_sm_efficiency=0.8, power_knee_w=140.0)
    # H100: 128 lanes, 700 W (over the knee): 0.8; L4: 128 lanes, 72 W: 0.8 x 72/140 = 0.4114;
    # A100 80GB PCIe: 64 lanes, 300 W: 1; T4: 64 lanes, 70 W: 0.5
    assert [fp32_clock_factor(PRESETS[p], wide) for p in ("h100-sxm", "l4", "a100-80gb-pcie",
                                                          "t4")] == [0.8, 0.4114, 1.0, 0.5]
    assert fp32_clock_factor(PRESETS["l4"], HALF) == 1.0       # constants without them
    t = op_time_us(PRESETS["h100-sxm"], wide, "gemm", "float32", GEMM_FLOPS, 0, Precision(),
                   (N, N))
    assert t == pytest.approx(GEMM_FLOPS / (67e12 * 0.5 * 0.8 * 1024 / 1056) * 1e6 + 3)
    # bf16 runs on tensor cores: no fp32 factor
    assert op_time_us(PRESETS["l4"], wide, "gemm", "bfloat16", GEMM_FLOPS, 0) == \
        op_time_us(PRESETS["l4"], HALF, "gemm", "bfloat16", GEMM_FLOPS, 0)
    # L4: 48 MiB of L2 at 5120/108 B/clk/SM x 58 SMs x 2.04 GHz = 5.611 TB/s, HBM 300 GB/s
    l4 = PRESETS["l4"]
    assert l4.l2_bytes == 48 * 2**20 and l4.l2_bytes_per_s == 5.611e12
    assert op_time_us(l4, HALF, "norm", "float32", 0, 10e6) == pytest.approx(
        10e6 / (5.611e12 * 0.5) * 1e6 + 3)
    assert op_time_us(l4, HALF, "norm", "float32", 0, 60e6) == pytest.approx(
        60e6 / (300e9 * 0.5) * 1e6 + 3)                          # over 48 MiB: HBM
    assert op_time_us(l4, HALF, "gemm", "float32", 0, 10e6) == pytest.approx(
        10e6 / (300e9 * 0.5) * 1e6 + 3)                          # a matmul's traffic: HBM
    # V100: 6 MiB of L2 at 2048 B/clk x 1.3672 GHz (14e12 / (2 x 64 x 80)) = 2.8 TB/s
    v100 = PRESETS["v100-pcie"]
    assert memory_rate(v100, HALF, "elementwise", 6e6) == pytest.approx(2.8e12 * 0.5)
    assert memory_rate(v100, HALF, "elementwise", 7e6) == pytest.approx(900e9 * 0.5)


def test_hardware_file_without_the_new_figures_prices_fp32_at_its_one_peak():
    old = {k: v for k, v in PRESETS["a100-pcie4"].to_dict().items()
           if k not in ("fp32_flops_per_s", "tf32_flops_per_s", "fp8_flops_per_s", "sm_count",
                        "link_source", "fp32_lanes_per_sm", "board_power_w", "l2_bytes",
                        "l2_bytes_per_s", "attention_efficiency", "bf16_sustained_fraction")}
    hw = HardwareSpec.from_dict(dict(old, name="old-file"))
    assert op_time_us(hw, HALF, "gemm", "float32", GEMM_FLOPS, 0) == \
        pytest.approx(GEMM_FLOPS / (312e12 * 0.869) * 1e6 + 3)
    # no attention figure: fused attention at the GEMM fraction; no fitted fraction: 1
    assert op_time_us(hw, HALF, "attention", "bfloat16", GEMM_FLOPS, 0) == \
        pytest.approx(GEMM_FLOPS / (312e12 * 0.869) * 1e6 + 3)


def test_attention_priced_at_its_own_fraction_by_hand():
    h100 = PRESETS["h100-sxm"]   # 989 TF bf16; GEMMs 0.803, FlashAttention-2 335 of 989
    assert h100.attention_efficiency == pytest.approx(0.3387)
    got = op_time_us(h100, HALF, "attention", "bfloat16", GEMM_FLOPS, 0)
    assert got == pytest.approx(GEMM_FLOPS / (989e12 * 0.3387 * S) * 1e6 + 3)
    # a GEMM on the same GPU, and the batched GEMMs of eager attention, keep the GEMM fraction
    for cls in ("gemm", "bgemm"):
        assert op_time_us(h100, HALF, cls, "bfloat16", GEMM_FLOPS, 0) == \
            pytest.approx(GEMM_FLOPS / (989e12 * 0.803 * S) * 1e6 + 3)
    # A100 80GB PCIe: FlashAttention-2's 73% on the SXM4, times 0.811 / 0.869
    assert A100.attention_efficiency == pytest.approx(round(0.73 * 0.811 / 0.869, 4))
    # fp32 attention runs on the FMA units, as before
    fp32 = op_time_us(h100, HALF, "attention", "float32", GEMM_FLOPS, 0, Precision(), (N, N))
    assert fp32 == pytest.approx(GEMM_FLOPS / (67e12 * 0.5 * 1024 / 1056) * 1e6 + 3)


def test_attention_backward_kernel_at_its_own_fraction_by_hand():
    # A100 SXM4: FlashAttention-2's forward kernel 73% of 312 TF, its backward kernel 63%
    sxm = PRESETS["a100-pcie4"]
    assert (sxm.attention_efficiency, sxm.attention_backward_efficiency) == (0.73, 0.63)
    fwd = op_time_us(sxm, HALF, "attention", "bfloat16", GEMM_FLOPS, 0)
    bwd = op_time_us(sxm, HALF, "attention", "bfloat16", GEMM_FLOPS, 0, backward=True)
    assert fwd == pytest.approx(GEMM_FLOPS / (312e12 * 0.73 * S) * 1e6 + 3)
    assert bwd == pytest.approx(GEMM_FLOPS / (312e12 * 0.63 * S) * 1e6 + 3)
    # a backward GEMM keeps the GEMM fraction; the H100 gives one figure for both halves
    assert op_time_us(sxm, HALF, "gemm", "bfloat16", GEMM_FLOPS, 0, backward=True) == \
        op_time_us(sxm, HALF, "gemm", "bfloat16", GEMM_FLOPS, 0)
    h100 = PRESETS["h100-sxm"]
    assert h100.attention_backward_efficiency == 0
    assert op_time_us(h100, HALF, "attention", "bfloat16", GEMM_FLOPS, 0, backward=True) == \
        op_time_us(h100, HALF, "attention", "bfloat16", GEMM_FLOPS, 0)
    # price_profile tells the backward kernel by its name
    assert is_backward_kernel("aten._scaled_dot_product_flash_attention_backward.default")
    assert not is_backward_kernel("aten._scaled_dot_product_flash_attention.default")


@pytest.mark.parametrize("target, cls", [
    ("aten.mm.default", "gemm"), ("aten.addmm.default", "gemm"), ("aten.bmm.default", "bgemm"),
    ("aten._scaled_dot_product_flash_attention.default", "attention"),
    ("aten.convolution_backward.default", "conv"), ("aten.add.Tensor", "elementwise"),
    ("aten.native_layer_norm_backward.default", "norm"), ("aten._softmax.default", "softmax"),
    ("aten.sum.dim_IntList", "reduction"), ("aten.embedding_dense_backward.default", "embedding"),
    ("aten.nll_loss_forward.default", "loss"), ("onnx.MatMul", "gemm"),
    ("onnx.Softmax.backward", "softmax"), ("onnx.aten.bmm", "bgemm"),
])
def test_op_class(target, cls):
    assert op_class(target) == cls


def _mm_profile(env: dict, dtype: str = "float32"):
    b = ProfileBuilder()
    x = b.add_tensor("x", "input", (N, N), dtype)
    w = b.add_tensor("w", "parameter", (N, N), dtype)
    y = b.add_tensor("y", "activation", (N, N), dtype)
    g = b.add_tensor("g", "gradient", (N, N), dtype)
    b.add_op("mm", "aten.mm.default", "forward", (x, w), (y,), flops=GEMM_FLOPS,
             bytes=3 * N * N * 4)
    b.add_op("mm_bwd", "aten.mm.default", "backward", (y, w), (g,), flops=GEMM_FLOPS,
             bytes=3 * N * N * 4)
    return b.build(env=env)


def test_profile_precision_decides_fp32_matmuls():
    off = price_profile(_mm_profile({"float32_matmul": {"allow_tf32": False,
                                                        "precision": "highest"}}), A100, HALF)
    high = price_profile(_mm_profile({"float32_matmul": {"allow_tf32": False,
                                                         "precision": "high"}}), A100, HALF)
    assert Precision.from_env(high.env).tf32_matmul and not Precision.from_env(off.env).tf32_matmul
    assert off.ops[0].time_us - 3 == pytest.approx(GEMM_FLOPS / (19.5e12 * 0.5 * 1024 / 1080) * 1e6)
    assert high.ops[0].time_us - 3 == pytest.approx(GEMM_FLOPS / (156e12 * 0.811) * 1e6)
    assert high.summary["forward_us"] == pytest.approx(high.ops[0].time_us)
    assert high.env["cost_model"] == HALF.identity and high.env["hardware"] == A100.to_dict()


def test_fake_profile_records_the_precision_and_the_cost_model():
    torch = pytest.importorskip("torch")
    from slackswap_cli.trace import float32_matmul
    rec = float32_matmul()
    assert rec == {"allow_tf32": torch.backends.cuda.matmul.allow_tf32,
                   "precision": torch.get_float32_matmul_precision(),
                   "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32}


def _priced_elsewhere(tmp_path, identity) -> Path:
    prof = price_profile(_mm_profile({}), A100)
    prof = dataclasses.replace(prof, env=dict(prof.env, cost_model=identity))
    path = tmp_path / "old.profile.json"
    schema.save(prof, path)
    return path


@pytest.mark.parametrize("identity", [{"name": "roofline-by-class", "digest": "000000000000"},
                                      None])
def test_plan_refuses_a_profile_priced_by_other_constants(tmp_path, identity):
    path = _priced_elsewhere(tmp_path, identity)
    with pytest.raises(InputError, match="must not mix"):
        check_cost_model(schema.load_profile(path), "old")
    out = tmp_path / "p.json"
    r = CliRunner().invoke(app, ["plan", str(path), "--budget", "0.5", "-o", str(out)])
    assert_clean_error(r, 2, "must not mix")
    assert "slackswap profile" in r.stderr and not out.exists()


def test_plan_takes_a_profile_priced_by_this_slackswap(tmp_path):
    path = _priced_elsewhere(tmp_path, default_cost_model().identity)
    check_cost_model(schema.load_profile(path))   # no error
    out = tmp_path / "p.json"
    r = CliRunner().invoke(app, ["plan", str(path), "--budget", "0.9", "-o", str(out)])
    assert r.exit_code in (0, 4), r.stderr
    assert out.exists()


def _fit_costs():
    return load_benchmark("fit_costs", on_path=True)


def test_fit_script_reproduces_the_committed_constants():
    fc = _fit_costs()
    assert fc.DATA.is_relative_to(ROOT)    # the data in the repo, not ../shared
    fitted = fc.fit_all()
    committed = json.loads(COSTS_FILE.read_text())
    assert fitted == committed
    assert committed["fitted_from"] and all((ROOT / f).exists() for f in committed["fitted_from"])
    # and the fit moves with its data: without the L4 the constants differ, and the L4's
    # board-power limit is still learnt (from the T4's GEMMs): a knee above the L4's 72 W and
    # under the 250 W of the V100 and A100 40GB PCIe, whose GEMMs run at their boost clock
    steps, profiles = fc.load_steps(), fc.load_profiles()
    without = fc.fit(steps, profiles, [g for g in fc.GPUS if g != "NVIDIA_L4"], fc.gemm_rows())
    assert without != {k: committed[k] for k in without}
    assert 72 < without["fp32_power_knee_w"] < 250


def test_each_per_op_file_times_an_empty_node_at_6_to_13_us():
    import csv
    fc = _fit_costs()
    files = sorted((fc.DATA / "labels").glob("*/*-train-*.csv"))
    harness = [fc.harness_ms(list(csv.DictReader(f.open()))) for f in files]
    assert len(files) == 22 and all(0.006 <= h <= 0.013 for h in harness), harness


def test_the_steps_left_out_of_the_whole_step_fit_are_the_mistimed_a100_ones():
    fc = _fit_costs()
    left = sorted(f"{s['gpu']} {s['model']}-{s['seq']}-{s['batch']}"
                  for s in fc.load_steps() if not fc.consistent(s))
    assert left == ["NVIDIA_A100_80GB_PCIe " + k for k in (
        "bert_large-512-2", "bert_large-512-8", "gpt2_large-1024-1", "gpt3_27-2048-1",
        "opt_13-2048-2")]


def test_sustained_fraction_scales_bf16_tensor_core_compute_only_by_hand():
    # A100 80GB PCIe at a fraction of 0.5 against 1: bf16/fp16 GEMM, batched GEMM, attention
    # (forward and backward kernels) and convolution compute take twice as long
    one, half = (dataclasses.replace(A100, bf16_sustained_fraction=f) for f in (1.0, 0.5))
    for cls in ("gemm", "bgemm", "attention", "conv"):
        for dtype in ("bfloat16", "float16"):
            for backward in (False, True):
                t1, t2 = (op_time_us(hw, HALF, cls, dtype, GEMM_FLOPS, 0, backward=backward) - 3
                          for hw in (one, half))
                assert t2 == pytest.approx(2 * t1, rel=1e-12)
    assert op_time_us(one, HALF, "gemm", "bfloat16", GEMM_FLOPS, 0) == pytest.approx(
        GEMM_FLOPS / (312e12 * 0.811) * 1e6 + 3)
    # untouched: fp32 (FMA units, and TF32), fp8, memory-bound ops, and a GEMM whose bytes
    # outlast its compute (1e12 bytes at 1935 GB/s x 0.5 against 1e6 FLOPs)
    same = [("gemm", "float32", Precision(), GEMM_FLOPS, 0),
            ("gemm", "float32", Precision(tf32_matmul=True), GEMM_FLOPS, 0),
            ("conv", "float32", Precision(tf32_conv=True), GEMM_FLOPS, 0),
            ("attention", "float32", Precision(), GEMM_FLOPS, 0),
            ("gemm", "float8_e4m3fn", Precision(), GEMM_FLOPS, 0),
            ("elementwise", "bfloat16", Precision(), 0, 1e9),
            ("norm", "bfloat16", Precision(), 0, 1e9),
            ("gemm", "bfloat16", Precision(), 1e6, 1e12)]
    for cls, dtype, prec, flops, nbytes in same:
        assert op_time_us(one, HALF, cls, dtype, flops, nbytes, prec, (N, N)) == \
            op_time_us(half, HALF, cls, dtype, flops, nbytes, prec, (N, N))


def test_sustained_fraction_is_on_the_presets_with_best_case_figures():
    # the presets whose tensor-core fractions are the [EFF] / [ATTN] best-case figures carry
    # the fitted fraction; the others (guessed 0.72-0.75) keep 1
    fitted = {"a100-pcie4", "h100-pcie5", "h200-pcie5", "gh200-c2c", "a100-80gb-pcie",
              "a100-40gb-pcie", "a100-40gb-sxm", "h100-sxm", "h100-sxm-96gb"}
    assert {n for n, hw in PRESETS.items() if hw.bf16_sustained_fraction != 1.0} == fitted
    assert {PRESETS[n].bf16_sustained_fraction for n in fitted} == {BF16_SUSTAINED_FRACTION}
    assert 0.5 < BF16_SUSTAINED_FRACTION < 1.0
