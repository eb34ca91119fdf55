"""The rank-level judge (slackswap_cli/pipeline/copies.py): a schedule's actions with the
stages' swaps as copies on each rank's shared engines, by hand; and plans that spend the
schedule's idle windows on swaps (slackswap_cli/pipeline/windows.py). No torch."""
import pytest
from workloads import HW

from slackswap_cli.errors import InputError
from slackswap_cli.pipeline.copies import StageWork, Swap, judge, stage_work
from slackswap_cli.pipeline.orders import order as schedule_steps
from slackswap_cli.pipeline.stages import plan_stages, stage_cost
from slackswap_cli.pipeline.windows import Windows, faster_link
from slackswap_cli.planners import make_plan
from slackswap_testkit.synthetic import chain_profile

MiB = 1 << 20
TWO = {0: (("F", 0, 0), ("F", 0, 1), ("B", 0, 0), ("B", 0, 1))}   # one rank, 2 microbatches


def _stage(d2h=8.0, alone=10.0, **kw):
    """F 10 us, B 20 us; held 100 B between them (its swap out), 150 B at its forward's peak,
    200 B at its backward's with the swap back; one swap of 50 B made 2 us into the forward,
    read 5 us into the backward."""
    return StageWork(10.0, 20.0, 100, 150, 200, 0, (Swap(50, d2h, 8.0, 2.0, 5.0, alone),), **kw)


def test_copy_back_waits_for_memory_and_its_wait_is_exposed():
    """Budget 300 B. F0 0-10 (copy to host 2-10), F1 10-20 (12-20). Microbatch 0's copy back
    fits from F1's start (F1's 250 B + 50 = 300): 10-18, in before B0 reads it at 25.
    Microbatch 1's does not fit before B1 (B0's 300 B + 50): it is issued at B1's start, 40-48,
    and B1, reading it 5 us in, waits 3 us (exposed). Peak: F1, B0, 300 B."""
    w = {0: _stage()}
    got = judge(TWO, w, 300).ranks[0]
    assert (got.end_us, got.busy_us, got.exposed_us, got.peak_bytes) == (63.0, 60.0, 3.0, 300)
    assert (got.d2h_busy_us, got.h2d_busy_us) == (16.0, 16.0)
    # 400 B: microbatch 1's copy back goes at B0's start (20-28): nothing waits, peak 350 B
    more = judge(TWO, w, 400).ranks[0]
    assert (more.end_us, more.exposed_us, more.peak_bytes) == (60.0, 0.0, 350)
    # 250 B: neither goes early; B0 waits 3 us for its copy back (20-28), B1 3 more (43-51);
    # B0 with its copy back in and microbatch 1 held needs 300 B: over, and the judge says so
    tight = judge(TWO, w, 250).ranks[0]
    assert (tight.end_us, tight.exposed_us, tight.peak_bytes) == (66.0, 6.0, 300)


def test_receive_buffers_take_their_room_off_the_budget_and_count_in_the_fit():
    """A rank whose receive buffers hold 100 B all step (torch 2.13's PipelineStage): at a
    400 B budget its copies back may fill 300 B, as at 300 B without them: microbatch 1's
    copy back waits for B1's start, B1 waits 3 us, peak 300 B; with the buffers, 400 B: it
    fits. At 350 B the copies fill 250 B (as at 250 without buffers: both late, 6 us
    exposed); its peak, 300 B, and the buffers are 50 B over: it does not fit."""
    w = {0: _stage()}
    got = judge(TWO, w, 400, recv_bytes={0: 100}).ranks[0]
    alone = judge(TWO, w, 300).ranks[0]
    assert (got.end_us, got.exposed_us, got.peak_bytes) == (alone.end_us, 3.0, 300)
    assert got.fits and (got.budget_bytes, got.recv_bytes) == (400, 100)
    tight = judge(TWO, w, 350, recv_bytes={0: 100}).ranks[0]
    assert (tight.exposed_us, tight.peak_bytes) == (6.0, 300) and not tight.fits
    # without buffers 350 B fits: microbatch 1's copy back goes at B0's start (peak 350 B)
    free = judge(TWO, w, 350).ranks[0]
    assert free.fits and (free.exposed_us, free.peak_bytes) == (0.0, 350)


def test_an_output_released_at_the_next_backward_is_not_held_there():
    """Torch 2.15's PipelineStage under GPipe and 1F1B drops a sent output once its send is
    waited, before the rank's next backward: F0 150 B; F1 100 + 150 = 250; at B0 microbatch
    1 holds 100 - 30 (its 30 B output gone) beside B0's 200: 270 B, where a held output
    gives 300."""
    keep = {0: StageWork(10.0, 20.0, 100, 150, 200)}
    dropped = {0: StageWork(10.0, 20.0, 100, 150, 200, released_bytes=30)}
    assert judge(TWO, keep).ranks[0].peak_bytes == 300
    assert judge(TWO, dropped).ranks[0].peak_bytes == 270


def test_a_copy_held_up_by_the_previous_microbatchs_counts_at_the_peak():
    """Copies to host of 12 us: microbatch 0's 2-14, microbatch 1's waits for the engine,
    14-26. Without a budget the copies back go at their backward's start (20-28, 43-51): each
    backward waits 3 us. B0 starts at 23 with microbatch 1's tensor still on its way to host
    (until 26): 100 + 50 held, 200 its own: 350 B, where a copy done on time would give 300."""
    got = judge(TWO, {0: _stage(d2h=12.0, alone=14.0)}).ranks[0]
    assert (got.peak_bytes, got.exposed_us, got.end_us) == (350, 6.0, 66.0)


