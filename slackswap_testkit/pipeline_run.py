"""A GPT-style or a Llama-style model split by hand into pipeline stages, planned per rank
and run by one of torch's schedules on CPU ranks (gloo): the patched stages against the same pipeline unpatched,
and each rank's activation memory measured against its planned peak. tests/test_pipeline.py
and benchmarks/pipeline_ranks.py run it.

Memory is measured as the profile counts it (run/verify/memtrace.py: live activation storages), with
the parameters' gradients taken off as autograd makes them (a hook on each parameter marks the
storage it is handed). The schedules run with `return_outputs=False`: a last stage asked for
its outputs keeps every microbatch's until the step ends.
"""
from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
V, T, D, MB = 64, 16, 32, 2            # vocabulary, sequence, width, rows per microbatch


def make_stage(index: int, n_stages: int, layers: int = 2) -> nn.Module:
    """Stage `index` of `n_stages`: token and position embeddings on the first, `layers`
    transformer blocks, the final norm and the head on the last (same weights per index)."""
    sys.path.insert(0, str(ROOT / "examples"))
    from tiny_gpt import Block

    class Stage(nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.last = index == 0, index == n_stages - 1
            if self.first:
                self.tok, self.pos = nn.Embedding(V, D), nn.Embedding(T, D)
            self.blocks = nn.ModuleList(Block(D, 2, 0.0) for _ in range(layers))
            if self.last:
                self.ln_f, self.head = nn.LayerNorm(D), nn.Linear(D, V, bias=False)

        def forward(self, x):
            if self.first:
                x = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln_f(x)) if self.last else x

    torch.manual_seed(1000 + index)
    return Stage()


class LlamaBlock(nn.Module):
    """A torchtitan-style Llama block: RMSNorm, grouped-query attention with rotary position
    embeddings (2 query heads per key/value head), RMSNorm, SwiGLU MLP."""

    def __init__(self, dim: int = D, heads: int = 4, kv_heads: int = 2):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.hd, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.hd, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.w1 = nn.Linear(dim, 2 * dim, bias=False)
        self.w3 = nn.Linear(dim, 2 * dim, bias=False)
        self.w2 = nn.Linear(2 * dim, dim, bias=False)
        inv = 1.0 / (10000 ** (torch.arange(0, self.hd, 2).float() / self.hd))
        angles = torch.outer(torch.arange(T).float(), inv)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def _rope(self, x):
        a, b = x[..., 0::2], x[..., 1::2]
        cos, sin = self.cos[: x.shape[1], None, :], self.sin[: x.shape[1], None, :]
        return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)

    def forward(self, x):
        bsz, t, _ = x.shape
        h = self.attention_norm(x)
        q = self._rope(self.wq(h).view(bsz, t, self.heads, self.hd))
        k = self._rope(self.wk(h).view(bsz, t, self.kv_heads, self.hd))
        v = self.wv(h).view(bsz, t, self.kv_heads, self.hd)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        x = x + self.wo(y.transpose(1, 2).reshape(bsz, t, -1))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


