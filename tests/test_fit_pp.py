"""`slackswap fit --pp`: a pipeline of stages like the workload, the batch its microbatch (
slackswap_cli/pipeline/fit.py). Per rank the static memory of its stages, the activation budget
left, the microbatches the schedule holds there; one plan of the stage that keeps every rank
under its budget; the step as the rank-level judge runs it. The pipeline a workload declares
(`Workload.pipeline`) read by fit and simulate, flags over it; bad values refused with a hint
that works."""
import re
import textwrap

import orjson
import pytest
from helpers import assert_clean_error, hand_hw
from typer.testing import CliRunner
from workloads import ROOT

from slackswap_cli import schema
from slackswap_cli.cli import app
from slackswap_cli.errors import InputError
from slackswap_cli.fit import FitSettings, ModelFacts, ParamFact, sweep
from slackswap_cli.pipeline.fit import row_maker
from slackswap_cli.pipeline.orders import PipelineSpec, pipeline_spec
from slackswap_cli.pipeline.step import pipeline_figures
from slackswap_testkit.synthetic import chain_profile

MiB = 1 << 20
runner = CliRunner()
# one float32 parameter of 1 MiB that trains: AdamW keeps params, grads and two states
FACTS = ModelFacts(params=(ParamFact(numel=MiB // 4, itemsize=4, dim0=MiB // 4,
                                     trainable=True, storage_bytes=MiB),))


def _stage(declared=None):
    prof = chain_profile(6, act_bytes=MiB, fwd_us=100.0)
    if declared is not None:
        prof.workload["pipeline"] = declared
    return prof


def _sweep(memory, declared=None, **flags):
    s = FitSettings(hardware=hand_hw(), memory_bytes=memory, reserve_bytes=MiB,
                    pipeline=dict(dict.fromkeys(("pp", "schedule", "microbatches",
                                                 "stages_per_rank")), **flags))
    return sweep([1], lambda batch: (_stage(declared), FACTS), s, row_maker=row_maker)


def test_each_rank_fits_its_budget_with_the_microbatches_it_holds():
    """1F1B, 4 ranks, 8 microbatches: rank r holds 4 - r microbatches; a rank's static memory
    is its stage's 4 MiB (params, grads, AdamW's two states), its budget 32 - 4 - 1 MiB, its
    receive buffers (a 1 MiB input and output gradient per microbatch: 8 MiB on the first
    and the last rank, 16 MiB between) counted in it. Keeping everything, rank 0 is over it:
    the plan evicts until every rank fits, and the step (11 slots of 600 + 1200 us, with 3
    idle per rank) gives 8 samples per step."""
    result = _sweep(32 * MiB, pp=4, schedule="1F1B", microbatches=8)
    row = result.rows[0]
    assert row["static_bytes"] == 4 * MiB and row["budget_bytes"] == 27 * MiB
    assert row["pipeline"] == {"schedule": "1F1B", "pp": 4, "microbatches": 8,
                               "stages_per_rank": 2, "buffers": "reused"}
    assert row["rank_held"] == [4, 3, 2, 1] and row["global_batch"] == 8
    assert row["rank_recv_bytes"] == [8 * MiB, 16 * MiB, 16 * MiB, 8 * MiB]
    keep = pipeline_figures(_stage(), None, "1F1B", 4, 8, 2, 27 * MiB)
    assert not keep.rows[0].fits and keep.rows[3].fits      # keeping everything: rank 0 over
    assert keep.rows[3].planned_peak_bytes <= 27 * MiB - 8 * MiB
    keep_row = result.baselines["keep-all"][0]
    assert not keep_row["feasible"] and "worst rank's peak" in keep_row["reason"]
    assert "receive buffers" in keep_row["reason"]
    assert row["feasible"] and all(p + r <= 27 * MiB for p, r in
                                   zip(row["rank_peak_bytes"], row["rank_recv_bytes"]))
    assert row["worst_rank_peak_bytes"] == max(row["rank_peak_bytes"]) == row["rank_peak_bytes"][0]
    plan = result.best_plan
    assert any(d.action.value != "keep" for d in plan.decisions)
    figs = pipeline_figures(_stage(), plan, "1F1B", 4, 8, 2, 27 * MiB)
    assert [r.planned_peak_bytes for r in figs.rows] == row["rank_peak_bytes"]
    assert row["bubble_step_us"] == figs.step_us >= 11 * 1800
    assert row["bubble_fraction"] == pytest.approx(sum(figs.idle_us.values()) / 4 / figs.step_us)
    # the rank-level judge's figures: the plan's copies on each rank's shared engines
    judged = pipeline_figures(_stage(), plan, "1F1B", 4, 8, 2, 27 * MiB, hw=hand_hw())
    assert row["rank_exposed_copy_us"] == [judged.exposed_us[r] for r in range(4)]
    assert row["rank_judged_peak_bytes"] == [judged.judged_peak_bytes[r] for r in range(4)]
    assert row["step_us"] == row["judged_step_us"] == judged.judged_step_us >= 11 * 1800
    assert row["samples_per_s"] == pytest.approx(8 / judged.judged_step_us * 1e6)


