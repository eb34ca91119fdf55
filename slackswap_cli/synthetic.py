"""Synthetic profiles whose answers can be worked out by hand (tests, docs, benchmarks).

`chain_profile(n)` is an n-layer chain: forward op f_i reads a_{i-1} (a_{-1} is the input) and
writes activation a_i; a loss op reads a_{n-1}; backward op b_i reads the incoming gradient and
a_i, and writes the gradient g_i for the layer below, plus the parameter gradient of w_i. Every
a_i is saved (read by b_i) and lives from f_i to b_i.
"""
from __future__ import annotations

from typing import Sequence

from .profile_build import ProfileBuilder
from .schema import Profile


def chain_profile(n: int = 4, act_bytes: int | Sequence[int] = 1 << 20,
                  fwd_us: float | Sequence[float] = 100.0,
                  bwd_us: float | Sequence[float] | None = None,
                  grad_bytes: int | None = 0, random_layers: Sequence[int] = (),
                  name: str = "chain") -> Profile:
    """`grad_bytes=0` makes backward gradients free (so only saved activations count).

    `bwd_us` defaults to twice `fwd_us`. Layers in `random_layers` are dropout-like: their
    output is not recomputable.
    """
    def seq(x, default=None):
        if x is None:
            x = default
        return list(x) if isinstance(x, (list, tuple)) else [x] * n

    acts, fwd, bwd = seq(act_bytes), seq(fwd_us), seq(bwd_us, [2 * f for f in seq(fwd_us)])
    b = ProfileBuilder()
    x = b.add_tensor("x", "input", (1,), "float32", size_bytes=4)
    ws = [b.add_tensor(f"w{i}", "parameter", (1,), "float32", size_bytes=4) for i in range(n)]
    prev = x
    a = []
    for i in range(n):
        t = b.add_tensor(f"a{i}", "activation", (acts[i],), "uint8", size_bytes=acts[i],
                         recomputable=i not in random_layers)
        b.add_op(f"f{i}", "aten.mm.default" if i not in random_layers else "aten.native_dropout.default",
                 "forward", (prev, ws[i]), (t,), module=f"layers.{i}", time_us=fwd[i])
        a.append(t)
        prev = t
    loss = b.add_tensor("loss", "activation", (), "float32", size_bytes=4)
    b.add_op("loss", "aten.sum.default", "forward", (prev,), (loss,), module="", time_us=0.0)
    g = b.add_tensor("tangent", "input", (), "float32", size_bytes=4)  # d loss / d loss = 1
    for i in reversed(range(n)):
        gw = b.add_tensor(f"grad_w{i}", "gradient", (1,), "float32", size_bytes=4)
        outs = [gw]
        if i > 0:
            gi = b.add_tensor(f"g{i}", "activation", (grad_bytes,), "uint8", size_bytes=grad_bytes)
            outs.insert(0, gi)
        b.add_op(f"b{i}", "aten.mm.default", "backward", (g, a[i]), outs, module=f"layers.{i}",
                 time_us=bwd[i])
        if i > 0:
            g = outs[0]
    return b.build(workload={"name": name, "args": {"n": n}}, env={"device": "synthetic"})