def make_llama_stage(index: int, n_stages: int, layers: int = 2) -> nn.Module:
    """Stage `index` of a Llama-style model: the token embedding on the first, `layers`
    LlamaBlocks, the final RMSNorm and the output projection on the last."""

    class Stage(nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.last = index == 0, index == n_stages - 1
            if self.first:
                self.tok_embeddings = nn.Embedding(V, D)
            self.layers = nn.ModuleList(LlamaBlock() for _ in range(layers))
            if self.last:
                self.norm, self.output = nn.RMSNorm(D), nn.Linear(D, V, bias=False)

        def forward(self, x):
            if self.first:
                x = self.tok_embeddings(x)
            for layer in self.layers:
                x = layer(x)
            return self.output(self.norm(x)) if self.last else x

    torch.manual_seed(2000 + index)
    return Stage()


def make_gpt2_stage(index: int, n_stages: int, layers: int = 2) -> nn.Module:
    """Stage `index` of a Hugging Face GPT-2 (built from its config, no weights downloaded)
    with its dropout at 0.1 (embeddings, attention, residuals): the token and position
    embeddings and their dropout on the first, `layers` GPT2Blocks, the final LayerNorm and
    the head on the last. Each step draws its dropout masks, so a plan's recompute chains
    read random ops' outputs."""
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    cfg = GPT2Config(vocab_size=V, n_positions=T, n_embd=D, n_layer=n_stages * layers,
                     n_head=2, embd_pdrop=0.1, attn_pdrop=0.1, resid_pdrop=0.1,
                     bos_token_id=0, eos_token_id=0)
    cfg._attn_implementation = "sdpa"        # (what GPT2LMHeadModel picks on its own)

    class Stage(nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.last = index == 0, index == n_stages - 1
            if self.first:
                self.wte, self.wpe = nn.Embedding(V, D), nn.Embedding(T, D)
                self.drop = nn.Dropout(cfg.embd_pdrop)
            self.h = nn.ModuleList(GPT2Block(cfg, layer_idx=index * layers + i)
                                   for i in range(layers))
            if self.last:
                self.ln_f, self.head = nn.LayerNorm(D), nn.Linear(D, V, bias=False)

        def forward(self, x):
            if self.first:
                pos = torch.arange(x.shape[1], device=x.device)
                x = self.drop(self.wte(x) + self.wpe(pos))
            for block in self.h:
                x = block(x)
            return self.head(self.ln_f(x)) if self.last else x

    torch.manual_seed(3000 + index)
    return Stage()


FAMILIES = {"gpt": make_stage, "llama": make_llama_stage, "gpt2": make_gpt2_stage}


def loss_fn(out, target):
    return F.cross_entropy(out.reshape(-1, V), target.reshape(-1))


def stages_of(schedule: str, rank: int, world: int, per_rank: int) -> list[int]:
    if schedule in ("ZBVZeroBubble", "DualPipeV"):
        return [rank, 2 * world - 1 - rank]
    return [rank + world * k for k in range(per_rank)]


def _counting(stage, live: set, peak: list) -> None:
    """Count the microbatches `stage` holds: from forward_one_chunk to the backward that ends
    them (a full backward, or the weight half of a split one)."""
    fwd, bwd, bww = stage.forward_one_chunk, stage.backward_one_chunk, \
        stage.backward_weight_one_chunk

    def forward_one_chunk(mb, *a, **k):
        live.add((stage.stage_index, mb))
        peak[0] = max(peak[0], len(live))
        return fwd(mb, *a, **k)

    def backward_one_chunk(mb, *a, full_backward=True, **k):
        out = bwd(mb, *a, full_backward=full_backward, **k)
        if full_backward:
            live.discard((stage.stage_index, mb))
        return out

    def backward_weight_one_chunk(mb, *a, **k):
        out = bww(mb, *a, **k)
        live.discard((stage.stage_index, mb))
        return out
    stage.forward_one_chunk, stage.backward_one_chunk = forward_one_chunk, backward_one_chunk
    stage.backward_weight_one_chunk = backward_weight_one_chunk


def _measured_step(sched, mods, args, target, losses) -> int:
    """One schedule step under the memory tracker; its peak of live activation bytes."""
    from slackswap_cli.run.verify.memtrace import MemTracker
    from slackswap_cli.trace.storage import storage_object_key
    tracker = MemTracker()

    def grad_hook(g):
        i = tracker._live.get(storage_object_key(g))
        if i is not None and tracker.storages[i].nbytes > 0:
            tracker.storages[i].nbytes = -tracker.storages[i].nbytes - 1
    hooks = [p.register_hook(grad_hook) for m in mods.values() for p in m.parameters()]
    try:
        with tracker:
            sched.step(*args, target=target, losses=losses, return_outputs=False)
        tracker.finish()
    finally:
        for h in hooks:
            h.remove()
    return max(tracker.timeline(), default=0)


def recv_buffer_bytes(stages) -> int:
    """Bytes of the distinct storages the stages' receive buffers hold (PipelineStage's
    `args_recv_info` and `grad_recv_info`, every microbatch's), after a step."""
    seen, total = set(), 0
    for st in stages:
        for infos in (*st.args_recv_info.values(), *st.grad_recv_info.values()):
            for info in infos:
                buf = getattr(info, "buffer", None)
                if isinstance(buf, torch.Tensor):
                    key = buf.untyped_storage().data_ptr()
                    if key not in seen:
                        seen.add(key)
                        total += buf.untyped_storage().nbytes()
    return total


def _train(label, planned, mine, n_stages, schedule, n_mb, ids, tgt, steps, family="gpt",
           quick=False):
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class
    cls = get_schedule_class(schedule)
    mods = {s: FAMILIES[family](s, n_stages, 1 if quick else 2) for s in mine}
    if label == "patched":
        planned.patch(mods)
    stages = [PipelineStage(mods[s], s, n_stages, torch.device("cpu")) for s in mine]
    live, held = set(), [0]
    for st in stages:
        _counting(st, live, held)
    sched = cls(stages[0] if issubclass(cls, PipelineScheduleSingle) else stages, n_mb,
                loss_fn=loss_fn)
    opt = torch.optim.AdamW([p for m in mods.values() for p in m.parameters()], lr=1e-2)
    losses, peaks = [], []
    from contextlib import nullcontext

    from .emulated_device import emulated_if_asked, emulated_stats
    with emulated_if_asked() if label == "patched" else nullcontext() as dev:
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            out: list = []
            args, target = (ids,) if 0 in mine else (), tgt if n_stages - 1 in mine else None
            if quick:
                sched.step(*args, target=target, losses=out, return_outputs=False)
            else:
                peaks.append(_measured_step(sched, mods, args, target, out))
            opt.step()
            losses.append([x.detach() for x in out])
    return {"losses": losses, "peaks": peaks, "held": held[0],
            "recv_bytes": recv_buffer_bytes(stages),
            "emulated": None if dev is None else emulated_stats(dev),
            "params": [p.detach().clone() for m in mods.values() for p in m.parameters()]}


def hardware_for(link: float | None):
    """The default preset, its host link at `link` bytes per second each way (None: as it
    is). On these KiB-sized stages, timed on a CPU, every copy hides under compute at a
    real link's speed and slackswap's plans swap alone; at 5e7 B/s they recompute too."""
    import dataclasses

    from slackswap_cli.hardware import load_hardware
    hw = load_hardware(None)
    return hw if link is None else dataclasses.replace(hw, h2d_bytes_per_s=link,
                                                       d2h_bytes_per_s=link)


def worker(rank, world, port, schedule, n_mb, per_rank, budget, out_dir, planner="slackswap",
           steps=3, family="gpt", link=None, quick=False):
    import torch.distributed as dist
    sys.path.insert(0, str(ROOT))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from slackswap_cli.run.parallel.pipeline import plan_pipeline
        n_stages = world * per_rank
        mine = stages_of(schedule, rank, world, per_rank)
        torch.manual_seed(7)
        ids = torch.randint(0, V, (MB * n_mb, T))
        tgt = torch.randint(0, V, (MB * n_mb, T))
        specs = {}
        for s in mine:
            x = ids[:MB] if s == 0 else torch.randn(MB, T, D, requires_grad=True)
            last = (lambda out, inp: loss_fn(out, tgt[:MB])) if s == n_stages - 1 else None
            specs[s] = (FAMILIES[family](s, n_stages, 1 if quick else 2), (x,), last)
        started = time.perf_counter()
        planned = plan_pipeline(specs, schedule, pp=world, microbatches=n_mb, budget=budget,
                                stages_per_rank=per_rank if per_rank > 1 else None,
                                ranks=[rank], planner=planner,
                                hardware=hardware_for(link), measure=not quick)
        results = {"plan_s": time.perf_counter() - started,
                   "row": vars(planned.rows[0]) | {"fits": planned.rows[0].fits}}
        for label in ("plain", "patched"):
            results[label] = _train(label, planned, mine, n_stages, schedule, n_mb, ids, tgt,
                                    steps, family, quick)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(schedule: str, world: int, n_mb: int, per_rank: int, budget, out_dir,
        planner: str = "slackswap", family: str = "gpt", link: float | None = None,
        quick: bool = False) -> list[dict]:
    """Spawn the ranks; each rank's results: plan row, plain and patched runs. `family`: the
    model split into stages, "gpt" (`make_stage`), "llama" (`make_llama_stage`) or "gpt2"
    (`make_gpt2_stage`, dropout 0.1); `link`:
    the host link planned for (`hardware_for`); `quick`: one block per stage, no eager
    measure in planning (plan_pipeline's `measure=False`) and no memory tracked (no peaks):
    the default suite's short run."""
    torch.multiprocessing.spawn(worker, args=(world, free_port(), schedule, n_mb, per_rank,
                                              budget, str(out_dir), planner, 3, family, link,
                                              quick),
                                nprocs=world, join=True)
    return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False)
            for r in range(world)]