def test_bubbles_hide_a_copy_back_that_back_to_back_actions_expose():
    """GPipe, 2 ranks, 2 microbatches, F 1 us, B 2 us; stage 0 swaps 5 B with 2 us copies,
    budget 45 B. Copies to host 0.5-2.5 and 2.5-4.5; microbatch 0's copy back 2.5-4.5,
    microbatch 1's issued at B0's start. With the bubble B0 starts at 5 (after rank 1's B0,
    3-5), microbatch 1's copy back runs 5-7: nothing waits, step 9 as without copies. Back
    to back (`alone`) B0 would start at 2 and waits until 4.5, then B1 runs 6.5-8.5."""
    sw = (Swap(5, 2.0, 2.0, 0.5, 0.0, 2.5),)
    work = {0: StageWork(1.0, 2.0, 10, 20, 30, 0, sw), 1: StageWork(1.0, 2.0, 10, 20, 30)}
    steps = schedule_steps("GPipe", 2, 2)
    got = judge(steps, work, 45)
    assert got.step_us == 9.0 and got.ranks[0].exposed_us == 0.0
    assert got.ranks[1].end_us == 7.0 and got.ranks[1].busy_us == 6.0
    back_to_back = judge({0: steps[0]}, work, 45, alone=True).ranks[0]
    assert (back_to_back.exposed_us, back_to_back.end_us) == (2.5, 8.5)
    # with only what the rank needs anyway (no budget: 35 B), both copies back wait for their
    # backward's start (5-7, 9-11): each backward waits 2 us, the step takes 13
    got = judge(steps, work)
    assert (got.step_us, got.ranks[0].exposed_us, got.ranks[0].peak_bytes) == (13.0, 4.0, 40)


def _chain(act=4 * MiB):
    return chain_profile(6, act_bytes=act, fwd_us=100.0)


def test_stage_work_reads_the_stage_run_alone():
    prof = _chain()
    keep = stage_work(prof, None, HW)
    assert (keep.fwd_us, keep.bwd_us, keep.swaps) == (600.0, 1200.0, ())
    assert keep.fwd_peak_bytes == prof.keep_all_peak_bytes
    plan = make_plan("swap-all", prof, HW, prof.keep_all_peak_bytes // 2)
    w = stage_work(prof, plan, HW)
    swapped = [d.tensor for d in plan.decisions if d.action == "swap"]
    assert len(w.swaps) == len(swapped) and sum(s.bytes for s in w.swaps) == \
        sum(prof.tensors[t].size_bytes for t in swapped)
    assert w.held_bytes == stage_cost(prof, plan).held_bytes
    # 4 MiB copies take 171 us against 100 us ops; with every copy back in at its start, the
    # backward takes 1200 us
    assert w.bwd_us == 1200.0
    assert all(s.ready_us <= s.alone_us - s.d2h_us + 1e-6 for s in w.swaps)
    assert w.fwd_us == 600.0 and w.fwd_waits[0] > 600.0    # alone it waits for memory


def test_windows_swap_more_than_a_stage_alone_and_the_judge_keeps_the_budget():
    """1F1B on 2 ranks, 4 microbatches; a stage of 6 ops of 50 us, each making 3 MiB (a copy:
    130 us, more than the op after it). Planned for the stage alone, rank 0's stage swaps 3 MiB
    a microbatch and recomputes 3 (150 us of recompute a step); planned as on a link twice as
    fast it swaps 6 and recomputes nothing, and the judge (the real link) keeps the rank under
    its budget: it exposes 182 us of copy time where the recomputes cost more, and with the
    schedule's bubbles the step is 28 us shorter."""
    prof = chain_profile(6, act_bytes=3 * MiB, fwd_us=50.0)
    profiles = {0: prof, 1: prof}
    steps = schedule_steps("1F1B", 2, 4)
    budget = int(0.7 * 2 * stage_cost(prof).held_bytes)

    def planner(prof, b, hw=HW):
        return make_plan("slackswap", prof, hw, b)
    alone = plan_stages(steps, profiles, budget, None, windows=Windows(planner, HW, (1,)))
    win = plan_stages(steps, profiles, budget, None, windows=Windows(planner, HW))
    a0, w0 = alone.rows[0], win.rows[0]
    assert (a0.swapped_bytes, a0.recomputed_bytes) == (12 * MiB, 12 * MiB)     # 4 microbatches
    assert (w0.swapped_bytes, w0.recomputed_bytes) == (24 * MiB, 0)
    assert w0.planned_peak_bytes <= budget and w0.exposed_copy_us == pytest.approx(182.4, abs=1)
    assert w0.link_factor == 2.0 and any("copy link x2" in n for n in win.plans[0].notes)
    assert win.plans[0].hardware["d2h_bytes_per_s"] == 2 * HW.d2h_bytes_per_s
    assert alone.rows[1].link_factor == 1.0 and win.plans[1] is None   # rank 1 keeps all

    def judged(table):
        work = {s: stage_work(profiles[s], table.plans[s], HW) for s in profiles}
        return judge(steps, work, budget)
    assert judged(alone).step_us - judged(win).step_us == pytest.approx(28.4, abs=0.5)
    assert all(r.peak_bytes <= budget for r in judged(win).ranks.values())
    # the plain search (peaks as `rank_peak` counts them) makes the same plans as factor 1
    plain = plan_stages(steps, profiles, budget, planner)
    assert plain.rows[0].recomputed_bytes == a0.recomputed_bytes


def test_window_factors_are_checked():
    with pytest.raises(InputError, match="above 0"):
        Windows(None, HW, (0.0, 2.0))
    assert faster_link(HW, 1.0) is HW
    fast = faster_link(HW, 2.0)
    assert fast.d2h_bytes_per_s == 2 * HW.d2h_bytes_per_s and "x2" in fast.name
