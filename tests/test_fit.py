"""`slackswap fit`: static memory exact to the byte against a real optimizer step (and per rank
under FSDP2 with two gloo ranks), the sweep's rows, the JSON shape, and the errors."""
import os
import socket
import sys
from pathlib import Path

import orjson
import pytest
import torch
from helpers import assert_clean_error
from typer.testing import CliRunner
from workloads import ROOT

from slackswap_cli.cli import app
from slackswap_cli.errors import InputError
from slackswap_cli.fit import ModelFacts, ParamFact, default_reserve, parse_batches, static_memory
from slackswap_cli.trace.joint import loss_from_output, split_inputs
from slackswap_cli.trace.static_memory import model_facts
from slackswap_cli.trace.workload import load_workload

OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3),
    "adamw-amsgrad": lambda ps: torch.optim.AdamW(ps, lr=1e-3, amsgrad=True),
    "adam-amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-3, amsgrad=True),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-3),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9),
    "none": None,
}


def _measured(model, opt) -> dict:
    """Bytes of parameters, gradients and optimizer state after a step, each storage once
    (counted from the live tensors, independently of fit's arithmetic)."""
    seen, out = set(), {"params": 0, "grads": 0, "optimizer": 0, "buffers": 0}

    def add(key, t):
        if isinstance(t, torch.Tensor):
            if hasattr(t, "to_local"):
                t = t.to_local()
            s = t.untyped_storage()
            if (s.data_ptr(), s.nbytes()) not in seen:
                seen.add((s.data_ptr(), s.nbytes()))
                out[key] += s.nbytes()
    for p in model.parameters():
        add("params", p)
    for b in model.buffers():
        add("buffers", b)
    for p in model.parameters():
        add("grads", p.grad)
    for state in (opt.state.values() if opt is not None else ()):
        for v in state.values():
            add("optimizer", v)
    return out


def _one_step(work, opt_name: str):
    model = work.model
    opt = OPTIMIZERS[opt_name](model.parameters()) if OPTIMIZERS[opt_name] else None
    a, kw = split_inputs(work.inputs)
    loss_from_output(model(*a, **kw), work.inputs, work.loss_fn).backward()
    if opt is not None:
        opt.step()
    return _measured(model, opt)


