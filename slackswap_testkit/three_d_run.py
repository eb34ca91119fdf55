"""FSDP2 x TP x PP on CPU ranks (gloo): a Llama-style model (RMSNorm, rotary embeddings,
grouped-query attention, SwiGLU) split into pipeline stages, each stage's blocks tensor
parallel (colwise q/k/v and gate/up, rowwise o and down), every stage module FSDP2-sharded
across the data parallel ranks, on a 3-D DeviceMesh ("pp", "dp", "tp"). Each rank plans its
own stage on its local shards (`plan_pipeline(..., ranks=[pp rank])`: the TP peers of a stage
trace the same shapes and plan alike), patches it, shards it, wraps it in a PipelineStage of
its "pp" group and trains three AdamW steps under 1F1B; then the same composition unpatched.
tests/test_three_d.py and `make test-3d` run it (benchmarks/three_d_ranks.py prints the table).

Per rank: its losses (the last stage's) and local parameter shards, bit for bit against the
unpatched run; its activation peak measured as the profile counts it (live activation
storages, the parameters' gradients and FSDP2's own buffers not counted: tp_run's tracker)
against its budget; its static memory (its parameter, gradient and AdamW state shards, read
off the tensors after the last step).
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from slackswap_testkit.pipeline_run import _counting, free_port
from slackswap_testkit.tp_run import _not_fsdp2

ROOT = Path(__file__).resolve().parents[1]
PP, DP, TP = 2, 2, 2                     # the mesh: pipeline, data (FSDP2), tensor parallel
V, T, D, HEADS, KV_HEADS, F_ = 128, 16, 64, 4, 2, 128
HD = D // HEADS
MB, N_MB, LAYERS = 2, 4, 2               # rows per microbatch, microbatches, blocks a stage


class Block(nn.Module):
    """A Llama block; the heads a rank holds read off its local q and k widths (a TP rank
    holds HEADS / TP query heads and KV_HEADS / TP key/value heads). `tp` > 1 builds one TP
    rank's local shard as a plain module (its linears at the widths ColwiseParallel and
    RowwiseParallel leave each rank): what examples/llama_3d_stage.py gives `fit --tp`."""

    def __init__(self, tp: int = 1):
        super().__init__()
        heads, kv, ffn = HEADS // tp, KV_HEADS // tp, F_ // tp
        self.attention_norm, self.ffn_norm = nn.RMSNorm(D), nn.RMSNorm(D)
        self.wq = nn.Linear(D, heads * HD, bias=False)
        self.wk = nn.Linear(D, kv * HD, bias=False)
        self.wv = nn.Linear(D, kv * HD, bias=False)
        self.wo = nn.Linear(heads * HD, D, bias=False)
        self.w1, self.w3 = nn.Linear(D, ffn, bias=False), nn.Linear(D, ffn, bias=False)
        self.w2 = nn.Linear(ffn, D, bias=False)
        inv = 1.0 / (10000 ** (torch.arange(0, HD, 2).float() / HD))
        angles = torch.outer(torch.arange(T).float(), inv)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def _rope(self, x):
        a, b = x[..., 0::2], x[..., 1::2]
        cos, sin = self.cos[: x.shape[1], None, :], self.sin[: x.shape[1], None, :]
        return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)

    def forward(self, x):
        b, t, _ = x.shape
        h = self.attention_norm(x)
        q = self._rope(self.wq(h).view(b, t, -1, HD))
        k = self._rope(self.wk(h).view(b, t, -1, HD))
        v = self.wv(h).view(b, t, -1, HD)
        rep = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        x = x + self.wo(y.transpose(1, 2).reshape(b, t, -1))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Stage(nn.Module):
    """Stage `index` of `n_stages`: the token embedding on the first, LAYERS blocks, the final
    RMSNorm and the output projection on the last (the same weights per index); `tp`: its
    blocks as one TP rank's local shard (`Block`)."""

    def __init__(self, index: int, n_stages: int, tp: int = 1):
        super().__init__()
        torch.manual_seed(4000 + index)
        self.first, self.last = index == 0, index == n_stages - 1
        if self.first:
            self.tok_embeddings = nn.Embedding(V, D)
        self.layers = nn.ModuleList(Block(tp) for _ in range(LAYERS))
        if self.last:
            self.norm, self.output = nn.RMSNorm(D), nn.Linear(D, V, bias=False)

    def forward(self, x):
        if self.first:
            x = self.tok_embeddings(x)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x)) if self.last else x


