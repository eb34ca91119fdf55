"""A GPT split into pipeline stages by torch's `pipeline()`, a plan per stage, trained by 1F1B.

    torchrun --nproc-per-node 2 examples/pipeline_split.py      # CPU, gloo: under a minute

Every rank builds the whole model and the pipe (as `pipeline()` needs), plans the stage it
runs for its budget knowing how many microbatches 1F1B holds there, patches it and trains.
docs/pipeline.md ("A model split by pipeline()") walks through it.
"""
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from tiny_gpt import Block
from torch.distributed.pipelining import Schedule1F1B, SplitPoint, pipeline

from slackswap_cli import plan_pipeline

V, T, D = 128, 32, 64                  # vocabulary, sequence, width
MICRO, N_MB = 2, 4                     # rows per microbatch, microbatches per step


class GPT(nn.Module):
    def __init__(self, layers: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(V, D), nn.Embedding(T, D)
        self.blocks = nn.ModuleList(Block(D, 4, 0.0) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(D), nn.Linear(D, V, bias=False)

    def forward(self, x):
        x = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def loss_fn(logits, target):
    return F.cross_entropy(logits.reshape(-1, V), target.reshape(-1))


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = GPT(layers=2 * world)
    x, y = torch.randint(0, V, (MICRO * N_MB, T)), torch.randint(0, V, (MICRO * N_MB, T))
    # --8<-- [start:recipe]
    pipe = pipeline(model, (x[:MICRO],),
                    split_spec={f"blocks.{2 * k}": SplitPoint.BEGINNING for k in range(1, world)})
    planned = plan_pipeline(pipe, "1F1B", pp=world, microbatches=N_MB, budget="800KiB",
                            ranks=[rank], inputs=(x[:MICRO],), loss_fn=loss_fn,
                            target=y[:MICRO])
    print(planned)              # this rank: held, budget, keep-all and planned peaks, ...
    planned.patch(pipe)         # this rank's stage modules
    stage = pipe.build_stage(rank, torch.device("cpu"))
    schedule = Schedule1F1B(stage, N_MB, loss_fn=loss_fn)
    # --8<-- [end:recipe]
    opt = torch.optim.AdamW(stage.submod.parameters(), lr=1e-3)
    for step in range(3):
        opt.zero_grad(set_to_none=True)
        losses: list = []
        schedule.step(*((x,) if rank == 0 else ()), target=y if rank == world - 1 else None,
                      losses=losses, return_outputs=False)
        opt.step()
        if losses:
            print(f"step {step}: loss {torch.stack(losses).mean():.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
