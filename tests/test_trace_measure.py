"""Measured profiles (--device cpu): every op timed, the whole step timed, real storages
confirming the aliases found from the trace."""
from pathlib import Path

import pytest
import torch

from slackswap_cli.hardware import PRESETS
from slackswap_cli.trace import profile_workload
from slackswap_cli.trace.graph_profile import joint_to_profile
from slackswap_cli.trace.joint import capture_joint
from slackswap_cli.trace.measure import measure_joint
from slackswap_cli.trace.workload import load_workload

TINY_GPT = Path(__file__).resolve().parent.parent / "examples" / "tiny_gpt.py"
ARGS = {"n_layer": 1, "d_model": 32, "n_head": 2, "seq": 16, "batch": 2}


def test_cpu_profile_is_measured():
    prof = profile_workload(TINY_GPT, args=ARGS, device="cpu", hardware=PRESETS["a100-pcie4"])
    assert prof.env["device"] == "cpu" and prof.env["hardware"] is None
    assert all(o.time_source == "measured" and o.time_us >= 0 for o in prof.ops)
    s = prof.summary
    assert s["time_source"] == "measured"
    assert s["measured_step_us"] > 0 and s["op_sum_us"] > 0
    assert s["op_sum_us"] == pytest.approx(sum(o.time_us for o in prof.ops))
    assert s["forward_us"] + s["backward_us"] == pytest.approx(s["op_sum_us"])
    # a matmul does work; at least most ops register a nonzero time on a wall clock
    assert sum(o.time_us > 0 for o in prof.ops) > len(prof.ops) // 2


def test_real_storages_confirm_the_traced_aliases():
    work = load_workload(TINY_GPT, args=ARGS)
    joint = capture_joint(work.model, work.inputs)
    m = measure_joint(joint, work.model, work.inputs, device=torch.device("cpu"),
                      warmup=1, repeats=1)
    hw = PRESETS["a100-pcie4"]
    from_trace = joint_to_profile(joint, workload={}, env={}, hardware=hw)
    from_run = joint_to_profile(joint, workload={}, env={}, hardware=hw,
                                storage_keys=m["storage_keys"])
    assert [t.alias_of for t in from_run.tensors] == [t.alias_of for t in from_trace.tensors]
    assert sum(t.alias_of is not None for t in from_run.tensors) > 20   # views are everywhere
    assert from_run.summary["saved_bytes"] == from_trace.summary["saved_bytes"]
    # every timed op of the graph has a time
    names = {o.name for o in from_trace.ops}
    assert set(m["op_times_us"]) == names


def test_a_step_that_does_not_fit_points_to_fake_tensors(monkeypatch):
    # measuring runs the real step: out of memory there is a clear error, not a crash report
    import slackswap_cli.trace.measure as measure
    from slackswap_cli.errors import TraceError

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(measure, "measure_joint", oom)
    examples = Path(__file__).resolve().parent.parent / "examples"
    with pytest.raises(TraceError, match="does not fit in cpu memory") as exc:
        profile_workload(examples / "tiny_gpt.py", args={"n_layer": 1, "d_model": 32, "n_head": 2,
                                                         "seq": 8, "batch": 1},
                         device="cpu", hardware=PRESETS["a100-pcie4"])
    assert "--device fake" in exc.value.hint
