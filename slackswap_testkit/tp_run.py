"""Small tensor parallel models (DTensor, `parallelize_module`) planned on each rank and trained
on CPU ranks (gloo): the patched model against the same model unpatched, bit for bit, and each
rank's activation memory measured against its planned peak. tests/test_tensor_parallel.py and
benchmarks/tp_ranks.py run it.

Layouts (`LAYOUTS`): "mlp" (colwise up, rowwise down), "block" (a Llama-style block: colwise
q/k/v and gate/up, rowwise o and down, each rank its heads), "block-sp" (the same with
SequenceParallel norms: activations between the layers sharded on the sequence) and
"block-fsdp" (the block on a 2x2 mesh: TP inside, FSDP2 across), "hf-llama" (Hugging Face's
LlamaForCausalLM, its decoder layers parallelised the same way; its loss is its own). Every
rank of a TP group gets the same batch; the loss is the mean square of the output.

Memory is measured as the profile counts it (run/verify/memtrace.py: live activation storages, the
parameters' gradients taken off as autograd makes them), during one training step.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from slackswap_testkit.pipeline_run import free_port

ROOT = Path(__file__).resolve().parents[1]
B, T, D, H, HD, F_ = 2, 16, 64, 4, 16, 128      # batch, sequence, width, heads, head dim, MLP
LAYOUTS = ("mlp", "block", "block-sp", "block-fsdp", "hf-llama")


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(D, F_), nn.Linear(F_, D)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    """Pre-norm attention and a SwiGLU MLP; the heads a rank holds are read off q's width."""

    def __init__(self):
        super().__init__()
        self.attn_norm, self.mlp_norm = nn.RMSNorm(D), nn.RMSNorm(D)
        self.q, self.k, self.v = (nn.Linear(D, H * HD, bias=False) for _ in range(3))
        self.o = nn.Linear(H * HD, D, bias=False)
        self.gate, self.up = nn.Linear(D, F_, bias=False), nn.Linear(D, F_, bias=False)
        self.down = nn.Linear(F_, D, bias=False)

    def forward(self, x):
        h = self.attn_norm(x)
        b, t = h.shape[0], h.shape[1]
        q, k, v = (p(h).view(b, t, -1, HD).transpose(1, 2) for p in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, -1))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Model(nn.Module):
    """`blocks` blocks (or one MLP) and the loss: the mean square of the output (of the whole
    sequence, gathered, when the blocks leave it sharded on the sequence: `seq_mesh`)."""

    def __init__(self, layout: str, blocks: int = 1):
        super().__init__()
        self.layers = nn.ModuleList([MLP()] if layout == "mlp"
                                    else [Block() for _ in range(blocks)])
        self.seq_mesh = None

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        if self.seq_mesh is not None:
            from torch.distributed.tensor import DTensor, Shard
            x = DTensor.from_local(x, self.seq_mesh, [Shard(1)]).full_tensor()
        return x.pow(2).mean()


def parallelize(model: Model, layout: str, mesh) -> Model:
    """The TP plan of `layout` on `mesh` (a 1-D mesh; for "block-fsdp" its "tp" dimension)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )
    for layer in model.layers:
        if layout == "mlp":
            plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
        elif layout == "block-sp":
            plan = {"attn_norm": SequenceParallel(), "mlp_norm": SequenceParallel(),
                    **{n: ColwiseParallel(input_layouts=Shard(1)) for n in "qkv"},
                    "gate": ColwiseParallel(input_layouts=Shard(1)),
                    "up": ColwiseParallel(input_layouts=Shard(1)),
                    "o": RowwiseParallel(output_layouts=Shard(1)),
                    "down": RowwiseParallel(output_layouts=Shard(1))}
        else:
            plan = {**{n: ColwiseParallel() for n in ("q", "k", "v", "gate", "up")},
                    "o": RowwiseParallel(), "down": RowwiseParallel()}
        parallelize_module(layer, mesh, plan)
    return model


def parallelize_hf_layers(model, mesh) -> None:
    """Each decoder layer of a Hugging Face Llama-style causal LM parallelised over `mesh` as
    docs/training.md shows it: q/k/v, gate and up column-wise, o and down row-wise."""
    from torch.distributed.tensor.parallel import ColwiseParallel as col
    from torch.distributed.tensor.parallel import RowwiseParallel as row
    from torch.distributed.tensor.parallel import parallelize_module
    for layer in model.model.layers:
        parallelize_module(layer, mesh, {
            "self_attn.q_proj": col(), "self_attn.k_proj": col(), "self_attn.v_proj": col(),
            "self_attn.o_proj": row(), "mlp.gate_proj": col(), "mlp.up_proj": col(),
            "mlp.down_proj": row()})


def _hf_llama(mesh, blocks: int):
    """A small LlamaForCausalLM (2 heads, 2 key/value heads), each decoder layer parallelised
    as the blocks are, and its batch of token ids (labels the ids)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=blocks, hidden_size=32, num_attention_heads=2,
                      num_key_value_heads=2, intermediate_size=64, vocab_size=128,
                      max_position_embeddings=T, use_cache=False)
    model = LlamaForCausalLM(cfg)
    parallelize_hf_layers(model, mesh)
    torch.manual_seed(1)
    ids = torch.randint(0, 128, (B, T))
    return model, {"input_ids": ids, "labels": ids}


