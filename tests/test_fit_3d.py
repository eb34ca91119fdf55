"""`fit` and `simulate` with the three degrees together: `--pp`, `--fsdp` (the same as `--shard`) and `--tp`
(passed to the workload as `tp`: it builds one tensor parallel rank's local shard,
examples/llama_3d_stage.py). Per rank the static memory of the mesh (checked by hand against
the parameters of the local shard, and against what the 8-rank run of
slackswap_testkit/three_d_run.py measured) and the activation peak of each pipeline rank."""
import orjson
from helpers import assert_clean_error
from typer.testing import CliRunner
from workloads import ROOT

from slackswap_cli.cli import app
from slackswap_cli.fit import StaticMemory
from slackswap_cli.pipeline.fit import rank_static

runner = CliRunner()
STAGE = str(ROOT / "examples" / "llama_3d_stage.py")


def test_a_pipeline_ranks_fsdp2_static_holds_the_stage_unsharded():
    """Under a pipeline, FSDP2 keeps the stage's parameters unsharded and accumulates their
    unsharded gradients across the microbatches: twice the stage's parameters (each rank's
    chunk times the shard count), per stage the rank runs."""
    st = StaticMemory(params_bytes=100, grads_bytes=100, optimizer_bytes=200, buffers_bytes=8,
                      inputs_bytes=16, unsharded_bytes=7)
    assert rank_static(st, 1, 4).unsharded_bytes == 2 * 100 * 4
    assert rank_static(st, 2, 4).unsharded_bytes == 2 * 2 * 100 * 4
    assert rank_static(st, 2, 4).inputs_bytes == 16
    assert rank_static(st, 2).unsharded_bytes == 2 * 7                  # --shard 1: as given


def test_fit_and_simulate_take_pp_fsdp_and_tp_and_print_per_rank_static_and_activations(tmp_path,
                                                                             monkeypatch):
    """The first stage on 2 TP ranks: the token embedding (128 x 64) and two blocks of
    2 x 64 norms, q 32 x 64, k and v 16 x 64, o 64 x 32, gate and up 64 x 64, down 64 x 64:
    45312 float32 elements, 181248 bytes on a TP rank. FSDP2 over 2: 90624 bytes of
    parameters, 90624 of gradients, 181248 of AdamW state, 2 x 181248 unsharded (as the
    8-rank run measures, benchmarks/three_d_ranks.py), 2048 of rotary buffers and the
    batch's token ids (1 x 16 int64)."""
    monkeypatch.chdir(tmp_path)
    r = runner.invoke(app, ["fit", STAGE, "--pp", "2", "--fsdp", "2", "--tp", "2",
                            "--batch", "1", "--memory", "2MiB", "--reserve", "0",
                            "--jobs", "1", "--json", "-q"])
    assert r.exit_code == 0, r.stdout + r.stderr
    out = orjson.loads(r.stdout)
    row = out["best"]
    assert (out["shard"], out["tp"]) == (2, 2)
    assert row["static_bytes"] == 90624 + 90624 + 181248 + 2 * 181248 + 2048 + 16 * 8
    assert row["budget_bytes"] == 2 * 1024 * 1024 - row["static_bytes"]
    assert row["rank_held"] == [2, 1] and len(row["rank_peak_bytes"]) == 2
    assert all(0 < p <= row["budget_bytes"] for p in row["rank_peak_bytes"])
    r = runner.invoke(app, ["fit", STAGE, "--pp", "2", "--fsdp", "2", "--tp", "2",
                            "--batch", "1", "--memory", "2MiB", "--reserve", "0",
                            "--jobs", "1"], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.stdout + r.stderr
    assert "mesh pp 2 x fsdp 2 x tp 2 = 8 ranks" in " ".join(r.stdout.split())
    # simulate on the plan fit wrote: the same per-rank static memory from the profile's
    # parameters, the tp its workload was built at read from the profile
    r = runner.invoke(app, ["simulate", "llama_3d_stage.fit.plan.json", "--pp", "2",
                            "--fsdp", "2", "--json"])
    assert r.exit_code == 0, r.stdout + r.stderr
    pipe = orjson.loads(r.stdout)["pipeline"]
    assert pipe["static"]["total_bytes"] == row["static_bytes"]
    assert (pipe["static"]["tp"], pipe["static"]["ranks"]) == (2, 8)
    assert [x["planned_peak_bytes"] for x in pipe["ranks"]] == row["rank_peak_bytes"]
    r = runner.invoke(app, ["simulate", "llama_3d_stage.fit.plan.json", "--pp", "2",
                            "--fsdp", "2", "--tp", "2"], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.stdout + r.stderr
    assert "mesh pp 2 x fsdp 2 x tp 2 = 8 ranks): 710.12 KiB" in " ".join(r.stdout.split())
    bad = runner.invoke(app, ["simulate", "llama_3d_stage.fit.plan.json", "--pp", "2",
                              "--tp", "4"])
    assert_clean_error(bad, 2, "local shard at tp=2")
    assert_clean_error(runner.invoke(app, ["simulate", "llama_3d_stage.fit.plan.json",
                                           "--fsdp", "2"]), 2, "--pp is not given")


def test_tp_needs_a_workload_that_takes_it(tmp_path, monkeypatch):
    """A workload without `tp` is refused with a hint; leaving --tp out, as it says, fits."""
    monkeypatch.chdir(tmp_path)
    gpt = str(ROOT / "examples" / "gpt_stage.py")
    base = ["fit", gpt, "--pp", "2", "--batch", "1", "--memory", "4MiB", "--reserve", "0",
            "--jobs", "1", "--json", "-q"]
    r = runner.invoke(app, base + ["--tp", "2"])
    assert_clean_error(r, 2, "takes no `tp`")
    assert "leave --tp out" in r.stderr
    assert runner.invoke(app, base).exit_code == 0
    assert_clean_error(runner.invoke(app, base + ["--tp", "0"]), 2, "at least 1")
    assert_clean_error(runner.invoke(app, [*base, "--tp", "2", "--arg", "tp=2"]), 2,
                       "both give")
