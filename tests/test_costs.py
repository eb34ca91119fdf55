"""Op costs worked out by hand: FLOPs, bytes and roofline time of single ops."""
import pytest
import torch
import torch.nn.functional as F

from slackswap_cli.hardware import PRESETS
from slackswap_cli.trace.graph_profile import joint_to_profile
from slackswap_cli.trace.joint import capture_joint

HW = PRESETS["a100-pcie4"]


def build(model, inputs, loss_fn=None):
    return joint_to_profile(capture_joint(model, inputs, loss_fn), workload={}, env={},
                            hardware=HW)


def ops_of(prof, target, phase="forward"):
    return [o for o in prof.ops if o.target == target and o.phase == phase]


def test_linear_roofline_by_hand():
    m, k, n = 64, 256, 512
    prof = build(torch.nn.Linear(k, n, bias=False), (torch.randn(m, k),),
                 lambda out, inputs: out.sum())
    (mm,) = ops_of(prof, "aten.mm.default")
    flops = 2 * m * n * k
    bytes_moved = 4 * (m * k + k * n + m * n)        # read x and w (through its view), write y
    assert mm.flops == flops
    assert mm.bytes == bytes_moved
    compute_us = flops / (312e12 * 0.869) * 1e6
    memory_us = bytes_moved / (2039e9 * 0.85) * 1e6
    assert mm.time_us == pytest.approx(max(compute_us, memory_us) + HW.kernel_overhead_us)
    # the weight's transpose is a view: no bytes, no time
    (t,) = ops_of(prof, "aten.t.default")
    assert t.flops == 0 and t.bytes == 0 and t.time_us == 0.0
    # backward: the weight gradient is (n, m) @ (m, k)
    (mm_b,) = ops_of(prof, "aten.mm.default", "backward")
    assert mm_b.flops == flops


def test_memory_bound_ops_are_not_free():
    n = 1 << 16

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(n))

        def forward(self, x):
            return F.layer_norm(torch.relu(x * self.w), (n,)).sum()

    prof = build(M(), (torch.randn(1, n),))
    (relu,) = ops_of(prof, "aten.relu.default")
    assert relu.flops == 0 and relu.bytes == 2 * 4 * n     # read n floats, write n floats
    assert relu.time_us == pytest.approx(2 * 4 * n / (2039e9 * 0.85) * 1e6 + 2.0)
    (norm,) = ops_of(prof, "aten.native_layer_norm.default")
    assert norm.time_us > HW.kernel_overhead_us
    (tb,) = ops_of(prof, "aten.threshold_backward.default", "backward")
    assert tb.time_us > HW.kernel_overhead_us


def test_flash_attention_flops_by_hand_and_causal_half():
    b, h, s, d = 2, 4, 128, 32

    class Attn(torch.nn.Module):
        def __init__(self, causal):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(d))
            self.causal = causal

        def forward(self, q):
            q = q * self.w
            return F.scaled_dot_product_attention(q, q, q, is_causal=self.causal).sum()

    x = torch.randn(b, h, s, d)
    full = build(Attn(False), (x,))
    causal = build(Attn(True), (x,))
    fwd = "aten._scaled_dot_product_flash_attention_for_cpu.default"
    bwd = "aten._scaled_dot_product_flash_attention_for_cpu_backward.default"
    # forward: scores q k^T and weights @ v, 2 b h s s d each
    assert ops_of(full, fwd)[0].flops == 4 * b * h * s * s * d
    # backward: five matmuls of that size (flash recomputes the scores, then dv, dp, dq, dk)
    assert ops_of(full, bwd, "backward")[0].flops == 10 * b * h * s * s * d
    # a causal kernel skips the blocks above the diagonal
    assert ops_of(causal, fwd)[0].flops == 2 * b * h * s * s * d
    assert ops_of(causal, bwd, "backward")[0].flops == 5 * b * h * s * s * d


def test_allocation_alone_costs_nothing_and_in_place_writes_count():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(1000))

        def forward(self, x):
            return F.dropout(x * self.w, 0.5, True).sum()

    prof = build(M(), (torch.randn(1000),))
    (empty,) = ops_of(prof, "aten.empty_like.default")
    assert empty.bytes == 0 and empty.time_us == 0.0
    (bern,) = ops_of(prof, "aten.bernoulli_.float")
    assert bern.bytes == 2 * 4 * 1000                      # reads and writes its buffer in place
    assert bern.time_us > 0