def loss_of(model, x) -> torch.Tensor:
    """The step's loss: the model's output, or a Hugging Face model's `.loss`."""
    if isinstance(x, dict):
        return model(**x).loss
    return model(x)


def build(layout: str, world: int, blocks: int = 1):
    """(the model, parallelised on this rank, its input, the mesh). The ranks of a TP group
    get the same batch (under "block-fsdp" each data parallel rank its own); under
    "block-sp" each rank its part of the sequence."""
    from torch.distributed.device_mesh import init_device_mesh
    torch.manual_seed(0)
    model = Model(layout, blocks)
    dp_rank = 0
    if layout == "hf-llama":
        mesh = init_device_mesh("cpu", (world,))
        return (*_hf_llama(mesh, blocks), mesh)
    if layout == "block-fsdp":
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        parallelize(model, layout, mesh["tp"])
        dp_rank = mesh["dp"].get_local_rank()
    else:
        mesh = init_device_mesh("cpu", (world,))
        parallelize(model, layout, mesh)
    torch.manual_seed(1 + dp_rank)
    x = torch.randn(B, T, D)
    if layout == "block-sp":
        model.seq_mesh = mesh
        x = x.chunk(world, dim=1)[mesh.get_local_rank()].contiguous()
    return model, x, mesh


def _sharded(model: Model, mesh) -> None:
    """FSDP2 across the "dp" dimension of a 2-D mesh, on each block and the root."""
    from torch.distributed.fsdp import fully_shard
    for layer in model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])


def _not_fsdp2():
    """The memory tracker's `locate`: a call FSDP2 makes (its all-gathered parameters, its
    reduce-scatter buffers) is not activation memory."""
    from slackswap_cli.run.verify.memtrace import SKIP
    f = sys._getframe(2)
    while f is not None:
        if "/distributed/fsdp/" in f.f_code.co_filename:
            return SKIP
        f = f.f_back
    return None


def _measured(model, x) -> tuple[torch.Tensor, int]:
    """One forward and backward under the memory tracker: (loss, peak live activation
    bytes), the parameters' gradients and FSDP2's own buffers not counted."""
    from slackswap_cli.run.verify.memtrace import MemTracker
    from slackswap_cli.trace.storage import storage_object_key
    tracker = MemTracker(locate=_not_fsdp2)

    def grad_hook(g):
        g = getattr(g, "_local_tensor", g)
        i = tracker._live.get(storage_object_key(g))
        if i is not None and tracker.storages[i].nbytes > 0:
            tracker.storages[i].nbytes = -tracker.storages[i].nbytes - 1
    hooks = [p.register_hook(grad_hook) for p in model.parameters()]
    try:
        with tracker:
            loss = loss_of(model, x)
            loss.backward()
        tracker.finish()
    finally:
        for h in hooks:
            h.remove()
    return loss.detach(), max(tracker.timeline(), default=0)


