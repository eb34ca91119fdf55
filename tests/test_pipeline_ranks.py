"""Per-stage plans on real pipeline ranks: a GPT-style and a Llama-style model (RMSNorm, rotary
embeddings, grouped-query attention, SwiGLU) split by hand into PipelineStages,
two CPU processes (gloo), run by torch's GPipe, 1F1B and Interleaved1F1B for three AdamW steps
(slackswap_testkit/pipeline_run.py), planned by slackswap and by recompute-only. The patched stages train bit for bit as the same pipeline
unpatched; each rank holds the microbatches read from the schedule; its measured activation
peak is within 5% of the predicted one, keeping everything and under its plan. The same for
models split by torch's `pipeline()` (slackswap_testkit/pipe_split_run.py, including Hugging
Face's LlamaForCausalLM; benchmarks/pipeline_split_ranks.py).

About a minute per schedule on two cores (each rank profiles and plans its stages, then trains
twice), so they run with SLACKSWAP_SLOW=1 (`SLACKSWAP_SLOW=1 pytest tests/test_pipeline_ranks.py`);
benchmarks/pipeline_ranks.py prints the same runs' per-rank table.
"""
import os

import pytest
import torch

from slackswap_testkit.pipeline_run import run, same

pytestmark = [
    pytest.mark.skipif(not torch.distributed.is_available(),
                       reason="torch.distributed is not built in"),
    pytest.mark.skipif(os.environ.get("SLACKSWAP_SLOW") != "1",
                       reason="two ranks profile, plan and train twice: SLACKSWAP_SLOW=1"),
]


@pytest.mark.parametrize("family,schedule,per_rank,n_mb,budget,held,planner", [
    ("gpt", "GPipe", 1, 4, 300_000, [4, 4], "slackswap"),
    ("gpt", "GPipe", 1, 4, 400_000, [4, 4], "recompute-only"),
    ("gpt", "1F1B", 1, 4, 200_000, [2, 1], "slackswap"),
    # the runtime schedules keep what they send until the step ends (pipeline.SENDS)
    ("gpt", "Interleaved1F1B", 2, 4, 300_000, [5, 3], "slackswap"),
    ("llama", "1F1B", 1, 4, 230_000, [2, 1], "slackswap"),
    ("llama", "Interleaved1F1B", 2, 4, 480_000, [5, 3], "slackswap"),
])
def test_planned_pipeline_trains_exactly_within_its_peaks(family, schedule, per_rank, n_mb,
                                                          budget, held, planner, tmp_path):
    ranks = run(schedule, 2, n_mb, per_rank, budget, tmp_path, planner, family)
    off = []
    for rank, res in enumerate(ranks):
        row, plain, patched = res["row"], res["plain"], res["patched"]
        assert same(plain, patched), f"rank {rank}: the planned stages trained otherwise"
        assert row["held"] == plain["held"] == patched["held"] == held[rank]
        assert row["planned_peak_bytes"] <= budget
        # steps 2 and 3: the first step also allocates the stages' receive buffers
        keep, planned = max(plain["peaks"][1:]), max(patched["peaks"][1:])
        for what, predicted, measured in (("keep-all", row["keep_all_peak_bytes"], keep),
                                          ("planned", row["planned_peak_bytes"], planned)):
            if abs(measured / predicted - 1) > 0.05:
                off.append((rank, what, predicted, measured))
    first = ranks[0]["row"]
    assert first["keep_all_peak_bytes"] > budget                 # rank 0 had to be planned
    assert first["swapped_bytes"] + first["recomputed_bytes"] > 0
    assert not off, off


@pytest.mark.parametrize("family,schedule,per_rank,budget,held,link,planner,recomputes", [
    ("gpt", "GPipe", 1, 300_000, [4, 4], 1e8, "slackswap", True),
    ("gpt", "1F1B", 1, 200_000, [2, 1], 1e8, "slackswap", False),
    ("gpt", "Interleaved1F1B", 2, 300_000, [5, 3], None, "slackswap", False),
    ("llama", "1F1B", 1, 230_000, [2, 1], 1e8, "slackswap", False),
    ("llama", "Interleaved1F1B", 2, 480_000, [5, 3], None, "slackswap", False),
    ("hf-llama", "1F1B", 1, 280_000, [2, 1], 1e8, "slackswap", False),
    ("gpt", "GPipe", 1, 400_000, [4, 4], None, "recompute-only", True),
])
def test_a_pipeline_split_model_trains_exactly_within_its_peaks(family, schedule, per_rank,
                                                                 budget, held, link, planner,
                                                                 recomputes, tmp_path):
    """The same on models split by torch's `pipeline()` (slackswap_testkit/pipe_split_run.py:
    GPT-style, Llama-style, Hugging Face's LlamaForCausalLM), planned from the pipe and run
    through `pipe.build_stage`; at a slow host link (`link`) GPipe's plans swap and recompute
    (benchmarks/results/pipeline_split_ranks.md: the same cases)."""
    from slackswap_testkit.pipe_split_run import Case
    from slackswap_testkit.pipe_split_run import run as run_split
    ranks = run_split(Case(schedule, 2, 4, per_rank, budget, planner=planner, family=family,
                           link=link), tmp_path)
    off = []
    for rank, res in enumerate(ranks):
        row, plain, patched = res["row"], res["plain"], res["patched"]
        assert same(plain, patched), f"rank {rank}: the planned stages trained otherwise"
        assert row["held"] == plain["held"] == patched["held"] == held[rank]
        assert row["planned_peak_bytes"] <= budget
        keep, planned = max(plain["peaks"][1:]), max(patched["peaks"][1:])
        for what, predicted, measured in (("keep-all", row["keep_all_peak_bytes"], keep),
                                          ("planned", row["planned_peak_bytes"], planned)):
            if abs(measured / predicted - 1) > 0.05:
                off.append((rank, what, predicted, measured))
    first = ranks[0]["row"]
    assert first["keep_all_peak_bytes"] > budget
    assert first["swapped_bytes"] + first["recomputed_bytes"] > 0
    if recomputes:
        assert all(r["row"]["recomputed_bytes"] > 0 for r in ranks)
    assert not off, off
