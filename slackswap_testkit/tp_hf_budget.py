"""Hugging Face Qwen2 and Llama under tensor parallelism as docs/tensor_parallel.md shows them
(colwise q/k/v and gate/up, rowwise o and down on every decoder layer), planned on each rank
with `plan_model(model, batch, budget=0.5)` and its defaults, patched, and trained three AdamW
steps on CPU ranks (gloo) against the same model unpatched. Per rank: the budget, the planned
peak, whether the plan was measured (`Plan.measured`), the measured activation peak of each
step (run/verify/memtrace.py, as slackswap_testkit/tp_run.py counts it), the last call's
line-up, and whether it trained bit for bit. tests/test_tensor_parallel.py runs it
(`SLACKSWAP_SLOW=1`).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from slackswap_testkit import tp_run
from slackswap_testkit.pipeline_run import free_port

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = {"qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
            "llama": ("LlamaConfig", "LlamaForCausalLM")}


def build(family: str, mesh):
    """The model (2 decoder layers, width 64, 4 heads, 2 key/value heads), each layer
    parallelised over `mesh`, in training mode, and its batch (labels the ids)."""
    import transformers
    config, causal = (getattr(transformers, n) for n in FAMILIES[family])
    torch.manual_seed(0)
    model = causal(config(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                          num_key_value_heads=2, intermediate_size=128, vocab_size=128,
                          max_position_embeddings=tp_run.T, use_cache=False))
    model.train()
    tp_run.parallelize_hf_layers(model, mesh)
    torch.manual_seed(1)
    ids = torch.randint(0, 128, (tp_run.B, tp_run.T))
    return model, {"input_ids": ids, "labels": ids}


def _train(model, x, steps: int) -> dict:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, peaks = [], []
    for _ in range(steps):
        loss, peak = tp_run._measured(model, x)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss)
        peaks.append(peak)
    return {"losses": losses, "peaks": peaks,
            "params": [getattr(p, "_local_tensor", p).detach().clone()
                       for p in model.parameters()]}


def worker(rank, world, port, family, out_dir, steps):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    sys.path.insert(0, str(ROOT))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        import slackswap_cli as slackswap
        mesh = init_device_mesh("cpu", (world,))
        model, x = build(family, mesh)
        plan = slackswap.plan_model(model, x, budget=0.5)
        out = {"budget_bytes": plan.budget_bytes, "planned_peak": plan.predicted.peak_bytes,
               "measured": plan.measured is not None, "actions": plan.actions(),
               "plain": _train(build(family, mesh)[0], x, steps)}
        slackswap.patch(model, plan)
        out["patched"] = _train(model, x, steps)
        out["report"] = model.forward.__slackswap__.last_run.report()
        torch.save(out, Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run(family: str, out_dir, world: int = 2, steps: int = 3) -> list[dict]:
    """Spawn the ranks; each rank's results (see the module docstring)."""
    torch.multiprocessing.spawn(worker, args=(world, free_port(), family, str(out_dir), steps),
                                nprocs=world, join=True)
    return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False)
            for r in range(world)]