def loss_fn(out, target):
    return F.cross_entropy(out.reshape(-1, V), target.reshape(-1))


def build_stage(index: int, tp_mesh) -> Stage:
    """The stage, its blocks parallelised on `tp_mesh` (embedding, norm and head replicated
    across the TP ranks, as plain parameters)."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )
    stage = Stage(index, PP)
    for block in stage.layers:
        parallelize_module(block, tp_mesh, {
            **{n: ColwiseParallel() for n in ("wq", "wk", "wv", "w1", "w3")},
            "wo": RowwiseParallel(), "w2": RowwiseParallel()})
    return stage


def _shard(stage: Stage, dp_mesh) -> None:
    """FSDP2 across the data parallel ranks: each block, then the stage (what is left)."""
    from torch.distributed.fsdp import fully_shard
    for block in stage.layers:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(stage, mesh=dp_mesh)


def unsharded_params(stage: Stage) -> list:
    """FSDP2's unsharded parameters of the stage (made at its first all-gather, then reused):
    their gradients accumulate over the step's microbatches until the last backward's
    reduce-scatter."""
    from torch.distributed.fsdp import FSDPModule, fully_shard
    out = []
    for m in stage.modules():
        group = fully_shard.state(m)._fsdp_param_group if isinstance(m, FSDPModule) else None
        out += [p._unsharded_param for p in (group.fsdp_params if group else ())
                if hasattr(p, "_unsharded_param")]
    return out


def _measured_step(sched, stage: Stage, args, target, losses) -> int:
    """One schedule step under the memory tracker; its peak of live activation bytes. Not
    counted: FSDP2's allocations (all-gathers, reduce-scatters) and the parameters'
    gradients, the unsharded ones FSDP2 accumulates over the microbatches among them (static
    memory, `static_bytes`)."""
    from slackswap_cli.run.verify.memtrace import MemTracker
    from slackswap_cli.trace.storage import storage_object_key
    tracker = MemTracker(locate=_not_fsdp2)

    def not_activation(g):
        g = getattr(g, "_local_tensor", g)
        i = tracker._live.get(storage_object_key(g))
        if i is not None and tracker.storages[i].nbytes > 0:
            tracker.storages[i].nbytes = -tracker.storages[i].nbytes - 1
    params = list(stage.parameters()) + unsharded_params(stage)
    hooks = [p.register_hook(not_activation) for p in params]
    hooks += [p.register_post_accumulate_grad_hook(lambda p: not_activation(p.grad))
              for p in params]
    try:
        with tracker:
            sched.step(*args, target=target, losses=losses, return_outputs=False)
        tracker.finish()
    finally:
        for h in hooks:
            h.remove()
    return max(tracker.timeline(), default=0)


def _local_bytes(tensors) -> int:
    """Bytes of the tensors' local storages, each storage once."""
    seen = {}
    for t in tensors:
        st = getattr(t, "_local_tensor", t).untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def static_bytes(stage: Stage, opt) -> dict:
    """This rank's static memory in bytes (local storages): its parameter, gradient and AdamW
    state shards, and what FSDP2 holds unsharded through a pipeline step (the stage's
    parameters, kept from the first microbatch's all-gather to the last backward, and their
    accumulated gradients: each the size of the unsharded parameters)."""
    params = list(stage.parameters())
    state = [v for s in opt.state.values() for v in s.values()
             if isinstance(v, torch.Tensor) and v.dim() > 0]
    unsharded = sum(getattr(p, "_local_tensor", p).numel() * p.element_size()
                    for p in unsharded_params(stage))
    return {"params": _local_bytes(params),
            "grads": _local_bytes(p.grad for p in params if p.grad is not None),
            "optimizer": _local_bytes(state), "unsharded": 2 * unsharded}


