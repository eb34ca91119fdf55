"""`slackswap simulate --pp` and `show --pp`: the per-rank table of a pipeline of stages like
the profile (slackswap_cli/pipeline/step.py), the step with the schedule's bubbles, and bad
pipeline options refused with a hint that works. Synthetic profiles: no torch."""
import orjson
import pytest
from helpers import assert_clean_error, run_torch_blocked
from typer.testing import CliRunner

from slackswap_cli import schema
from slackswap_cli.cli import app
from slackswap_cli.pipeline.step import timeline
from slackswap_testkit.synthetic import chain_profile

runner = CliRunner()
MiB = 1 << 20


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture
def ws(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    schema.save(chain_profile(6, act_bytes=MiB, fwd_us=100.0), tmp_path / "chain.profile.json")
    r = run("plan", "chain.profile.json", "--budget", "0.5", "-o", "chain.plan.json")
    assert r.exit_code == 0, r.stderr
    return tmp_path


def _pipeline(*args):
    r = run(*args, "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    return orjson.loads(r.stdout)["pipeline"]


def test_simulate_pp_prints_each_ranks_memory_and_the_bubbled_step(ws):
    """1F1B, 4 ranks, 8 microbatches of a stage taking 600 us forward and 1200 us backward:
    rank r holds 4 - r; uniform stages take (8 + 4 - 1) x 1800 us, each rank idle 3 x 1800.
    Each rank's receive buffers (a 1 MiB input and output gradient per microbatch) count in
    its budget beside its planned peak (as torch 2.13 and 2.14 hold them: --buffers reused)."""
    d = _pipeline("simulate", "chain.plan.json", "--pp", 4, "--schedule", "1F1B",
                  "--microbatches", 8, "--rank-budget", "18MiB", "--buffers", "reused")
    ranks = d["ranks"]
    assert [r["held"] for r in ranks] == [4, 3, 2, 1]
    assert d["keep_all_step_us"] == pytest.approx(11 * 1800)
    assert [r["idle_us"] for r in ranks] == pytest.approx([3 * 1800] * 4)
    keep = [r["keep_all_peak_bytes"] for r in ranks]
    planned = [r["planned_peak_bytes"] for r in ranks]
    assert keep == sorted(keep, reverse=True) and all(p < k for p, k in zip(planned, keep))
    assert [r["recv_bytes"] for r in ranks] == [8 * MiB, 16 * MiB, 16 * MiB, 8 * MiB]
    assert [r["fits"] for r in ranks] == [p + r["recv_bytes"] <= 18 * MiB
                                          for p, r in zip(planned, ranks)]
    assert not ranks[0]["fits"] and ranks[3]["fits"]
    # the judge's peak with copies in flight fits as a row does, its receive buffers counted
    assert [r["judged_fits"] for r in ranks] == [r["judged_peak_bytes"] + r["recv_bytes"]
                                                 <= 18 * MiB for r in ranks]
    assert all(r["swapped_bytes"] + r["recomputed_bytes"] > 0 for r in ranks)
    human = run("simulate", "chain.plan.json", "--pp", 4, "--microbatches", 8)
    assert human.exit_code == 0 and "Per rank: 1F1B, 4 ranks, 8 microbatches" in human.stdout
    # show --pp: the same table for the plan (the judge's figures aside: without a budget
    # copies back fill only what the rank holds anyway), keeping everything for the profile
    shown = _pipeline("show", "chain.plan.json", "--pp", 4, "--microbatches", 8, "--buffers",
                      "reused")["ranks"]
    judged = ("judged_peak_bytes", "exposed_copy_us", "judged_fits")
    assert [{k: v for k, v in r.items() if k not in judged} for r in shown] \
        == [{k: v for k, v in dict(r, budget_bytes=0, fits=True).items() if k not in judged}
            for r in ranks]
    prof = _pipeline("show", "chain.profile.json", "--pp", 4, "--microbatches", 8, "--buffers",
                     "reused")["ranks"]
    assert [r["planned_peak_bytes"] for r in prof] == keep


def test_the_buffers_are_priced_as_the_pipelines_torch_holds_them(ws):
    """1F1B, 4 ranks, 8 microbatches, keeping everything. Torch 2.15 (--buffers per-step)
    allocates each receive buffer in every step, held with its microbatch: no rank keeps one
    all step, and the last rank holds its 8 microbatches' 1 MiB input buffers with their
    losses to the step's end: its peak is torch 2.13's (--buffers reused) plus the 8 MiB
    2.13 keeps beside it. The judge, with no copies, peaks where the table does on every
    rank (outputs dropped at the next backward, buffers held by the running microbatch).
    Without --buffers: as the installed torch holds them."""
    import torch

    from slackswap_cli.pipeline.step import buffers_of
    args = ("show", "chain.profile.json", "--pp", 4, "--microbatches", 8)
    reused = _pipeline(*args, "--buffers", "reused")
    per_step = _pipeline(*args, "--buffers", "per-step")
    assert (reused["buffers"], per_step["buffers"]) == ("reused", "per-step")
    assert [r["recv_bytes"] for r in per_step["ranks"]] == [0, 0, 0, 0]
    last = reused["ranks"][3]
    assert last["recv_bytes"] == 8 * MiB
    assert per_step["ranks"][3]["keep_all_peak_bytes"] == last["keep_all_peak_bytes"] + 8 * MiB
    assert all(r["judged_peak_bytes"] == r["planned_peak_bytes"] for d in (reused, per_step)
               for r in d["ranks"])
    assert _pipeline(*args)["buffers"] == buffers_of(torch.__version__)
    human = run(*args, "--buffers", "per-step")
    assert human.exit_code == 0 and "allocated every step" in human.stdout


def test_without_torch_the_buffers_follow_the_profiles_torch(monkeypatch):
    """Where torch is not installed (a planning machine), the profile's torch decides."""
    from importlib import metadata
    from types import SimpleNamespace

    from slackswap_cli.cli.common import pipeline_buffers
    from slackswap_cli.errors import InputError
    from slackswap_cli.pipeline.step import buffers_of

    def absent(name):
        raise metadata.PackageNotFoundError(name)
    monkeypatch.setattr(metadata, "version", absent)
    made = SimpleNamespace(env={"torch_version": "2.15.0+cu132"})
    assert pipeline_buffers(None, made) == pipeline_buffers(None, [made]) == "per-step"
    assert pipeline_buffers(None, SimpleNamespace(env={"torch_version": "2.14.1"})) == "reused"
    assert pipeline_buffers(None, None) == "reused"
    assert pipeline_buffers("reused", made) == "reused"
    assert [buffers_of(v) for v in ("2.13.0", "2.15.0", "3.0")] == \
        ["reused", "per-step", "per-step"]
    with pytest.raises(InputError):
        buffers_of("nightly")


def test_interleaved_holds_more_and_gpipe_holds_every_microbatch(ws):
    inter = _pipeline("simulate", "chain.plan.json", "--pp", 4, "--schedule", "Interleaved1F1B",
                      "--microbatches", 8)
    assert [r["held"] for r in inter["ranks"]] == [11, 9, 7, 5]
    assert [r["stages"] for r in inter["ranks"]] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    gpipe = _pipeline("simulate", "chain.plan.json", "--pp", 2, "--schedule", "GPipe",
                      "--microbatches", 4)
    assert [r["held"] for r in gpipe["ranks"]] == [4, 4]


def test_timeline_by_hand():
    # GPipe, 2 ranks, 2 microbatches, F 1 us, B 2 us: rank 0 F0 F1 at 0-1, 1-2; rank 1 F0
    # 1-2, F1 2-3, B0 3-5, B1 5-7; rank 0 B0 5-7, B1 7-9
    from slackswap_cli.pipeline.orders import order
    step, busy = timeline(order("GPipe", 2, 2), 1.0, 2.0)
    assert step == 9.0 and busy == {0: 6.0, 1: 6.0}


@pytest.mark.parametrize("args,needle,hint,fixed", [
    (["--pp", 0], "at least 1 rank", "--pp 4", ["--pp", 4]),
    (["--pp", 4, "--schedule", "1f1b"], "unknown pipeline schedule", "--schedule 1F1B",
     ["--pp", 4, "--schedule", "1F1B"]),
    (["--pp", 4, "--schedule", "Zigzag"], "unknown pipeline schedule", "GPipe, 1F1B",
     ["--pp", 4, "--schedule", "GPipe"]),
    (["--pp", 4, "--schedule", "Interleaved1F1B", "--microbatches", 9], "rounds",
     "--microbatches 12", ["--pp", 4, "--schedule", "Interleaved1F1B", "--microbatches", 12]),
    (["--pp", 4, "--schedule", "1F1B", "--microbatches", 2], "at least 4 microbatches",
     "--microbatches 4", ["--pp", 4, "--schedule", "1F1B", "--microbatches", 4]),
    (["--microbatches", 8], "--pp is not given", "add --pp N",
     ["--pp", 4, "--microbatches", 8]),
    (["--pp", 2, "--rank-budget", "lots"], "--rank-budget", "--rank-budget 40GB",
     ["--pp", 2, "--rank-budget", "40GB"]),
    (["--pp", 2, "--buffers", "never"], "--buffers never", "--buffers per-step",
     ["--pp", 2, "--buffers", "per-step"]),
    (["--buffers", "reused"], "--pp is not given", "add --pp N",
     ["--pp", 4, "--buffers", "reused"]),
])
def test_bad_pipeline_options_are_refused_with_a_hint_that_works(ws, args, needle, hint, fixed):
    r = run("simulate", "chain.plan.json", *args)
    assert_clean_error(r, 2, needle)
    assert hint in r.stderr.split("Hint:", 1)[1]
    followed = run("simulate", "chain.plan.json", *fixed)
    assert followed.exit_code == 0, followed.stderr


def test_simulate_pp_runs_without_torch(ws):
    proc = run_torch_blocked("""
        from typer.testing import CliRunner
        from slackswap_cli.cli import app
        r = CliRunner().invoke(app, ["simulate", "chain.plan.json", "--pp", "4",
                                     "--microbatches", "8", "--json"])
        assert r.exit_code == 0, r.stdout + r.stderr
    """)
    assert proc.returncode == 0, proc.stderr


def test_simulate_pp_reports_the_rank_level_judge(ws):
    """Per rank the judge's peak with copies in flight and its exposed copy time, and the
    step with copies on each rank's engines: what pipeline_copies.judge says of the same
    stages (every stage the profile, the plan's copies on the plan's hardware)."""
    from slackswap_cli.hardware import HardwareSpec
    from slackswap_cli.pipeline.copies import judge, stage_work
    from slackswap_cli.pipeline.orders import order
    from slackswap_cli.pipeline.step import boundary_of
    d = _pipeline("simulate", "chain.plan.json", "--pp", 2, "--schedule", "GPipe",
                  "--microbatches", 4, "--rank-budget", "9MiB", "--buffers", "reused")
    prof = schema.load_profile("chain.profile.json")
    plan = schema.load_plan("chain.plan.json")
    hw = HardwareSpec.from_dict(plan.hardware, "the plan")
    work = {s: stage_work(prof, plan, hw, boundary_of(prof, s, 2, "gpipe")) for s in (0, 1)}
    # each rank's receive buffers (4 microbatches' 1 MiB input or output gradient) off its 9 MiB
    got = judge(order("GPipe", 2, 4), work, 9 * MiB, recv_bytes={0: 4 * MiB, 1: 4 * MiB})
    assert [r["recv_bytes"] for r in d["ranks"]] == [4 * MiB, 4 * MiB]
    assert d["judged_step_us"] == pytest.approx(got.step_us)
    assert d["judged_step_us"] >= d["keep_all_step_us"]
    assert [r["exposed_copy_us"] for r in d["ranks"]] == \
        pytest.approx([got.ranks[r].exposed_us for r in (0, 1)])
    assert [r["judged_peak_bytes"] for r in d["ranks"]] == [got.ranks[r].peak_bytes for r in (0, 1)]
    assert all(r["swapped_bytes"] > 0 for r in d["ranks"])
    human = runner.invoke(app, ["simulate", "chain.plan.json", "--pp", "2", "--microbatches", "4"],
                          env={"COLUMNS": "250"})
    assert "exposed copies/step" in human.stdout and "step (copies on each rank's engines)" \
        in human.stdout


@pytest.mark.parametrize("cmd", ["simulate", "show"])
def test_the_per_rank_table_reads_at_80_columns_and_piped(ws, cmd):
    """On 80 columns (and piped: no terminal, rich's 80) the per-rank table splits into
    tables of a few columns, each led by the rank: every header and every figure whole."""
    r = runner.invoke(app, [cmd, "chain.plan.json", "--pp", "4", "--microbatches", "8",
                            "--rank-budget", "9MiB"], env={"COLUMNS": "80"})
    assert r.exit_code == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert max(map(len, lines)) <= 80
    d = _pipeline(cmd, "chain.plan.json", "--pp", 4, "--microbatches", 8, "--rank-budget", "9MiB")
    for h in ("rank", "stages", "held", "budget", "keep-all peak", "planned peak",
              "swapped/step", "recomputed/step", "fraction", "idle/step", "swap copies/step",
              "peak w/ copies", "exposed copies/step"):
        assert f" {h} " in r.stdout, h
    for rank in d["ranks"]:
        row = next(x for x in lines if x.startswith("│") and x.split("│")[1].strip() ==
                   str(rank["rank"]) and "MiB" in x)
        assert row.split("│")[3].strip() == str(rank["held"])       # no column squeezed away
    assert "…" not in r.stdout


def _v_schedule_ranks(schedule: str) -> dict:
    """`simulate --pp 4` of a V schedule over 8 microbatches (chain.plan.json): rank r runs
    stages r and 7 - r and holds microbatches under its plan, every rank as busy as the
    others, at least 2 x 8 microbatches of 1800 us; the JSON document."""
    d = _pipeline("simulate", "chain.plan.json", "--pp", 4, "--schedule", schedule,
                  "--microbatches", 8, "--rank-budget", "40MiB")
    assert [r["stages"] for r in d["ranks"]] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert all(r["held"] > 0 and r["planned_peak_bytes"] < r["keep_all_peak_bytes"]
               for r in d["ranks"])
    busy = [d["step_us"] - r["idle_us"] for r in d["ranks"]]
    assert busy == pytest.approx([busy[0]] * 4) and busy[0] >= 2 * 8 * 1800
    return d


def test_zbv_zero_bubble_is_a_cli_schedule_as_torch_runs_it(ws):
    """ZBVZeroBubble (two stages a rank in a V, split backwards) through simulate --pp: the
    torch-free order is torch's (tests/test_pipeline.py), each rank runs stages r and
    2 pp - 1 - r, every rank as busy as the others (2 x 8 microbatches of at least 600 us
    forward and 1200 us backward: an input pass and a weight pass of half each) beside its
    bubbles; --stages-per-rank other than 2 is refused with the flag that fixes it."""
    d = _v_schedule_ranks("ZBVZeroBubble")
    assert d["keep_all_step_us"] >= 2 * 8 * 1800 and min(r["idle_us"] for r in d["ranks"]) > 0
    r = run("simulate", "chain.plan.json", "--pp", 4, "--schedule", "ZBVZeroBubble",
            "--stages-per-rank", 3)
    assert r.exit_code != 0 and "--stages-per-rank 2" in r.stdout + r.stderr


def test_dualpipev_is_a_cli_schedule_as_torch_runs_it(ws):
    """DualPipeV through simulate --pp and show --pp: the torch-free order is torch's
    (tests/test_pipeline.py), stages r and 2 pp - 1 - r on rank r, every rank as busy as the
    others (2 x 8 microbatches of 600 us forward and 1200 us backward, split or not); fewer
    than 2 pp microbatches refused with the flag that fixes it, as torch refuses them."""
    d = _v_schedule_ranks("DualPipeV")
    shown = _pipeline("show", "chain.plan.json", "--pp", 4, "--schedule", "DualPipeV",
                      "--microbatches", 8)["ranks"]
    assert [r["held"] for r in shown] == [r["held"] for r in d["ranks"]]
    r = run("simulate", "chain.plan.json", "--pp", 4, "--schedule", "DualPipeV",
            "--microbatches", 6)
    assert_clean_error(r, 2, "at least 8 microbatches")
    assert "--microbatches 8" in r.stderr.split("Hint:", 1)[1]
