"""Op costs for KiB-sized models: 2 us a kernel and 85% of HBM for every class (the cost
model before the constants of slackswap_cli/op_costs.json were fitted).

At a fitted ~10 us a kernel (what op_costs.json held before its GEMMs were priced per GPU
class) an 8 us copy of a tiny tensor beats recomputing it, and the plans of the tests' and
the zoo's small models swap all they do not keep: the recompute path (chains, in-place
writes, the SAC policy) would go untested. Tests (helpers.two_us_kernels) and
benchmarks/zoo.py price their small models with this model instead, so that their plans
recompute as well as swap, as a real model's plan does on the fitted costs; only the fp32
GEMM constants come from the fit (which gives 2 us a kernel now, and other memory
efficiencies).
"""
from __future__ import annotations

import contextlib
import dataclasses

from slackswap_cli import op_cost

DIGEST = "small-models-2us-kernels"


def two_us_kernel_model() -> op_cost.CostModel:
    base = op_cost.default_cost_model()
    return dataclasses.replace(base, kernel_overhead_us=2.0, digest=DIGEST,
                               memory_efficiency=dict.fromkeys(base.memory_efficiency, 0.85))


@contextlib.contextmanager
def small_model_costs():
    """`op_cost.default_cost_model` returns `two_us_kernel_model()` inside the block."""
    model, before = two_us_kernel_model(), op_cost.default_cost_model
    op_cost.default_cost_model = lambda: model
    try:
        yield model
    finally:
        op_cost.default_cost_model = before