def same(a: dict, b: dict) -> bool:
    """Losses and parameters equal bit for bit."""
    return (all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))
            and all(torch.equal(x, y) for la, lb in zip(a["losses"], b["losses"])
                    for x, y in zip(la, lb)))


def rank_records(results, wall: float, /, **case) -> list[dict]:
    """One record per rank of a real-rank run (`results`: `run`'s; `case`: the run's settings,
    written first, `ranks` among them): microbatches held read and counted, keep-all and
    planned peaks predicted and measured (steps 2 and 3: the first also allocates receive
    buffers), the rank's receive buffers counted in its budget and as read from its stages
    after the run, bytes swapped and recomputed, whether it trained bitwise as unpatched."""
    out = []
    for rank, res in enumerate(results):
        row, plain, patched = res["row"], res["plain"], res["patched"]
        keep_meas, plan_meas = max(plain["peaks"][1:]), max(patched["peaks"][1:])
        out.append({**case, "rank": rank, "stages": list(row["stages"]),
                    "held_read": row["held"], "held_counted": patched["held"],
                    "keep_all_predicted": row["keep_all_peak_bytes"],
                    "keep_all_measured": keep_meas,
                    "planned_peak": row["planned_peak_bytes"], "planned_measured": plan_meas,
                    "planned_error": round(plan_meas / row["planned_peak_bytes"] - 1, 4),
                    "recv_predicted": row.get("recv_bytes", 0),
                    "recv_measured": patched.get("recv_bytes", 0),
                    "swapped_bytes": row["swapped_bytes"],
                    "recomputed_bytes": row["recomputed_bytes"],
                    "bitwise": same(plain, patched), "plan_s": round(res["plan_s"], 1),
                    "wall_s": round(wall, 1)})
    return out
