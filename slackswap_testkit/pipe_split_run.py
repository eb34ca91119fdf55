"""A whole GPT-style or Llama-style model split into stages by torch's `pipeline()` (SplitPoint
.BEGINNING on its blocks), planned per rank from the pipe (`plan_pipeline(pipe, ...)`) and run
by one of torch's schedules on CPU ranks (gloo) through `pipe.build_stage`: the patched pipe
against the same pipe unpatched, and each rank's activation memory measured against its
planned peak. tests/test_pipeline_ranks.py and benchmarks/pipeline_ranks.py run it.

The blocks, sizes, loss, memory count and microbatch count are those of the stages split by
hand (slackswap_testkit/pipeline_run.py), so the two splits can be compared.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

from slackswap_testkit.pipeline_run import (
    MB,
    ROOT,
    D,
    LlamaBlock,
    T,
    V,
    _counting,
    _measured_step,
    free_port,
    loss_fn,
    recv_buffer_bytes,
    stages_of,
)
from slackswap_testkit.small_costs import small_model_costs


class GPT(nn.Module):
    """Token and position embeddings, tiny_gpt's blocks, the final norm and the head."""

    def __init__(self, layers: int):
        super().__init__()
        sys.path.insert(0, str(ROOT / "examples"))
        from tiny_gpt import Block
        self.tok, self.pos = nn.Embedding(V, D), nn.Embedding(T, D)
        self.blocks = nn.ModuleList(Block(D, 2, 0.0) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(D), nn.Linear(D, V, bias=False)

    def forward(self, x):
        x = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class Llama(nn.Module):
    """The token embedding, LlamaBlocks (RMSNorm, rotary, grouped-query attention, SwiGLU),
    the final RMSNorm and the output projection."""

    def __init__(self, layers: int):
        super().__init__()
        self.tok_embeddings = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(LlamaBlock() for _ in range(layers))
        self.norm, self.output = nn.RMSNorm(D), nn.Linear(D, V, bias=False)

    def forward(self, x):
        x = self.tok_embeddings(x)
        for block in self.blocks:
            x = block(x)
        return self.output(self.norm(x))


def hf_llama(layers: int) -> nn.Module:
    """A Hugging Face LlamaForCausalLM of the same sizes (built from its config, no weights
    downloaded): its first stage sends the hidden states, the rotary cos and sin and the
    causal mask, flattened, to the next."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=V, hidden_size=D, intermediate_size=2 * D,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=T, use_cache=False)
    return LlamaForCausalLM(cfg)


# family -> (the model of `layers` blocks, the path of block k)
MODELS = {"gpt": (GPT, "blocks.{}"), "llama": (Llama, "blocks.{}"),
          "hf-llama": (hf_llama, "model.layers.{}")}


def make_pipe(family: str, n_stages: int, example, layers_per_stage: int = 2):
    """The model (same weights every call) split by `pipeline()` into `n_stages` stages of
    `layers_per_stage` blocks each, traced at `example` (one microbatch's token ids)."""
    from torch.distributed.pipelining import SplitPoint, pipeline
    build, block = MODELS[family]
    torch.manual_seed(3000)
    model = build(n_stages * layers_per_stage)
    spec = {block.format(k * layers_per_stage): SplitPoint.BEGINNING for k in range(1, n_stages)}
    return pipeline(model, (example,), split_spec=spec)


@dataclasses.dataclass(frozen=True)
class Case:
    """One run: `schedule` on `world` ranks, `microbatches` per step, `per_rank` stages per
    rank of `layers` blocks each, `budget` bytes of activations per rank. `device`: where the
    stages are profiled ("cpu": timed there, eager's excess measured; "fake:cpu": a roofline
    trace at 2 us a kernel, slackswap_testkit/small_costs.py, in a second rather than 10-20);
    `link`: the host link's bytes/s each way (`hardware`)."""
    schedule: str
    world: int
    microbatches: int
    per_rank: int
    budget: int
    planner: str = "slackswap"
    family: str = "gpt"
    steps: int = 3
    layers: int = 2
    device: str = "cpu"
    link: float | None = None


def hardware(link: float | None):
    """a100-pcie4 (the default), its host link at `link` bytes/s each way when given: the
    stages' ops are timed on the CPU, where every copy of these KiB-sized activations hides
    under compute and the plans swap only; a link slow enough to run out of slack makes them
    recompute as well."""
    from slackswap_cli.hardware import PRESETS
    hw = PRESETS["a100-pcie4"]
    return hw if link is None else dataclasses.replace(
        hw, name=f"a100-pcie4-link-{link:g}", h2d_bytes_per_s=link, d2h_bytes_per_s=link)


def _train(label, planned, mine, case: Case, ids, tgt):
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class
    cls = get_schedule_class(case.schedule)
    n_stages = case.world * case.per_rank
    pipe = make_pipe(case.family, n_stages, ids[:MB], case.layers)
    if label == "patched":
        planned.patch(pipe)
    stages = [pipe.build_stage(s, torch.device("cpu")) for s in mine]
    mods = {s: pipe.get_stage_module(s) for s in mine}
    live, held = set(), [0]
    for st in stages:
        _counting(st, live, held)
    sched = cls(stages[0] if issubclass(cls, PipelineScheduleSingle) else stages,
                case.microbatches, loss_fn=loss_fn)
    opt = torch.optim.AdamW([p for m in mods.values() for p in m.parameters()], lr=1e-2)
    losses, peaks = [], []
    for _ in range(case.steps):
        opt.zero_grad(set_to_none=True)
        out: list = []
        peaks.append(_measured_step(sched, mods, (ids,) if 0 in mine else (),
                                    tgt if n_stages - 1 in mine else None, out))
        opt.step()
        losses.append([x.detach() for x in out])
    return {"losses": losses, "peaks": peaks, "held": held[0],
            "recv_bytes": recv_buffer_bytes(stages),
            "params": [p.detach().clone() for m in mods.values() for p in m.parameters()]}


def _plan(case: Case, rank: int, ids, tgt):
    from slackswap_cli.run.parallel.pipeline import plan_pipeline
    costs = small_model_costs() if case.device.startswith("fake") else contextlib.nullcontext()
    pipe = make_pipe(case.family, case.world * case.per_rank, ids[:MB], case.layers)
    with costs:
        return plan_pipeline(pipe, case.schedule, pp=case.world,
                             microbatches=case.microbatches, budget=case.budget,
                             stages_per_rank=case.per_rank if case.per_rank > 1 else None,
                             ranks=[rank], planner=case.planner, device=case.device,
                             hardware=hardware(case.link), inputs=(ids[:MB],),
                             loss_fn=loss_fn, target=tgt[:MB])


def worker(rank, port, case: Case, out_dir):
    import torch.distributed as dist
    sys.path.insert(0, str(ROOT))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=case.world)
    try:
        mine = stages_of(case.schedule, rank, case.world, case.per_rank)
        torch.manual_seed(7)
        ids = torch.randint(0, V, (MB * case.microbatches, T))
        tgt = torch.randint(0, V, (MB * case.microbatches, T))
        started = time.perf_counter()
        planned = _plan(case, rank, ids, tgt)
        results = {"plan_s": time.perf_counter() - started,
                   "row": vars(planned.rows[0]) | {"fits": planned.rows[0].fits}}
        for label in ("plain", "patched"):
            results[label] = _train(label, planned, mine, case, ids, tgt)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run(case: Case, out_dir) -> list[dict]:
    """Spawn the ranks; each rank's results: plan row, plain and patched runs."""
    torch.multiprocessing.spawn(worker, args=(free_port(), case, str(out_dir)),
                                nprocs=case.world, join=True)
    return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False)
            for r in range(case.world)]