def _train(label: str, layout: str, world: int, plan, steps: int, measure: bool,
           blocks: int) -> dict:
    import slackswap_cli as slackswap
    model, x, mesh = build(layout, world, blocks)
    if label == "patched":
        slackswap.patch(model, plan)
    if layout == "block-fsdp":
        _sharded(model, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, peaks, reruns = [], [], []
    from contextlib import nullcontext

    from .emulated_device import emulated_if_asked, emulated_stats
    with emulated_if_asked() if label == "patched" else nullcontext() as dev:
        for _ in range(steps):
            if measure:
                loss, peak = _measured(model, x)
                peaks.append(peak)
            else:
                loss = loss_of(model, x)
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
            if label == "patched":
                reruns.append(model.forward.__slackswap__.last_run.rerun_ops)
    out = {"losses": losses, "peaks": peaks,
           "emulated": None if dev is None else emulated_stats(dev),
           "params": [getattr(p, "_local_tensor", p).detach().clone()
                      for p in model.parameters()]}
    if label == "patched":
        run = model.forward.__slackswap__.last_run
        out.update(rerun=reruns, swaps=len(run.swaps), report=run.report())
    return out


def plan_of(model, x, budget, planner: str = "slackswap"):
    """`plan_model(model, x, budget=...)` priced at 2 us a kernel (small_costs.py)."""
    import slackswap_cli as slackswap
    from slackswap_testkit.small_costs import small_model_costs
    with small_model_costs():
        return slackswap.plan_model(model, _inputs(x), budget=budget, planner=planner)


def _inputs(x):
    return x if isinstance(x, dict) else (x,)


def plan_and_train(layout: str, world: int, budget, *, steps: int = 3, measure: bool = False,
                   blocks: int = 1, planner: str = "slackswap") -> dict:
    """On this rank (its process group initialised): the model planned (fake trace, 2 us
    kernels: slackswap_testkit/small_costs.py), then trained plain and patched."""
    model, x, _ = build(layout, world, blocks)
    started = time.perf_counter()
    plan = plan_of(model, x, budget, planner)
    prof = plan.profile
    out = {"plan_s": time.perf_counter() - started, "actions": plan.actions(),
           "keep_all_peak": prof.summary["peak_activation_bytes"],
           "planned_peak": plan.predicted.peak_bytes, "budget_bytes": plan.budget_bytes,
           "swapped_bytes": plan.predicted.swapped_bytes,
           "recomputed_bytes": plan.predicted.recomputed_bytes,
           "saved": [(t.name, t.shape, t.size_bytes, t.recomputable)
                     for t in prof.tensors if t.saved and t.kind == "activation"],
           "collective_outputs": [(o.target, [prof.tensors[t].recomputable for t in o.outputs])
                                  for o in prof.ops if is_collective_name(o.target)],
           "decisions": {prof.tensors[d.tensor].name: str(d.action) for d in plan.decisions},
           "producer": {prof.tensors[d.tensor].name: prof.ops[prof.tensors[d.tensor].producer].target
                        for d in plan.decisions}}
    for label in ("plain", "patched"):
        out[label] = _train(label, layout, world, plan, steps, measure, blocks)
    return out


def is_collective_name(target: str) -> bool:
    return target.split(".")[0] in ("_c10d_functional", "_c10d_functional_autograd", "c10d")


def worker(rank, world, port, layout, budget, out_dir, steps, measure, blocks, planner):
    import torch.distributed as dist
    sys.path.insert(0, str(ROOT))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results = plan_and_train(layout, world, budget, steps=steps, measure=measure,
                                 blocks=blocks, planner=planner)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run(layout: str, world: int, budget, out_dir, steps: int = 3, measure: bool = False,
        blocks: int = 1, planner: str = "slackswap") -> list[dict]:
    """Spawn the ranks; each rank's results: its plan, the plain and the patched run."""
    torch.multiprocessing.spawn(worker, args=(world, free_port(), layout, budget, str(out_dir),
                                              steps, measure, blocks, planner),
                                nprocs=world, join=True)
    return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False)
            for r in range(world)]


def same(a: dict, b: dict) -> bool:
    """Losses and (local) parameters equal bit for bit."""
    return (all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))
            and all(torch.equal(x, y) for x, y in zip(a["losses"], b["losses"])))

