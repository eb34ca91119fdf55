"""benchmarks/published_runs.py's FSDP arithmetic, checked by hand and against the model it
describes (the benchmark itself traces eight profiles: run it as a benchmark)."""
from pathlib import Path

import pytest
from helpers import load_benchmark

ROOT = Path(__file__).resolve().parents[1]


def _load():
    return load_benchmark("published_runs")


@pytest.mark.parametrize("size", ["8b", "70b", "llama2-13b", "llama2-70b"])
def test_block_and_root_parameters_are_the_models(size):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig
    pr = _load()
    layers, hidden, kv, mlp, vocab = pr.SIZES[size]
    heads = hidden // 128
    config = LlamaConfig(num_hidden_layers=2, hidden_size=hidden, num_attention_heads=heads,
                         num_key_value_heads=kv // 128, intermediate_size=mlp, vocab_size=vocab)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    block, root = pr.block_params(size)
    per_block = sum(p.numel() for p in model.model.layers[0].parameters())
    assert per_block == block
    assert sum(p.numel() for p in model.parameters()) == 2 * block + root
    if size == "8b":    # Llama 3.1 8B: 8,030,261,248 parameters
        assert layers * block + root == 8_030_261_248


def test_static_memory_and_exposed_communication_by_hand():
    pr = _load()
    run = pr.RUNS[0]                                    # 8B on 8 GPUs over NVLink
    block, root = pr.block_params("8b")
    st = pr.static_bytes(run)
    assert st["sharded"] == -(-16 * (32 * block + root) // 8)
    assert st["unsharded"] == 2 * (2 * block + root)
    rate = 450e9 * 0.8 / 1e6                            # bytes per us
    ag, rs = 2 * block * 7 / 8 / rate, 4 * block * 7 / 8 / rate
    ag_root, rs_root = 2 * root * 7 / 8 / rate, 4 * root * 7 / 8 / rate
    # blocks slower than their communication: only the first gather, the last reduce-scatter
    # and the root's are exposed
    slow = {"fwd_block_us": 1e9, "bwd_block_us": 1e9, "fwd_us": 0.0, "bwd_us": 0.0}
    exposed, total = pr.exposed_comm_us(run, slow, 0.0)
    assert exposed == pytest.approx(ag_root + rs_root + ag + rs)
    # the last block stays gathered from forward into backward (torchtitan does not reshard it)
    assert total == pytest.approx(ag_root + rs_root + 63 * ag + 32 * rs)
    # blocks that take no time: everything is exposed
    idle = {"fwd_block_us": 0.0, "bwd_block_us": 0.0, "fwd_us": 0.0, "bwd_us": 0.0}
    assert pr.exposed_comm_us(run, idle, 0.0)[0] == pytest.approx(total)


def test_inter_host_rings_use_every_nic_of_the_host():
    # 128 GPUs, 400 Gb/s (50 GB/s) a GPU: a ring's bus bandwidth is the host's eight NICs
    pr = _load()
    run = pr.RUNS[1]
    assert run.link == "rdma400" and pr.LINKS["rdma400"][0] == 8 * 50.0
    block, root = pr.block_params("8b")
    rate = 400e9 * 0.8 / 1e6
    slow = {"fwd_block_us": 1e9, "bwd_block_us": 1e9, "fwd_us": 0.0, "bwd_us": 0.0}
    _, total = pr.exposed_comm_us(run, slow, 0.0)
    share = 127 / 128
    assert total == pytest.approx((2 * root + 4 * root + 63 * 2 * block + 32 * 4 * block)
                                  * share / rate)


def test_fsdp_copies_and_stream_pools_by_hand():
    pr = _load()
    from slackswap_cli.hardware import PRESETS
    from slackswap_cli.op_cost import default_cost_model
    run = pr.RUNS[0]                                    # 8B on 8 H100s: 32 blocks
    block, root = pr.block_params("8b")
    hw, model = PRESETS[run.hardware], default_cost_model()
    # every copy is far above the L2: HBM at the fitted elementwise efficiency, plus a kernel
    rate = hw.hbm_bytes_per_s * model.memory_efficiency["elementwise"] / 1e6  # bytes per us
    copy_out = [4 * block] * 63 + [4 * root]            # each block gathered twice but the last
    copy_in = [6 * block] * 32 + [6 * root]             # one fp32 reduce-scatter input each
    want = sum(b / rate + model.kernel_overhead_us for b in copy_out + copy_in)
    assert pr.fsdp_copy_us(run) == pytest.approx(want)
    # the side streams keep the root's bf16 all-gather output and fp32 reduce-scatter input
    st = pr.static_bytes(run)
    assert st["stream_pools"] == 6 * root == 6 * (2 * 128256 * 4096 + 4096)


def test_overlap_slowdown_charges_the_hidden_communication_by_hand():
    pr = _load()
    run = pr.RUNS[0]
    slow = {"fwd_block_us": 1e9, "bwd_block_us": 1e9, "fwd_us": 0.0, "bwd_us": 0.0}
    c = pr.comm_us(run, slow, 0.0)
    exposed, total = pr.exposed_comm_us(run, slow, 0.0)
    assert (c["exposed"], c["total"]) == (exposed, total)
    # compute at 1 / 1.189 of its speed for the hidden part's duration
    assert c["slowdown"] == pytest.approx((total - exposed) * 0.189 / 1.189)
    assert c["charged"] == pytest.approx(exposed + c["slowdown"])
    # nothing hidden (blocks that take no time): nothing slowed
    idle = {"fwd_block_us": 0.0, "bwd_block_us": 0.0, "fwd_us": 0.0, "bwd_us": 0.0}
    assert pr.comm_us(run, idle, 0.0)["slowdown"] == pytest.approx(0.0)


def test_the_committed_fraction_is_what_the_committed_run_fitted():
    # benchmarks/results/published_runs.json is written by the script from the runs'
    # uncalibrated predictions; the presets ship the fraction it fitted, to its 3 places
    import json

    from slackswap_cli.hardware import BF16_SUSTAINED_FRACTION
    cal = json.loads((ROOT / "benchmarks" / "results" / "published_runs.json").read_text())[
        "calibration"]
    assert cal["fitted_fraction"] == round(BF16_SUSTAINED_FRACTION, 3)
    assert cal["committed_fraction"] == BF16_SUSTAINED_FRACTION
    pr = _load()
    assert set(cal["uncalibrated"]) == {r.name for r in pr.RUNS}


def test_fit_and_leaving_out_by_hand():
    # predictions proportional to f: the least-squares fit of log errors is the geometric mean
    # of measured / predicted-at-1
    from benchmarks.bf16_fit import fit_fraction, leave_kind_out, leave_one_out
    at_one = {"a": 1000.0, "b": 1000.0, "c": 2000.0}
    measured = {"a": 800.0, "b": 900.0, "c": 1800.0}

    def predict(run, f):
        return at_one[run] * f
    assert fit_fraction(measured, predict) == round((0.8 * 0.9 * 0.9) ** (1 / 3), 3)  # 0.865
    loo = leave_one_out(measured, predict)
    assert loo["a"] == (0.9, pytest.approx(0.9 * 1000 / 800 - 1))                   # +12.5%
    assert loo["b"][0] == round((0.8 * 0.9) ** 0.5, 3)                              # 0.849
    kind = {"a": "X", "b": "Y", "c": "Y"}
    out = leave_kind_out(measured, kind, predict)
    assert out["X"][0] == 0.9 and out["X"][1] == {"a": pytest.approx(0.125)}
    assert out["Y"][0] == 0.8 and out["Y"][1]["c"] == pytest.approx(1600 / 1800 - 1)
    # the fit stays within its bounds
    assert fit_fraction({"a": 100.0}, predict) == 0.5
