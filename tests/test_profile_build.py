import dataclasses

import pytest

from slackswap_cli.hardware import PRESETS
from slackswap_cli.op_cost import default_cost_model, op_class, op_dtype, op_shape, op_time_us
from slackswap_cli.profile_build import ProfileBuilder, recost
from slackswap_cli.schema import Profile
from slackswap_testkit.synthetic import chain_profile


def test_keep_all_liveness_by_hand():
    # chain of 3: a_i lives from f_i to b_i. Ops: f0 f1 f2 loss b2 b1 b0.
    # live while each op runs: f0:a0, f1:a0+a1, f2:+a2, loss: 3 acts + loss scalar,
    # b2: a0+a1+a2 (loss died at its producer's end: nobody reads it), b1: a0+a1, b0: a0
    p = chain_profile(3, act_bytes=[100, 200, 400])
    assert list(p.live_bytes_per_op) == [100, 300, 700, 704, 700, 300, 100]
    assert p.keep_all_peak_bytes == 704 == p.summary["peak_activation_bytes"]


def test_alias_counts_once_and_extends_its_root():
    b = ProfileBuilder()
    x = b.add_tensor("x", "input", (4,), "float32")
    a = b.add_tensor("a", "activation", (256,), "float32")          # 1 KiB
    v = b.add_tensor("v", "activation", (16, 16), "float32", alias_of=a)
    out = b.add_tensor("out", "activation", (), "float32")
    g = b.add_tensor("g", "gradient", (4,), "float32")
    b.add_op("f", "aten.relu.default", "forward", (x,), (a,))
    b.add_op("view", "aten.view.default", "forward", (a,), (v,))
    b.add_op("loss", "aten.sum.default", "forward", (v,), (out,))
    b.add_op("bwd", "aten.threshold_backward.default", "backward", (v,), (g,))
    p = b.build()
    assert p.tensors[v].alias_of == a and p.tensors[v].saved
    assert p.tensors[a].saved  # saved through its view
    assert [t.id for t in p.saved_activations] == [a]
    assert p.last_use[a] == 3  # the view's backward reader keeps the root alive
    assert p.summary["saved_bytes"] == 1024
    assert list(p.live_bytes_per_op) == [1024, 1024, 1028, 1024]


def test_recost_retimes_roofline_ops_only():
    p = chain_profile(2)
    # synthetic ops carry no FLOPs/bytes: give them some and mark the source
    ops = tuple(dataclasses.replace(o, flops=2 * 10**12, bytes=10**9) for o in p.ops)
    p = dataclasses.replace(p, ops=ops, env={"hardware": "a100-pcie4"})
    h100 = PRESETS["h100-pcie5"]
    q = recost(p, h100)
    assert q.fingerprint == p.fingerprint and q.env["hardware"] == h100.to_dict()
    # priced by the cost model (tests/test_op_cost.py checks its figures by hand)
    op = q.ops[0]
    assert op.time_us == pytest.approx(op_time_us(
        h100, default_cost_model(), op_class(op.target), op_dtype(q, op), 2 * 10**12, 10**9,
        out_shape=op_shape(q, op)))
    assert q.env["cost_model"] == default_cost_model().identity
    assert q.summary["forward_us"] == pytest.approx(sum(o.time_us for o in q.ops[:p.n_forward]))
    assert recost(q, h100) is q                       # already costed there
    measured = dataclasses.replace(p, ops=tuple(dataclasses.replace(o, time_source="measured")
                                                for o in p.ops))
    assert recost(measured, h100) is measured         # measured times are never rewritten


def _attention_step(target: str, shape) -> "Profile":
    """x -> scores (softmax or not) -> out; backward reads the scores."""
    b = ProfileBuilder()
    x = b.add_tensor("x", "input", (2, 256, 64), "bfloat16")
    s = b.add_tensor("scores", "activation", shape, "bfloat16")
    o = b.add_tensor("out", "activation", (2, 256, 64), "bfloat16")
    g = b.add_tensor("g", "gradient", (2, 256, 64), "bfloat16")
    b.add_op("attn", target, "forward", [x], [s])
    b.add_op("pv", "aten.bmm.default", "forward", [s], [o])
    b.add_op("pv_bwd", "aten.bmm.default", "backward", [s, o], [g])
    return b.build()


def test_attention_warning_names_saved_seq_by_seq_softmax():
    from slackswap_cli.profile_build import attention_warning
    w = attention_warning(_attention_step("aten._safe_softmax.default", (2, 12, 256, 256)))
    assert w is not None and "256x256 attention matrices" in w and "scores 2x12x256x256" in w
    assert "attn_pdrop=0.0" in w
    # a mask over one head, a non-softmax square, a short sequence: no warning
    assert attention_warning(_attention_step("aten.where.self", (2, 12, 256, 256))) is None
    assert attention_warning(_attention_step("aten._softmax.default", (2, 1, 256, 256))) is None
    assert attention_warning(_attention_step("aten._softmax.default", (2, 12, 64, 64))) is None