@pytest.mark.parametrize("name", ["tiny_gpt", "llama", "cnn", "gpt2"])
def test_static_memory_equals_a_real_optimizer_step_to_the_byte(files, name):
    """On CPU the step counters live on the device too (torch keeps them on the CPU), so the
    figures are fit's with step_on_device; gpt2 ties its head to the embedding."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    fake = load_workload(files[name], fake_mode=FakeTensorMode())
    facts = model_facts(fake.model, fake.inputs)     # what fit reads: the fake-tensor build
    for opt_name in OPTIMIZERS:
        work = load_workload(files[name])
        if name == "llama":       # a frozen parameter: no gradient, no state
            work.model.model.norm.weight.requires_grad_(False)
            facts = model_facts(work.model, work.inputs)
        else:
            assert model_facts(work.model, work.inputs) == facts
        got = _one_step(work, opt_name)
        st = static_memory(facts, opt_name, step_on_device=True)
        assert (st.params_bytes, st.grads_bytes, st.optimizer_bytes, st.buffers_bytes) == \
            (got["params"], got["grads"], got["optimizer"], got["buffers"]), (name, opt_name)
        assert st.params_bytes > 0 and (st.optimizer_bytes > 0) == (opt_name not in ("sgd", "none"))
    # the step counters are the only state that stays on the host by default
    n = sum(p.trainable for p in facts.params)
    assert (static_memory(facts, "adamw", step_on_device=True).optimizer_bytes
            - static_memory(facts, "adamw").optimizer_bytes) == 4 * n


def test_tied_weights_count_once(files):
    work = load_workload(files["gpt2"])
    m = work.model
    assert m.lm_head.weight is m.transformer.wte.weight
    facts = model_facts(m, work.inputs)
    assert facts.params and sum(p.storage_bytes for p in facts.params) == sum(
        p.numel() * p.element_size() for p in m.parameters())
    assert len(facts.params) == len(list(m.parameters())) < len(dict(m.state_dict()))


def test_shard_arithmetic_by_hand():
    # a (7, 3) fp32 weight in block h.0, a (5,) bias in h.1, a (4, 2) bf16 root embedding
    facts = ModelFacts(params=(ParamFact(21, 4, 7, True, 84, "h.0"),
                               ParamFact(5, 4, 5, True, 20, "h.1"),
                               ParamFact(8, 2, 4, False, 16, None)), buffers_bytes=12)
    st = static_memory(facts, "adamw", shard=2)
    assert st.params_bytes == 4 * 3 * 4 + 3 * 4 + 2 * 2 * 2      # ceil(7/2)=4 rows, ceil(5/2)=3, 2 rows
    assert st.grads_bytes == 4 * 3 * 4 + 3 * 4                   # the frozen root has none
    assert st.optimizer_bytes == 2 * st.grads_bytes              # step counters on the host
    assert st.unsharded_bytes == 16 + 2 * 84                     # root + twice the largest block
    assert static_memory(facts, "sgd").total == 84 + 20 + 16 + 84 + 20 + 12
    assert default_reserve(80 * 2**30) == 2**30 + 4 * 2**30


@pytest.mark.parametrize("text", ["", " , ", "0", "-1", "1.5", "two", "1,,x"])
def test_bad_batch_lists(text):
    with pytest.raises(InputError) as e:
        parse_batches(text)
    assert e.value.hint
    assert parse_batches("4, 1,4,16") == [1, 4, 16]


ODD = '''
import torch, torch.nn as nn
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(5, 9)
        self.blocks = nn.ModuleList([nn.Linear(9, 9), nn.Linear(9, 9), nn.Linear(9, 9)])
        self.head = nn.Linear(9, 3, bias=False)
    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x if x.shape[-1] == 9 else self.emb(x)))
        return self.head(x).pow(2).mean()
def workload(batch=4):
    torch.manual_seed(0)
    return Net(), (torch.randn(batch, 5),)
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


FSDP_CASES = [("odd", "adamw"), ("odd", "sgd-momentum"), ("llama", "adamw")]


def _fsdp_worker(rank, world, port, paths, out_dir):
    import torch.distributed as dist
    sys.path.insert(0, str(ROOT))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from torch.distributed.fsdp import fully_shard
        got = {}
        for name, opt_name in FSDP_CASES:
            work = load_workload(paths[name])
            blocks = getattr(work.model, "blocks", None) or work.model.model.layers
            for b in blocks:
                fully_shard(b)
            fully_shard(work.model)
            got[name, opt_name] = _one_step(work, opt_name)
        torch.save(got, Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_fsdp2_per_rank_bytes_equal_the_sharded_figures(tmp_path, files):
    """Dimensions of 9 and 3 rows over 2 ranks: FSDP2 pads rank 1's chunk to rank 0's; the
    Hugging Face Llama's dimensions split evenly."""
    path = tmp_path / "odd.py"
    path.write_text(ODD)
    paths = {"odd": str(path), "llama": str(files["llama"])}
    torch.multiprocessing.spawn(_fsdp_worker, args=(2, _free_port(), paths, str(tmp_path)),
                                nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for name, opt_name in FSDP_CASES:
        work = load_workload(paths[name])
        facts = model_facts(work.model, work.inputs)
        st = static_memory(facts, opt_name, shard=2, step_on_device=True)
        r0, r1 = ranks[0][name, opt_name], ranks[1][name, opt_name]
        assert (r0["params"], r0["grads"], r0["optimizer"]) == \
            (st.params_bytes, st.grads_bytes, st.optimizer_bytes), (name, opt_name)
        # rank 1: padded parameters and gradients alike; its optimizer state is its real chunk
        assert (r1["params"], r1["grads"]) == (st.params_bytes, st.grads_bytes)
        assert (r1["optimizer"] < st.optimizer_bytes) == (name == "odd")
        assert st.params_bytes < static_memory(facts, opt_name).params_bytes


def _fit(args):
    return CliRunner().invoke(app, ["fit", *args])


def test_fit_json_rows_best_and_baselines(tmp_path):
    out = tmp_path / "tg.plan.json"
    r = _fit([str(ROOT / "examples" / "tiny_gpt.py"), "--batch", "1,2,4", "--hardware",
              "a100-pcie4", "--memory", "40GiB", "--json", "-o", str(out)])
    assert r.exit_code == 0, r.output + r.stderr
    data = orjson.loads(r.stdout)
    keys = {"batch", "static_bytes", "params_bytes", "grads_bytes", "optimizer_bytes",
            "reserve_bytes", "budget_bytes", "keep_all_peak_bytes", "planner", "feasible",
            "retention", "step_us", "samples_per_s", "tokens_per_s"}
    assert [row["batch"] for row in data["rows"]] == [1, 2, 4]
    for row in data["rows"]:
        assert keys <= set(row)
        assert row["samples_per_s"] == pytest.approx(row["batch"] / row["step_us"] * 1e6)
        assert row["tokens_per_s"] == pytest.approx(row["samples_per_s"] * 32)   # seq 32
        assert row["budget_bytes"] == (40 * 2**30 - row["static_bytes"] - row["reserve_bytes"])
        assert row["static_bytes"] >= row["params_bytes"] + row["grads_bytes"] + row["optimizer_bytes"]
    assert data["best"] == max(data["rows"], key=lambda x: x["samples_per_s"])
    assert set(data["baselines"]) == {"keep-all", "checkpoint-layers", "torchtitan-sac",
                                      "megatron-selective", "recompute-only"}
    for name, b in data["baselines"].items():
        assert [row["planner"] for row in b["rows"]] == [name] * 3
        assert b["best"]["samples_per_s"] <= data["best"]["samples_per_s"]
    # the written plan and profile: the best batch, profiled directly at that batch
    from slackswap_cli.hardware import PRESETS
    from slackswap_cli.schema import load_plan, load_profile
    from slackswap_cli.trace import profile_workload
    plan, prof = load_plan(out), load_profile(tmp_path / "tg.profile.json")
    assert plan.profile_fingerprint == prof.fingerprint and plan.feasible
    assert prof.workload["args"] == {"batch": data["best"]["batch"]}
    direct = profile_workload(str(ROOT / "examples" / "tiny_gpt.py"),
                              args={"batch": data["best"]["batch"]}, device="fake",
                              hardware=PRESETS["a100-pcie4"])
    assert direct.fingerprint == prof.fingerprint
    assert direct.keep_all_peak_bytes == prof.keep_all_peak_bytes == data["best"]["keep_all_peak_bytes"]


def test_fit_tables_and_chart(tmp_path):
    r = _fit([str(ROOT / "examples" / "tiny_gpt.py"), "--batch", "1,2", "--optimizer", "sgd",
              "-o", str(tmp_path / "p.plan.json")])
    assert r.exit_code == 0, r.output + r.stderr
    for text in ("fit: slackswap on a100-pcie4", "Baselines", "samples/s against batch", "best: batch",
                 "checkpoint-layers", "torchtitan-sac", "megatron-selective", "recompute-only",
                 "keep-all", "wrote"):
        assert text in r.stdout, r.stdout
    assert "[2/2] batch 2" in r.stderr


def test_fit_errors_write_nothing(tmp_path, files):
    out = tmp_path / "x.plan.json"
    tg = str(ROOT / "examples" / "tiny_gpt.py")
    cases = [
        ([str(files["mlp"]), "--batch", "1,2"], "takes no argument 'batch'"),
        ([tg, "--batch", ""], "--batch is empty"),
        ([tg, "--batch", "0,2"], "not positive"),
        ([tg, "--batch", "1.5"], "not an integer"),
        ([tg, "--batch", "1", "--optimizer", "lion"], "unknown optimizer"),
        ([tg, "--batch", "1", "--memory", "1MiB", "--reserve", "0"], "exceeds the device"),
    ]
    for args, needle in cases:
        r = _fit([*args, "-o", str(out)])
        assert_clean_error(r, 2, needle)
        assert not out.exists() and not (tmp_path / "x.profile.json").exists()
    r = _fit([tg, "--batch", "1", "--memory", "1MiB", "--reserve", "0", "-o", str(out)])
    assert "--shard" in r.stderr


FLAKY = '''
import torch, torch.nn as nn
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
    def forward(self, x):
        return self.fc(x).relu().pow(2).mean()
def workload(batch=2):
    if batch == 3:
        raise RuntimeError("no batch of three here")
    torch.manual_seed(0)
    return Net(), (torch.randn(batch, 8),)
'''


def test_a_batch_whose_trace_fails_is_a_row_and_the_sweep_goes_on(tmp_path):
    path = tmp_path / "flaky.py"
    path.write_text(FLAKY)
    r = _fit([str(path), "--batch", "2,3,4", "--json", "-o", str(tmp_path / "f.plan.json")])
    assert r.exit_code == 0, r.output + r.stderr
    rows = orjson.loads(r.stdout)["rows"]
    assert [x["feasible"] for x in rows] == [True, False, True]
    assert "no batch of three here" in rows[1]["reason"]
    assert rows[1]["tokens_per_s"] is None and rows[0]["tokens_per_s"] is None   # no sequence


def test_checkpoint_layers_with_k1_checkpoints_every_block(files):
    from workloads import HW, profiled

    from slackswap_cli.planners import baselines
    prof = profiled(files, "gpt2")
    big = 10 * prof.keep_all_peak_bytes
    assert "no block checkpointed" in baselines.checkpoint_layers(prof, HW, big).notes[0]
    out = baselines.checkpoint_layers(prof, HW, big, k=1)
    assert out.notes[0].startswith("checkpointed 2 of 2 blocks")
    assert any(d.action == "recompute" for d in out.decisions)


@pytest.mark.parametrize("name", ["tiny_gpt", "gpt2", "llama", "bert", "cnn"])
def test_a_derived_profile_equals_the_direct_trace(files, name):
    """Traced at 2 and 4, derived at 8 and 3: every op, tensor, input shape and summary figure
    as a trace at that batch gives them (only the trace time differs)."""
    from slackswap_cli.hardware import PRESETS
    from slackswap_cli.profile_scale import derive
    from slackswap_cli.trace import profile_workload
    hw = PRESETS["h100-pcie5"]
    at = {b: profile_workload(str(files[name]), args={"batch": b}, device="fake", hardware=hw)
          for b in (2, 4, 8, 3)}
    for x in (8, 3):
        d = derive(at[2], 2, at[4], 4, x, hw)
        assert d is not None
        direct = at[x]
        assert (d.fingerprint, d.ops, d.tensors, d.workload, d.env) == \
            (direct.fingerprint, direct.ops, direct.tensors, direct.workload, direct.env)
        skip = {"profile_s", "derived_from_batches"}
        assert {k: v for k, v in d.summary.items() if k not in skip} == \
            {k: v for k, v in direct.summary.items() if k not in skip}
        assert d.summary["derived_from_batches"] == [2, 4]


QUADRATIC = '''
import torch, torch.nn as nn
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
    def forward(self, x):
        h = self.fc(x)
        return (h @ h.t()).relu().mean()      # (batch, batch): quadratic in the batch
def workload(batch=2):
    torch.manual_seed(0)
    return Net(), (torch.randn(batch, 8),)
'''


def test_derivation_refuses_a_step_quadratic_in_the_batch_and_fit_traces_it(tmp_path):
    from slackswap_cli.hardware import PRESETS
    from slackswap_cli.profile_scale import derive
    from slackswap_cli.trace import profile_workload
    path = tmp_path / "quad.py"
    path.write_text(QUADRATIC)
    hw = PRESETS["a100-pcie4"]
    pa, pb = (profile_workload(str(path), args={"batch": b}, device="fake", hardware=hw)
              for b in (2, 4))
    assert derive(pa, 2, pb, 4, 8, hw) is None
    r = _fit([str(path), "--batch", "2,4,8", "-o", str(tmp_path / "q.plan.json")])
    assert r.exit_code == 0, r.output + r.stderr
    assert "batch 8: profiling" in r.stderr and "derived" not in r.stderr   # status: people only


def test_fit_derives_after_two_traces_and_says_so(tmp_path):
    r = _fit([str(ROOT / "examples" / "tiny_gpt.py"), "--batch", "2,4,8,16", "--json",
              "-o", str(tmp_path / "t.plan.json")])
    assert r.exit_code == 0, r.output + r.stderr
    data = orjson.loads(r.stdout)
    assert [x["derived_from"] for x in data["rows"]] == [None, None, [2, 4], [2, 4]]
    assert "derived" not in r.stderr               # --json: no status lines; a person is told:
    told = _fit([str(ROOT / "examples" / "tiny_gpt.py"), "--batch", "2,4,8",
                 "-o", str(tmp_path / "told.plan.json")])
    assert "batch 8: derived from batches 2 and 4" in told.stderr
    each = _fit([str(ROOT / "examples" / "tiny_gpt.py"), "--batch", "2,4,8,16", "--json",
                 "--profile-each", "-o", str(tmp_path / "e.plan.json")])
    rows_each = orjson.loads(each.stdout)["rows"]
    assert [x["derived_from"] for x in rows_each] == [None] * 4
    # the same rows either way (the derived profiles are the traced ones)
    drop = lambda row: {k: v for k, v in row.items() if k != "derived_from"}
    assert [drop(x) for x in data["rows"]] == [drop(x) for x in rows_each]


def _with(args: list[str], option: str, value: str) -> list[str]:
    """`args` with `option` set to `value` (replaced where given, else added)."""
    out = list(args)
    if option in out:
        out[out.index(option) + 1] = value
    else:
        out += [option, value]
    return out


@pytest.mark.parametrize("given", [["--memory", "1MiB"],                     # the reserve alone
                                   ["--memory", "1079MiB"],                  # 777 KiB short
                                   ["--memory", "1MiB", "--reserve", "0"]])  # the model alone
def test_every_hint_fit_gives_for_static_memory_leaves_room(tmp_path, given):
    """Each value the hint names (--shard, --reserve, --memory) gets past the error when used."""
    import re
    args = [str(ROOT / "examples" / "tiny_gpt.py"), "--batch", "1", *given,
            "-o", str(tmp_path / "x.plan.json")]
    r = _fit(args)
    assert_clean_error(r, 2, "exceeds the device")
    hint = r.stderr.split("Hint:", 1)[1]
    followed = re.findall(r"(--shard|--reserve|--memory) (\d+(?:MiB)?)\b", hint)
    assert "--memory" in dict(followed)          # always offered: it always works
    if "--reserve" not in given:
        assert "reserve alone" in r.stderr or "--reserve" in dict(followed)
    for option, value in followed:
        again = _fit(_with(args, option, value))
        assert "exceeds the device" not in again.stderr, (option, value, again.stderr)
        assert again.exit_code != 2, (option, value, again.stderr)


def test_a_negative_batch_is_not_positive():
    with pytest.raises(InputError, match="'-1' is not positive"):
        parse_batches("1,-1")
    with pytest.raises(InputError, match="not an integer"):
        parse_batches("--1")
