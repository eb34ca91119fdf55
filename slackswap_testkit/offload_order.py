"""The synchronization torch's asynchronous offload ops give the compiled path, checked on the
graphs on the CPU: `compile_planned` on CUDA has torch insert `ao.offload` / `ao.reload`, each
paired with an `ao.wait_tensor` (torch/_functorch/_activation_offloading/offload_ops.py), which
carry every synchronization inside them: the transfer stream waits for the compute stream
before each copy, records an event after it; `wait_tensor` makes the compute stream wait on
that event and then frees its `keepalive` (the device source of an offload, with
its storage resized to 0 bytes; the host buffer of a reload, into torch's pinned pool when that is on).
D2H and H2D copies share one transfer stream, so a reload follows its offload in order.

What the graphs must then hold, and `check` tests: each offload's wait keeps the offloaded
value alive (`keepalive` is it) and nothing reads that value after the wait (its storage is
gone), or, for a value that is also a model output, keeps nothing alive (the output does); each reload's value is read only through its wait, whose `keepalive` is the host value,
and nothing reads the host value after the wait. `captured` runs `compile_planned` on the CPU
(synchronous `device_put`, as there) while applying torch's CUDA insertion to copies of the
same graphs, for `check` to read; all but its prefetch pass
(`activation_reload_prefetch_async` times nodes on the GPU: it moves reloads earlier and leaves
their waits where they are, which the rules above do not depend on).
"""
from __future__ import annotations

import contextlib
import copy

import torch


def _is(node, op) -> bool:
    return node.op == "call_function" and node.target == op


def check(fw, bw) -> dict:
    """What torch's CUDA offload insertion made of graphs `fw`, `bw` (GraphModules): counts,
    the offload waits sunk to the end of forward (their source held on the device until the
    forward returns), and every broken rule, named."""
    ao = torch.ops.ao
    out = {"offloads": 0, "reloads": 0, "sunk_waits": 0, "problems": []}
    order = {n: i for i, n in enumerate(fw.graph.nodes)}
    output = fw.graph.find_nodes(op="output")[0]
    for n in fw.graph.nodes:
        if not _is(n, ao.offload.default):
            continue
        out["offloads"] += 1
        src = n.args[0]
        waits = [u for u in n.users if _is(u, ao.wait_tensor.default)]
        keep = waits[0].args[1] if len(waits) == 1 and len(waits[0].args) > 1 else None
        # a model output needs no keepalive (it lives on as the output): offload.keep_outputs
        if len(waits) != 1 or (keep is not src and not (keep is None and output in src.users)):
            out["problems"].append(f"{n.name}: no wait keeping {src.name} alive")
            continue
        w = waits[0]
        if w.next is output or _is(w.next, ao.wait_tensor.default):
            out["sunk_waits"] += 1
        if keep is None:
            continue
        late = [u.name for u in src.users if u is not w and order[u] > order[w]]
        if late:
            out["problems"].append(f"{src.name} is read after its offload's wait freed it "
                                   f"(by {', '.join(late)})")
    for n in bw.graph.nodes:
        if not _is(n, ao.reload.default):
            continue
        out["reloads"] += 1
        host = n.args[0]
        users = list(n.users)
        if len(users) != 1 or not _is(users[0], ao.wait_tensor.default) \
                or users[0].args[1] is not host:
            out["problems"].append(f"{n.name}: read other than through a wait keeping "
                                   f"{host.name} alive")
            continue
        b_order = {m: i for i, m in enumerate(bw.graph.nodes)}
        late = [u.name for u in host.users if u is not n and u is not users[0]
                and b_order[u] > b_order[users[0]]]
        if late:
            out["problems"].append(f"{host.name} is read after its reload's wait gave it back "
                                   f"(by {', '.join(late)})")
    return out


@contextlib.contextmanager
def captured():
    """Inside the block, each graph `compile_planned` partitions is also offloaded as on CUDA
    (copies of the graphs), and `check`'s answer appended to the list yielded."""
    from slackswap_cli.run.compiled import backend
    got: list[dict] = []
    orig = backend.offload

    from torch._functorch._activation_offloading import activation_offloading as ao_passes
    prefetch = ao_passes.activation_reload_prefetch_async

    def both(fw, bw, n_out, cuda, sizes):
        fw2 = torch.fx.GraphModule(fw, copy.deepcopy(fw.graph))
        bw2 = torch.fx.GraphModule(bw, copy.deepcopy(bw.graph))
        # (the prefetch pass times nodes on the GPU; it moves reloads earlier, their waits stay)
        ao_passes.activation_reload_prefetch_async = lambda g: None
        try:
            orig(fw2, bw2, n_out, True, sizes)
        finally:
            ao_passes.activation_reload_prefetch_async = prefetch
        got.append(check(fw2, bw2))
        return orig(fw, bw, n_out, cuda, sizes)
    backend.offload = both
    try:
        yield got
    finally:
        backend.offload = orig
