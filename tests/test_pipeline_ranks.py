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
benchmarks/pipeline_ranks.py prints the same runs' per-rank table. One short run is in the
default suite: ZBVZeroBubble (a split backward: each weight pass a second backward through the
saved tensors) on two ranks, Hugging Face GPT-2 blocks with dropout 0.1, one block per stage,
planned without the eager measure and trained without tracking memory.
"""

import pytest
import torch

from slackswap_cli.run.parallel.pipeline import stage_buffers
from slackswap_testkit.pipeline_run import run, same

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(),
                                reason="torch.distributed is not built in")
slow = pytest.mark.slow_tier      # two ranks profile, plan and train twice (tests/conftest.py)
LINK = 5e7      # the host link planned for: plans recompute as well as swap (hardware_for)
# How far under its predicted peak a rank may measure: 5%, but 7% under InterleavedZeroBubble,
# whose rank 1 peaks at a weight pass, which rank_peak counts at the stage's own peak (the
# forward's and full backward's) where a weight pass holds its kept activations, the
# gradients it starts from and what it makes again: the prediction errs on the safe side.
UNDER = {"InterleavedZeroBubble": 0.07}


def test_split_backward_stages_train_exactly_swapping_and_recomputing(tmp_path):
    """ZBVZeroBubble's weight passes unpack the saved tensors a second time: fetched again
    from their host copies, made again, on Hugging Face GPT-2 blocks with dropout 0.1 (a
    chain through a dropout mask reads the mask the forward drew); bitwise as the unpatched
    pipeline over three steps, every rank holding the microbatches read from the schedule;
    its receive buffers, counted in its budget, as large as PipelineStage's."""
    ranks = run("ZBVZeroBubble", 2, 2, 2, 380_000, tmp_path, "slackswap", "gpt2", LINK,
                quick=True)
    for rank, res in enumerate(ranks):
        row, plain, patched = res["row"], res["plain"], res["patched"]
        assert same(plain, patched), f"rank {rank}: the planned stages trained otherwise"
        assert row["held"] == plain["held"] == patched["held"] == [3, 4][rank]
        assert row["planned_peak_bytes"] + row["recv_bytes"] <= 380_000 < \
            row["keep_all_peak_bytes"]
        if stage_buffers() == "reused":      # kept all step, beside the activation peak
            assert row["recv_bytes"] > 0 and patched["recv_bytes"] == row["recv_bytes"]
        else:                                # torch 2.15: counted with each microbatch
            assert row["recv_bytes"] == 0
    assert sum(r["row"]["swapped_bytes"] for r in ranks) > 0
    assert sum(r["row"]["recomputed_bytes"] for r in ranks) > 0


@slow
@pytest.mark.parametrize("family,schedule,per_rank,n_mb,budget,held,planner,link", [
    ("gpt", "GPipe", 1, 4, 300_000, [4, 4], "slackswap", None),
    ("gpt", "GPipe", 1, 4, 400_000, [4, 4], "recompute-only", None),
    ("gpt", "1F1B", 1, 4, 200_000, [2, 1], "slackswap", None),
    # the runtime schedules keep what they send until the step ends (pipeline.SENDS); the
    # budgets of two stages a rank hold their receive buffers too (48-64 KiB here)
    ("gpt", "Interleaved1F1B", 2, 4, 350_000, [5, 3], "slackswap", None),
    ("llama", "1F1B", 1, 4, 230_000, [2, 1], "slackswap", None),
    ("llama", "Interleaved1F1B", 2, 4, 530_000, [5, 3], "slackswap", None),
    # split backward: a pair holds its weight pass's gradients from I to W (Boundary.split)
    ("gpt", "ZBVZeroBubble", 2, 4, 546_000, [4, 4], "slackswap", LINK),
    ("gpt", "DualPipeV", 2, 4, 546_000, [5, 5], "slackswap", LINK),
    # (rank 1 measured 4.2% and 6.2% under its planned peak in two runs: see UNDER)
    ("gpt", "InterleavedZeroBubble", 2, 4, 530_000, [4, 4], "slackswap", LINK),
])
def test_planned_pipeline_trains_exactly_within_its_peaks(family, schedule, per_rank, n_mb,
                                                          budget, held, planner, link,
                                                          tmp_path):
    ranks = run(schedule, 2, n_mb, per_rank, budget, tmp_path, planner, family, link)
    off = _checked(ranks, held, budget, UNDER.get(schedule, 0.05))
    assert not off, off