def _train(label: str, planned, mesh, ids, tgt, steps: int) -> dict:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    index = mesh["pp"].get_local_rank()
    stage = build_stage(index, mesh["tp"])
    if label == "patched":
        planned.patch({index: stage})
    _shard(stage, mesh["dp"])
    pipe_stage = PipelineStage(stage, index, PP, torch.device("cpu"),
                               group=mesh["pp"].get_group())
    live, held = set(), [0]
    _counting(pipe_stage, live, held)
    sched = Schedule1F1B(pipe_stage, N_MB, loss_fn=loss_fn)
    opt = torch.optim.AdamW(stage.parameters(), lr=1e-2)
    losses, peaks = [], []
    for _ in range(steps):
        opt.zero_grad(set_to_none=False)
        out: list = []
        args = (ids,) if index == 0 else ()
        peaks.append(_measured_step(sched, stage, args, tgt if index == PP - 1 else None, out))
        opt.step()
        losses.append([x.detach() for x in out])
    return {"losses": losses, "peaks": peaks, "held": held[0],
            "static": static_bytes(stage, opt),
            "params": [getattr(p, "_local_tensor", p).detach().clone()
                       for p in stage.parameters()]}


def plan_stage(mesh, budget, planner: str = "slackswap"):
    """This rank's stage planned on its local shards (a fake trace at 2 us a kernel, so that
    the TP peers of the stage, and its data parallel replicas, plan the same)."""
    from slackswap_cli.run.parallel.pipeline import plan_pipeline
    from slackswap_testkit.small_costs import small_model_costs
    index = mesh["pp"].get_local_rank()
    stage = build_stage(index, mesh["tp"])
    torch.manual_seed(11)
    x = (torch.randint(0, V, (MB, T)) if index == 0
         else torch.randn(MB, T, D, requires_grad=True))
    zeros = torch.zeros(MB, T, dtype=torch.long)
    last = (lambda out, inp: loss_fn(out, zeros)) if index == PP - 1 else None
    with small_model_costs():
        return plan_pipeline({index: (stage, (x,), last)}, "1F1B", pp=PP, microbatches=N_MB,
                             budget=budget, ranks=[index], planner=planner,
                             device="fake:cpu")


def worker(rank, world, port, budget, out_dir, steps, planner):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    sys.path.insert(0, str(ROOT))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (PP, DP, TP), mesh_dim_names=("pp", "dp", "tp"))
        started = time.perf_counter()
        planned = plan_stage(mesh, budget, planner)
        results = {"plan_s": time.perf_counter() - started,
                   "coords": {n: mesh[n].get_local_rank() for n in ("pp", "dp", "tp")},
                   "row": vars(planned.rows[0]) | {"fits": planned.rows[0].fits}}
        torch.manual_seed(7 + mesh["dp"].get_local_rank())     # each data parallel rank its batch
        ids = torch.randint(0, V, (MB * N_MB, T))
        tgt = torch.randint(0, V, (MB * N_MB, T))
        for label in ("plain", "patched"):
            results[label] = _train(label, planned, mesh, ids, tgt, steps)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run(budget, out_dir, steps: int = 3, planner: str = "slackswap") -> list[dict]:
    """Spawn the PP x DP x TP ranks; each rank's results: its mesh coordinates, its pipeline
    row (planned), the plain and the patched run."""
    world = PP * DP * TP
    torch.multiprocessing.spawn(worker, args=(world, free_port(), budget, str(out_dir), steps,
                                              planner),
                                nprocs=world, join=True)
    return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False)
            for r in range(world)]
