"""A patched model under DDP and FSDP2: two CPU processes (gloo on 127.0.0.1), three AdamW steps,
each rank on its own data. Losses and full parameters equal those of the same setup without
the plan, bit for bit.

Order, as for activation checkpointing: `patch(model)`, then `DDP(model)` or `fully_shard` on
the blocks and the root. The plan is made for one rank's activations.
"""
import os
import sys
from pathlib import Path

import pytest
import torch
from helpers import free_port
from workloads import HW, profiled, train_on_random_tokens

from slackswap_cli.run.emit import apply_plan

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not torch.distributed.is_available(),
                                reason="torch.distributed is not built in")


def _worker(rank, world, port, patched_path, workload_path, mode, out_dir):
    import torch.distributed as dist
    sys.path.insert(0, str(ROOT))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from slackswap_cli.run.emit import load_patched
        from slackswap_cli.trace.workload import load_workload
        results = {}
        for label in ("plain", "patched"):
            work = load_workload(workload_path)        # same seed: same weights on every rank
            model = work.model
            if label == "patched" and mode != "fsdp_first":
                load_patched(patched_path).patch(model)
            blocks = getattr(model, "blocks", None) or model.model.layers
            if mode == "ddp":
                from torch.nn.parallel import DistributedDataParallel as DDP
                wrapped = DDP(model)
            else:
                from torch.distributed.fsdp import fully_shard
                for b in blocks:
                    fully_shard(b)
                fully_shard(model)
                wrapped = model
            if label == "patched" and mode == "fsdp_first":
                load_patched(patched_path).patch(model)   # a model sharded before patching
            torch.manual_seed(100 + rank)              # each rank its own data and dropout
            losses = train_on_random_tokens(work, model, wrapped)
            params = [p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
                      for p in model.parameters()]
            run = model.forward.__slackswap__.last_run if label == "patched" else None
            results[label] = {"losses": losses, "params": params,
                              "rerun": run.rerun_ops if run else 0,
                              "swaps": len(run.metas) if run else 0,
                              "lined_up": len(run.rec_of_op) if run else 0,
                              "profile_ops": len(run.table.ops) if run else 0}
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
        # both ranks done before either tears gloo down: a rank that destroys the group while
        # the other still has FSDP2's last collectives in flight aborts it ("terminate called
        # without an active exception", SIGABRT; seen once in CI on the llama-fsdp case)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _run(tmp_path, files, name, frac, mode):
    prof = profiled(files, name)
    peak = prof.summary["peak_activation_bytes"]
    from slackswap_cli.planners import make_plan
    plan = make_plan("recompute-only" if mode.startswith("fsdp") else "slackswap", prof, HW,
                     int(peak * frac), frac)
    patched = tmp_path / f"{name}_patched.py"
    patched.write_text(apply_plan(plan, prof))
    torch.multiprocessing.spawn(_worker, args=(2, free_port(), str(patched), str(files[name]),
                                               mode, str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for res in ranks:
        plain, patched_ = res["plain"], res["patched"]
        assert [x.item() for x in plain["losses"]] == [x.item() for x in patched_["losses"]]
        assert all(torch.equal(a, b) for a, b in zip(plain["params"], patched_["params"]))
    # the ranks trained one model together (gradients were reduced)
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["patched"]["params"],
                                                ranks[1]["patched"]["params"]))
    assert ranks[0]["plain"]["losses"] != ranks[1]["plain"]["losses"]
    return ranks


@pytest.mark.slow
def test_ddp_trains_the_patched_model_exactly(files, tmp_path):
    ranks = _run(tmp_path, files, "tiny_gpt", 0.4, "ddp")
    assert ranks[0]["patched"]["rerun"] + ranks[0]["patched"]["swaps"] > 0


@pytest.mark.slow
# HF Llama under FSDP2 in the slow tier: by default the tiny GPT holds both orders under FSDP2,
# HF Llama trains patched bitwise in test_inplace and compiled per block under FSDP2 in
# test_compiled
@pytest.mark.parametrize("name,mode", [("tiny_gpt", "fsdp"),
                                       pytest.param("llama", "fsdp", marks=pytest.mark.slow_tier),
                                       ("tiny_gpt", "fsdp_first")])
def test_fsdp2_trains_the_patched_model_exactly(name, mode, files, tmp_path):
    """`patch` then `fully_shard` (as for activation checkpointing), or the other way round."""
    ranks = _run(tmp_path, files, name, 0.4, mode)
    r = ranks[0]["patched"]
    assert r["rerun"] > 0                              # recompute chains ran under FSDP2
    # FSDP2's own ops in its hooks (all-gather copies, views of weights and of block inputs)
    # do not pass for the model's: the model's ops line up as without FSDP2
    assert r["lined_up"] >= 0.7 * r["profile_ops"]
