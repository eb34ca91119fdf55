"""Every pipeline stage priced as it is: `show --pp` and `simulate --pp` take one profile or
plan per stage (or the first's, a middle one's and the last's), `fit --pp --stage-arg`
profiles each stage (slackswap_cli/pipeline/step.py, pipeline/fit.py, cli/stage_files.py),
and `fit --pp` reports samples/s from the rank-level judge's step."""
import json

import orjson
import pytest
from helpers import assert_clean_error, hand_hw
from typer.testing import CliRunner
from workloads import ROOT

from slackswap_cli import schema
from slackswap_cli.fit import FitSettings, ModelFacts, ParamFact, sweep
from slackswap_cli.pipeline.fit import StageProfiles, row_maker
from slackswap_cli.pipeline.step import pipeline_figures
from slackswap_testkit.synthetic import chain_profile

MiB = 1 << 20
runner = CliRunner()


def run(*args):
    return runner.invoke(app_(), [str(a) for a in args])


def app_():
    from slackswap_cli.cli import app
    return app


def _stages():
    """A first stage of four layers making 1, 1, 1 and 2 MiB, a middle one of four 0.5 MiB,
    a last one of 2, 1, 1 and 1 MiB (each activation its layer's output; the loss reads the
    last)."""
    return (chain_profile(4, [MiB, MiB, MiB, 2 * MiB], name="first"),
            chain_profile(4, MiB // 2, name="middle"),
            chain_profile(4, [2 * MiB, MiB, MiB, MiB], name="last"))


@pytest.fixture
def ws(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name, prof in zip(("first", "middle", "last"), _stages()):
        schema.save(prof, tmp_path / f"{name}.profile.json")
        r = run("plan", f"{name}.profile.json", "--budget", "0.6", "-o", f"{name}.plan.json")
        assert r.exit_code == 0, r.stderr
    return tmp_path


def _pipeline(*args):
    r = run(*args, "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    return orjson.loads(r.stdout)["pipeline"]


PROFILES = ("first.profile.json", "middle.profile.json", "last.profile.json")
PLANS = ("first.plan.json", "middle.plan.json", "last.plan.json")


def test_each_stage_priced_as_its_own_profile_by_hand(ws):
    """GPipe, 3 ranks, 3 microbatches, keeping everything; every rank holds all 3. A stage's
    keep-all peak is its activations plus the 4-byte loss (first 5 MiB, middle 2, last 5),
    and it holds that between forward and backward (its output is saved, so nothing more).
    A backward adds its output (PipelineStage's: first 2 MiB, middle 0.5, last 1), the
    output's gradient received (not on the last stage) and its input's gradient sent back
    (not on the first: the previous stage's output). GPipe keeps each sent input gradient
    until its last backward. At the first backward: rank 0 3 x 5 + (2 + 2) = 19 MiB (+ 12
    bytes), rank 1 3 x 2 + (0.5 + 0.5 + 2) = 9 MiB (+ 12), rank 2 3 x 5 + (1 + 0.5) = 16.5
    MiB (+ 12); rank 1's later backwards hold less (9 MiB + 8, + 4: one stage fewer, 2 MiB
    more sent). (PipelineStage as torch 2.13 and 2.14 hold its buffers: `--buffers reused`.)"""
    ranks = _pipeline("show", *PROFILES, "--pp", 3, "--schedule", "GPipe",
                      "--microbatches", 3, "--buffers", "reused")["ranks"]
    assert [r["keep_all_peak_bytes"] for r in ranks] == [19 * MiB + 12, 9 * MiB + 12,
                                                         33 * MiB // 2 + 12]
    # priced as the middle stage alone: 3 x 2 + (0.5 + 0.5) on the ends, 3 x 2 + 1.5 between
    one = _pipeline("show", "middle.profile.json", "--pp", 3, "--schedule", "GPipe",
                    "--microbatches", 3, "--buffers", "reused")["ranks"]
    assert [r["keep_all_peak_bytes"] for r in one] == [7 * MiB + 12, 15 * MiB // 2 + 12,
                                                       7 * MiB + 12]


def test_three_files_are_the_first_the_middle_ones_and_the_last(ws):
    five = ("first.profile.json", *["middle.profile.json"] * 3, "last.profile.json")
    short = _pipeline("show", *PROFILES, "--pp", 5, "--microbatches", 5)
    assert short["ranks"] == _pipeline("show", *five, "--pp", 5, "--microbatches", 5)["ranks"]
    assert [r["held"] for r in short["ranks"]] == [5, 4, 3, 2, 1]


def test_simulate_prices_each_stage_under_its_own_plan(ws):
    """The per-rank table of three plans is pipeline_figures' of those plans on their
    profiles, PipelineStage's buffers held as the installed torch holds them; the step's
    stage times are each stage's (the last stage's backward differs)."""
    import torch

    from slackswap_cli.pipeline.step import buffers_of
    d = _pipeline("simulate", *PLANS, "--pp", 3, "--schedule", "1F1B", "--microbatches", 4,
                  "--rank-budget", "12MiB")
    assert d["buffers"] == buffers_of(torch.__version__)
    plans = [schema.load_plan(p) for p in PLANS]
    hw = schema.load_plan(PLANS[0]).hardware
    from slackswap_cli.hardware import HardwareSpec
    figs = pipeline_figures(list(_stages()), plans, "1F1B", 3, 4, rank_budget=12 * MiB,
                            copy_us_per_byte=1e6 / HardwareSpec.from_dict(hw, "t").d2h_bytes_per_s,
                            buffers=d["buffers"])
    assert [r["planned_peak_bytes"] for r in d["ranks"]] == [r.planned_peak_bytes
                                                             for r in figs.rows]
    assert [r["swapped_bytes"] + r["recomputed_bytes"] for r in d["ranks"]] == \
        [r.swapped_bytes + r.recomputed_bytes for r in figs.rows]
    assert d["step_us"] == pytest.approx(figs.step_us)
    keep = _pipeline("show", *PROFILES, "--pp", 3, "--schedule", "1F1B", "--microbatches", 4)
    assert all(r["planned_peak_bytes"] < k["keep_all_peak_bytes"]
               for r, k in zip(d["ranks"], keep["ranks"]))


@pytest.mark.parametrize("cmd,args,needle,hint,fixed", [
    ("show", ["first.profile.json", "last.profile.json", "--pp", 3], "2 stage profiles",
     "give 1", ["first.profile.json", "--pp", 3]),
    ("show", ["first.profile.json", "last.profile.json", "--pp", 4], "2 stage profiles",
     "or 3 (the first, the middle ones, the last)", [*PROFILES, "--pp", 4]),
    ("show", ["first.profile.json", "last.profile.json"], "for a pipeline's stages",
     "add --pp N", ["first.profile.json", "last.profile.json", "--pp", 2]),
    ("simulate", [*PLANS], "for a pipeline's stages", "add --pp N", [*PLANS, "--pp", 3]),
    ("show", ["first.profile.json", "middle.plan.json", "--pp", 2], "mix profiles and plans",
     "every stage's profile", ["first.profile.json", "middle.profile.json", "--pp", 2]),
    ("simulate", [*PLANS, "--pp", 3, "--trace", "t.json"], "--trace writes one plan's",
     "simulate one stage's plan", ["first.plan.json", "--trace", "t.json"]),
])
def test_stage_files_refused_with_a_hint_that_works(ws, cmd, args, needle, hint, fixed):
    r = run(cmd, *args)
    assert_clean_error(r, 2, needle)
    assert hint in r.stderr.split("Hint:", 1)[1]
    followed = run(cmd, *fixed)
    assert followed.exit_code == 0, followed.stderr


# one float32 parameter of 1 MiB that trains: AdamW keeps params, grads and two states: 4 MiB
FACTS = ModelFacts(params=(ParamFact(numel=MiB // 4, itemsize=4, dim0=MiB // 4,
                                     trainable=True, storage_bytes=MiB),))
BIG = ModelFacts(params=(ParamFact(numel=MiB // 2, itemsize=4, dim0=MiB // 2,
                                   trainable=True, storage_bytes=2 * MiB),))


def _settings(memory, hw=None, planner="slackswap", **flags):
    return FitSettings(hardware=hw or hand_hw(), memory_bytes=memory, reserve_bytes=MiB,
                       planner=planner,
                       pipeline=dict(dict.fromkeys(("pp", "schedule", "microbatches",
                                                    "stages_per_rank")), **flags))


def test_fit_prices_each_stage_with_its_own_static_memory():
    """1F1B, 3 ranks, 3 microbatches at 40 MiB: the last stage's parameters are twice the
    others' (8 MiB of static memory against 4), so its activation budget is 40 - 8 - 1 = 31
    MiB, the others' 35; every rank's peak is the per-stage table's under the stages' plans,
    and the row's figures are the judge's."""
    first, middle, last = _stages()
    got = {0: (first, FACTS), 1: (middle, FACTS), 2: (last, BIG)}
    stages = StageProfiles({s: (lambda batch, s=s: got[s]) for s in got})
    s = _settings(40 * MiB, pp=3, schedule="1F1B", microbatches=3)
    result = sweep([1], stages, s, row_maker=lambda s, prof: row_maker(s, prof, stages))
    row = result.rows[0]
    assert row["rank_budget_bytes"] == [35 * MiB, 35 * MiB, 31 * MiB]
    assert row["budget_bytes"] == 31 * MiB and row["static_bytes"] == 8 * MiB
    keep = pipeline_figures([first, middle, last], None, "1F1B", 3, 3)
    assert row["feasible"] and row["rank_held"] == [3, 2, 1]
    assert row["rank_peak_bytes"] == [r.keep_all_peak_bytes for r in keep.rows]
    judged = pipeline_figures([first, middle, last], None, "1F1B", 3, 3,
                              rank_budget={0: 35 * MiB, 1: 35 * MiB, 2: 31 * MiB},
                              hw=hand_hw())
    assert row["step_us"] == judged.judged_step_us
    assert row["samples_per_s"] == pytest.approx(3 / judged.judged_step_us * 1e6)


def test_fit_samples_per_s_come_from_the_judged_step():
    """A plan that swaps everything on a 1 GB/s link: the judge (copies on each rank's
    engines, issued in the schedule's idle windows) gives another step than the bubbles with
    each microbatch's own stalls; the row's step and samples/s are the judge's. (64 MiB: a
    middle rank's receive buffers, 8 microbatches' 1 MiB inputs and output gradients, count
    in its budget.)"""
    slow = hand_hw(d2h_bytes_per_s=1e9, h2d_bytes_per_s=1e9)
    s = _settings(64 * MiB, hw=slow, planner="swap-all", pp=4, schedule="1F1B",
                  microbatches=8)
    row = sweep([1], lambda batch: (chain_profile(6, act_bytes=MiB, fwd_us=100.0), FACTS), s,
                row_maker=row_maker).rows[0]
    assert row["feasible"]
    assert row["step_us"] == row["judged_step_us"] != row["bubble_step_us"]
    assert row["samples_per_s"] == pytest.approx(8 / row["judged_step_us"] * 1e6)
    assert row["samples_per_s"] != pytest.approx(8 / row["bubble_step_us"] * 1e6)


def test_fit_stage_arg_needs_a_pipeline(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    stage = str(ROOT / "examples" / "gpt_stage.py")
    r = run("fit", stage, "--batch", "1", "--stage-arg", "stage")
    assert_clean_error(r, 2, "--pp is not given")
    r = run("fit", stage, "--batch", "1", "--pp", "2", "--stage-arg", "stage", "--arg",
            "stage=1")
    assert_clean_error(r, 2, "picks the stage")


MEASURED = ROOT / "benchmarks" / "results" / "pipeline_ranks_1F1B_4_8_1_220000_slackswap.json"


@pytest.mark.slow_tier
def test_cli_first_and_last_ranks_within_5_percent_of_the_real_ranks(tmp_path):
    """The 4-rank 1F1B run on gloo ranks (benchmarks/pipeline_ranks.py 1F1B 4 8 1 220000
    slackswap: keep-all peaks measured on the unpatched ranks): `show --pp` with the four
    stages of examples/gpt_stage.py profiled puts every rank, the first (embeddings) and the
    last (head, loss) included, within 5% of the measured peak; priced as the middle stage
    alone, the last rank is off by more. The run was on torch 2.13 (`--buffers reused`,
    whichever torch prices it). Slow (four traces); the default suite's
    test_each_stage_priced_as_its_own_profile_by_hand covers the per-stage pricing."""
    from slackswap_cli.hardware import load_hardware
    from slackswap_cli.trace import profile_workload
    files = []
    for stage in range(4):
        prof = profile_workload(str(ROOT / "examples" / "gpt_stage.py"),
                                args={"stage": stage}, device="fake:cpu",
                                hardware=load_hardware("a100-pcie4"))
        files.append(tmp_path / f"s{stage}.profile.json")
        schema.save(prof, files[-1])
    measured = [r["keep_all_measured"] for r in json.loads(MEASURED.read_text())]
    each = _pipeline("show", *files, "--pp", 4, "--microbatches", 8, "--buffers",
                     "reused")["ranks"]
    errors = [r["keep_all_peak_bytes"] / m - 1 for r, m in zip(each, measured)]
    assert all(abs(e) < 0.05 for e in errors), errors
    one = _pipeline("show", files[1], "--pp", 4, "--microbatches", 8, "--buffers",
                    "reused")["ranks"]
    assert one[3]["keep_all_peak_bytes"] / measured[3] - 1 < -0.05
