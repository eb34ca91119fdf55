"""FSDP2 x TP x PP: a Llama-style model on a 2 x 2 x 2 DeviceMesh of 8 gloo ranks
(slackswap_testkit/three_d_run.py), each rank planned per stage on its local shards,
patched, FSDP2-sharded and run by torch's 1F1B for three AdamW steps, against the same
composition unpatched.

Minutes on two cores (8 processes each profile, plan and train twice), so the slow tier
(`make test-3d`). The default suite still covers each pair: tests/test_tensor_parallel.py's
sequence parallel block on two ranks (TP, local shards), tests/test_pipeline_ranks.py's
two-rank ZBVZeroBubble run and tests/test_pipeline_split.py's 1F1B run (per-stage plans on
pipeline ranks); benchmarks/three_d_ranks.py prints this run's per-rank table.
"""
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(),
                                reason="torch.distributed is not built in")


@pytest.mark.slow_tier            # 8 ranks (tests/conftest.py)
def test_fsdp_tp_pp_trains_exactly_within_each_ranks_budget(tmp_path):
    """Every rank's losses and local parameter shards bit for bit as unpatched; each holds
    the microbatches 1F1B holds on its pipeline rank (2 on the first, 1 on the last); its
    plan is under its budget, its measured activation peak within 1.05x of the budget; the
    first stage's ranks had to swap or recompute; the TP peers and data parallel replicas
    of a stage planned alike."""
    from slackswap_testkit.pipeline_run import same
    from slackswap_testkit.three_d_run import run
    ranks = run(0.6, tmp_path)
    assert len(ranks) == 8
    for rank, res in enumerate(ranks):
        row, plain, patched = res["row"], res["plain"], res["patched"]
        pp = res["coords"]["pp"]
        assert same(plain, patched), f"rank {rank}: the planned stage trained otherwise"
        assert row["held"] == plain["held"] == patched["held"] == [2, 1][pp]
        assert row["planned_peak_bytes"] <= row["budget_bytes"] < row["keep_all_peak_bytes"]
        measured = max(patched["peaks"][1:])       # steps 2 and 3
        assert measured <= 1.05 * row["budget_bytes"], (rank, measured, row["budget_bytes"])
        assert row["swapped_bytes"] + row["recomputed_bytes"] > 0
        same_stage = [r["row"] for r in ranks if r["coords"]["pp"] == pp]
        assert all(r == same_stage[0] for r in same_stage)