def test_fit_prices_the_buffers_as_the_pipelines_torch_holds_them():
    """The same sweep with torch 2.15's PipelineStage (`buffers="per-step"`, `fit --buffers
    per-step`): no receive buffer is kept all step (each allocated every step, held with its
    microbatch, in the ranks' peaks); the row's ranks are pipeline_figures' under the plan
    with the buffers so held, each under its 27 MiB. Keeping everything now fits: rank 0, 26
    MiB and 8 MiB of buffers with 2.13's, holds 25 MiB (no buffer kept; its backward without
    the 1 MiB output it sent, dropped once the send was waited), the last rank 16 (8 + its 8
    microbatches' 1 MiB input buffers, held with their losses to the step's end). A
    --buffers that is not one is refused before anything is traced."""
    from functools import partial
    s = FitSettings(hardware=hand_hw(), memory_bytes=32 * MiB, reserve_bytes=MiB,
                    pipeline=dict(pp=4, schedule="1F1B", microbatches=8, stages_per_rank=None))
    result = sweep([1], lambda batch: (_stage(), FACTS), s,
                   row_maker=partial(row_maker, buffers="per-step"))
    row = result.rows[0]
    assert row["pipeline"]["buffers"] == "per-step" and row["rank_recv_bytes"] == [0] * 4
    figs = pipeline_figures(_stage(), result.best_plan, "1F1B", 4, 8, 2, 27 * MiB,
                            buffers="per-step")
    assert row["feasible"] and row["rank_peak_bytes"] == [r.planned_peak_bytes
                                                          for r in figs.rows]
    assert max(row["rank_peak_bytes"]) <= 27 * MiB
    keep = pipeline_figures(_stage(), None, "1F1B", 4, 8, 2, 27 * MiB, buffers="per-step")
    assert [r.keep_all_peak_bytes // MiB for r in keep.rows] == [25, 23, 16, 16]
    assert all(r.fits for r in keep.rows) and result.baselines["keep-all"][0]["feasible"]
    r = runner.invoke(app, ["fit", str(ROOT / "examples" / "gpt_stage.py"), "--batch", "1",
                            "--pp", "2", "--buffers", "never"])
    assert_clean_error(r, 2, "--buffers never")


def test_buffers_without_a_pipeline_are_refused_with_a_hint_that_works():
    """`fit --buffers` describes a pipeline's buffers: with no --pp and no pipeline the
    workload declares, it is refused (not ignored) at the first profile, before anything is
    written; the hint's `--pp 4` makes the same sweep price a pipeline with those buffers,
    and without --buffers the plain sweep runs as before."""
    from functools import partial
    s = FitSettings(hardware=hand_hw(), memory_bytes=32 * MiB, reserve_bytes=MiB,
                    pipeline=dict(pp=None, schedule=None, microbatches=None,
                                  stages_per_rank=None))
    with pytest.raises(InputError) as e:
        sweep([1], lambda batch: (_stage(), FACTS), s,
              row_maker=partial(row_maker, buffers="per-step", buffers_given=True))
    assert "--buffers" in str(e.value) and "--pp 4 --buffers per-step" in e.value.hint
    plain = sweep([1], lambda batch: (_stage(), FACTS), s,
                  row_maker=partial(row_maker, buffers="reused"))
    assert "pipeline" not in plain.rows[0]
    s.pipeline["pp"] = 4        # the hint followed
    row = sweep([1], lambda batch: (_stage(), FACTS), s,
                row_maker=partial(row_maker, buffers="per-step", buffers_given=True)).rows[0]
    assert row["pipeline"]["buffers"] == "per-step" and row["pipeline"]["pp"] == 4


def test_interleaved_ranks_hold_two_stages_of_static_memory():
    """Interleaved1F1B, 2 stages per rank: each rank's static memory is two stages' (8 MiB)."""
    row = _sweep(40 * MiB, pp=2, schedule="Interleaved1F1B", microbatches=4).rows[0]
    assert row["static_bytes"] == 8 * MiB and row["budget_bytes"] == 31 * MiB
    assert row["feasible"] and row["pipeline"]["stages_per_rank"] == 2
    # 9 MiB: one stage's static memory and the reserve leave room, two stages' do not
    tight = _sweep(9 * MiB, pp=2, schedule="Interleaved1F1B", microbatches=4).rows[0]
    assert not tight["feasible"] and "a rank's static memory and reserve exceed" in tight["reason"]


def test_v_schedules_hold_two_stages_of_static_memory():
    """ZBVZeroBubble and DualPipeV run two stages a rank in a V: static memory of two stages,
    the step from their own order (pipeline/orders.py)."""
    for schedule in ("ZBVZeroBubble", "DualPipeV"):
        row = _sweep(40 * MiB, pp=2, schedule=schedule, microbatches=4).rows[0]
        assert row["static_bytes"] == 8 * MiB and row["budget_bytes"] == 31 * MiB, schedule
        assert row["feasible"] and row["pipeline"]["schedule"] == schedule
        figs = pipeline_figures(_stage(), None, schedule, 2, 4, 2)
        assert row["rank_held"] == [r.held for r in figs.rows]


def test_the_workload_declared_pipeline_and_flags_over_it():
    declared = {"pp": 2, "schedule": "GPipe", "microbatches": 4}
    row = _sweep(1 << 30, declared).rows[0]
    assert row["pipeline"] == {"schedule": "GPipe", "pp": 2, "microbatches": 4,
                               "stages_per_rank": 2, "buffers": "reused"}
    assert row["rank_held"] == [4, 4]                  # GPipe holds every microbatch
    over = _sweep(1 << 30, declared, microbatches=6).rows[0]
    assert over["pipeline"]["microbatches"] == 6 and over["global_batch"] == 6
    assert "pipeline" not in _sweep(1 << 30).rows[0]   # none declared, none given


@pytest.mark.parametrize("flags,declared,needle", [
    (dict(pp=0), None, "--pp 0"),
    (dict(pp=4, schedule="1F1B", microbatches=2), None, "at least 4 microbatches"),
    (dict(pp=4, schedule="DualPipeV", microbatches=6), None, "at least 8 microbatches"),
    (dict(pp=2, schedule="DualPipeV", stages_per_rank=3), None, "exactly 2 stages"),
    (dict(pp=2, schedule="1f1b"), None, "unknown pipeline schedule"),
    (dict(schedule="GPipe"), None, "--pp is not given"),
    ({}, {"pp": 4, "microbatches": 2}, "the workload declares"),
    ({}, {"pp": 4, "schedule": "Interleaved1F1B", "stages_per_rank": 1}, "at least 2 stages"),
])
def test_bad_pipeline_values_have_hints_that_work(flags, declared, needle):
    """Each refusal's hint, followed (its flag added), gives a pipeline that is accepted."""
    given = dict(dict.fromkeys(("pp", "schedule", "microbatches", "stages_per_rank")), **flags)
    with pytest.raises(InputError) as exc:
        pipeline_spec(**given, declared=declared)
    assert needle in exc.value.message, exc.value.message
    hint = exc.value.hint.replace("add --pp N (the pipeline's ranks), e.g. ", "")
    for flag, value in re.findall(r"--([a-z-]+) ([A-Za-z0-9]+)", hint):
        key = flag.replace("-", "_")
        given[key] = value if key == "schedule" else int(value)
    assert isinstance(pipeline_spec(**given, declared=declared), PipelineSpec)


@pytest.mark.parametrize("declared,needle", [
    ({"pp": 4, "chunks": 8}, "keys ['chunks']"),
    ({"schedule": "1F1B"}, "without pp"),
    ({"pp": "4"}, "not an integer"),
    ([4], "not a dict"),
])
def test_bad_declared_pipelines_are_refused(declared, needle):
    with pytest.raises(InputError, match=None) as exc:
        pipeline_spec(None, declared=declared)
    assert needle in exc.value.message and "pipeline=dict(" in exc.value.hint


def test_cli_fit_and_simulate_read_the_declared_pipeline(tmp_path, monkeypatch):
    """A workload returning Workload(..., pipeline=...): fit plans that pipeline, its profile
    records it, simulate of the written plan prints the per-rank table without --pp; bad
    flags are Error:/Hint: before any tracing."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "stage.py").write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT / "examples")!r})
        from gpt_stage import workload as stage
        from slackswap_cli import Workload

        def workload(batch=2):
            model, inputs, loss_fn = stage(batch=batch)
            return Workload(model, inputs, loss_fn,
                            pipeline=dict(pp=2, schedule="GPipe", microbatches=4))
        """))
    r = runner.invoke(app, ["fit", "stage.py", "--batch", "2", "--hardware", "a100-pcie4",
                            "--jobs", "1", "--json", "-q"])
    assert r.exit_code == 0, r.stdout + r.stderr
    row = orjson.loads(r.stdout)["best"]
    assert row["pipeline"]["schedule"] == "GPipe" and row["rank_held"] == [4, 4]
    import torch

    from slackswap_cli.pipeline.step import buffers_of
    assert row["pipeline"]["buffers"] == buffers_of(torch.__version__)    # the installed torch's
    assert 0 < row["bubble_fraction"] < 1 and row["worst_rank_peak_bytes"] > 0
    assert schema.load_profile(orjson.loads(r.stdout)["profile"]).workload["pipeline"] == {
        "pp": 2, "schedule": "GPipe", "microbatches": 4}
    r = runner.invoke(app, ["simulate", "stage.fit.plan.json", "--json"])
    assert r.exit_code == 0, r.stdout + r.stderr
    pipe = orjson.loads(r.stdout)["pipeline"]
    assert (pipe["schedule"], pipe["pp"], pipe["microbatches"]) == ("GPipe", 2, 4)
    assert [x["planned_peak_bytes"] for x in pipe["ranks"]] == row["rank_peak_bytes"]
    r = runner.invoke(app, ["simulate", "stage.fit.plan.json", "--microbatches", "6", "--json"])
    assert orjson.loads(r.stdout)["pipeline"]["microbatches"] == 6
    assert_clean_error(runner.invoke(app, ["fit", "stage.py", "--batch", "2", "--pp", "4",
                                           "--microbatches", "2"]), 2, "at least 4 microbatches")