@slow
@pytest.mark.parametrize("family,schedule,per_rank,budget,held", [
    ("gpt", "1F1B", 1, 110_000, [2, 1]),
    # peak alone: ranks 0 and 1 at least 294,944 and 225,296; with the hold 155,664, 155,648
    ("gpt", "Interleaved1F1B", 2, 220_000, [5, 3]),
])
def test_plans_for_what_a_microbatch_holds_in_flight_train_exactly(family, schedule, per_rank,
                                                                    budget, held, tmp_path):
    """A rank budget under what plans made for a microbatch's peak alone reach: 1F1B on two
    ranks, 4 microbatches, rank 0 holding 2; its stage planned at its floor for the peak
    alone holds 118,792 bytes with its receive buffers, planned for what a microbatch holds
    from its forward to its backward as well 81,928 (pipeline/inflight.py; both read from
    plan_pipeline's InfeasibleError below them). At 110,000 rank 0's plan holds: bitwise as
    unpatched, its measured peak within 5% of the predicted one and within 1.05x of the
    budget (`_checked`). The default suite's tests/test_pipeline_inflight.py plans the same
    two limits on a stage by hand."""
    ranks = run(schedule, 2, 4, per_rank, budget, tmp_path, "slackswap", family)
    off = _checked(ranks, held, budget)
    assert not off, off
    assert ranks[0]["row"]["held_fraction"] < 1.0       # its plan was made with a hold


@slow
@pytest.mark.parametrize("schedule,held", [
    ("ZBVZeroBubble", [4, 4]), ("DualPipeV", [5, 5]), ("InterleavedZeroBubble", [4, 4])])
def test_split_backward_schedules_train_gpt2_with_dropout_exactly(schedule, held, tmp_path):
    """Hugging Face GPT-2 blocks with dropout 0.1, two blocks a stage, two stages a rank:
    every split-backward schedule's weight passes make recomputed tensors again through the
    dropout masks the forward drew; bitwise as the unpatched pipeline over three steps, with
    plans that swap and recompute. (Memory is not asserted here: under ZBVZeroBubble these
    ranks measured 8-9% over their planned peak, docs/results.md.)"""
    ranks = run(schedule, 2, 4, 2, 700_000, tmp_path, "slackswap", "gpt2", LINK)
    for rank, res in enumerate(ranks):
        row, plain, patched = res["row"], res["plain"], res["patched"]
        assert same(plain, patched), f"rank {rank}: the planned stages trained otherwise"
        assert row["held"] == plain["held"] == patched["held"] == held[rank]
        assert row["planned_peak_bytes"] + row["recv_bytes"] <= 700_000 < \
            row["keep_all_peak_bytes"]
    assert all(r["row"]["swapped_bytes"] > 0 and r["row"]["recomputed_bytes"] > 0
               for r in ranks)


def _checked(ranks, held, budget, under=0.05) -> list:
    """Each rank bitwise as unpatched, holding `held[rank]` microbatches, planned under
    `budget` with its receive buffers; rank 0 had to be planned; the ranks whose measured
    peak (keep-all, planned) is more than 5% over or `under` below the predicted one, or
    whose measured planned peak with its receive buffers is over 1.05x the budget."""
    off = []
    for rank, res in enumerate(ranks):
        row, plain, patched = res["row"], res["plain"], res["patched"]
        assert same(plain, patched), f"rank {rank}: the planned stages trained otherwise"
        assert row["held"] == plain["held"] == patched["held"] == held[rank]
        assert row["planned_peak_bytes"] + row["recv_bytes"] <= budget
        # steps 2 and 3: the first step also allocates the stages' receive buffers
        keep, planned = max(plain["peaks"][1:]), max(patched["peaks"][1:])
        if planned + patched["recv_bytes"] > 1.05 * budget:
            off.append((rank, "planned with receive buffers", budget,
                        planned + patched["recv_bytes"]))
        for what, predicted, measured in (("keep-all", row["keep_all_peak_bytes"], keep),
                                          ("planned", row["planned_peak_bytes"], planned)):
            if not -under <= measured / predicted - 1 <= 0.05:
                off.append((rank, what, predicted, measured))
    first = ranks[0]["row"]
    # rank 0 had to be planned
    assert first["keep_all_peak_bytes"] + first["recv_bytes"] > budget
    assert first["swapped_bytes"] + first["recomputed_bytes"] > 0
    return off


@slow
@pytest.mark.parametrize("family,schedule,per_rank,budget,held,link,planner,recomputes", [
    ("gpt", "GPipe", 1, 300_000, [4, 4], 5e7, "slackswap", True),
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
    off = _checked(ranks, held, budget)
    if recomputes:
        # every rank's plans recompute as well as swap (GPipe at 5e7 B/s; at 1e8 whether a
        # rank recomputes varied with the load on the CPU-timed profiles: of five runs, two
        # recomputed on both ranks, two not on every rank, one on neither)
        got = [r["row"]["recomputed_bytes"] for r in ranks]
        assert all(got), got
    assert not off, off
