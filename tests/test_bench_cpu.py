"""The CPU step-time benchmarks (benchmarks/vs_torch_compile_cpu.py, fidelity.py --step-time):
their helpers, the ablation's patch of torch restored, and a smoke run of fidelity's step-time
section (the head-to-head itself compiles ten graphs a model: run it as a benchmark)."""
from pathlib import Path

import pytest
from helpers import load_benchmark

ROOT = Path(__file__).resolve().parents[1]


def _load(name):
    return load_benchmark(name, on_path=True)


def test_paired_rounds_rotate_and_ratios_are_per_round():
    ct = _load("cpu_timing")
    calls = []
    times = ct.paired({"a": lambda: calls.append("a"), "b": lambda: calls.append("b"),
                       "c": lambda: calls.append("c")}, rounds=3, warmup=1)
    assert [len(v) for v in times.values()] == [3, 3, 3]
    assert calls == list("abc" "bca" "cab" "abc")      # every fn once a round, order rotated
    s = ct.ratio_stats([2.0, 3.0, 4.0, 10.0], [1.0, 1.0, 2.0, 2.0])
    assert s["median"] == 2.5 and s["q1"] <= s["median"] <= s["q3"] and s["rounds"] == 4


def test_cpu_hardware_file_swaps_nothing_worth_it():
    ct = _load("cpu_timing")
    from slackswap_cli.hardware import HardwareSpec
    hw = ct.cpu_hardware()
    assert HardwareSpec.from_dict(hw.to_dict()) == hw            # a valid hardware file
    assert hw.h2d_bytes_per_s == hw.d2h_bytes_per_s == 1e3       # the least one allows
    assert hw.copy_us(4096, "d2h") > 1e6                        # a 4 KiB copy: over a second


def test_flash_attention_ablation_is_undone():
    import torch
    from torch._functorch import partitioners
    from torch.utils import flop_counter
    vs = _load("vs_torch_compile_cpu")
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    original = partitioners.get_default_op_list
    # torch 2.13 and 2.14 have no FLOP formula for the CPU kernel; 2.15 has one (the CUDA
    # kernel's `sdpa_flop`): the ablation sets CUDA flash attention's while it runs, then
    # removes it or puts torch's own back
    formula = flop_counter.flop_registry.get(op)
    cuda_formula = flop_counter.flop_registry[torch.ops.aten._scaled_dot_product_flash_attention]
    assert op not in original().compute_intensive_ops
    with vs.flash_cpu_expensive():
        assert op in partitioners.get_default_op_list().compute_intensive_ops
        assert flop_counter.flop_registry[op] is cuda_formula
    assert partitioners.get_default_op_list is original
    assert op not in original().compute_intensive_ops
    assert flop_counter.flop_registry.get(op) is formula


def test_fidelity_keeps_its_memory_section():
    fid = _load("fidelity")
    memory = "# Memory fidelity\n\n| a | b |\n"
    res = {"quick": True, "torch": "x", "rounds": 3, "hardware": {"name": "cpu"},
           "models": [{"model": "m", "args": {}, "n_ops": 1, "eager_step_ms": 1.0,
                       "profile_op_sum_ms": 1.0, "rows": [
                           {"budget_fraction": 0.5, "recomputed": 1, "predicted_slowdown": 1.1,
                            "measured_slowdown": {"median": 1.08, "q1": 1.0, "q3": 1.2},
                            "predicted_extra_ms": 0.1, "measured_extra_ms": 0.08,
                            "unexplained_us_per_forward_op": 0.0}]}]}
    both = memory + fid.step_time_md(res)
    assert fid._memory_md(both) == memory and "| m | 0.5 | 1 | 1.100 |" in both


@pytest.mark.slow
def test_fidelity_step_time_quick_run(tmp_path):
    import json
    fid = _load("fidelity")
    assert fid.main(["--step-time", "--quick", "--models", "tiny-gpt",
                     "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "fidelity.json").read_text())["step_time"]
    row = data["models"][0]["rows"][0]
    assert row["swapped"] == 0 and row["predicted_slowdown"] >= 1.0
    assert row["measured_slowdown"]["q1"] <= row["measured_slowdown"]["median"]
    assert "## Step time" in (tmp_path / "fidelity.md").read_text()
