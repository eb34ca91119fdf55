"""The library face: `plan_model`, `patch`, `compile`, `Plan.save` and the Hugging
Face Trainer callback, from a training script, on the CPU (fake tensors and device="cpu")."""
import json
import re
import sys

import pytest
import torch
from helpers import two_us_kernels
from typer.testing import CliRunner
from workloads import ROOT, adamw_steps, token_dataset

import slackswap_cli as slackswap
from slackswap_cli.cli import app
from slackswap_cli.errors import InfeasibleError, InputError, SlackswapError, TraceError
from slackswap_cli.trace.workload import load_workload


@pytest.fixture(autouse=True)
def _costs(monkeypatch):
    two_us_kernels(monkeypatch)   # plans that recompute as well as swap (see helpers)


TINY_GPT = ROOT / "examples" / "tiny_gpt.py"


def _state(model):
    return ([(n, p.detach().clone(), p.requires_grad, p.grad) for n, p in model.named_parameters()],
            [b.detach().clone() for b in model.buffers()])


def _same_state(model, state):
    params, buffers = state
    now = dict(model.named_parameters())
    return (all(torch.equal(now[n], v) and now[n].requires_grad == r and now[n].grad is g
                for n, v, r, g in params)
            and all(torch.equal(b, v) for b, v in zip(model.buffers(), buffers)))


_train = adamw_steps


def _twins(path, **args):
    a, b = load_workload(str(path), args=args), load_workload(str(path), args=args)
    b.model.load_state_dict(a.model.state_dict())
    return a, b


def test_planning_leaves_the_model_rng_and_disk_as_they_were(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    work = load_workload(str(TINY_GPT))
    state, rng = _state(work.model), torch.get_rng_state()
    for device in ("auto", "cpu"):
        plan = slackswap.plan_model(work.model, work.inputs, budget=0.5, device=device)
        assert _same_state(work.model, state) and torch.equal(torch.get_rng_state(), rng)
        assert plan.feasible and plan.budget_bytes == plan.profile.keep_all_peak_bytes // 2
    assert plan.profile.env["device"] == "cpu" and plan.profile.summary["time_source"] == "measured"
    assert list(tmp_path.iterdir()) == []
    from slackswap_cli.run.eager.inplace import is_patched
    assert not is_patched(work.model)


def test_a_measured_cpu_trace_undoes_batchnorm_statistics(files):
    work = load_workload(str(files["cnn"]))
    state = _state(work.model)
    slackswap.plan_model(work.model, work.inputs, budget=0.6, device="cpu")
    assert _same_state(work.model, state)


@pytest.mark.parametrize("name,budget", [("tiny_gpt", "0.5"), ("llama", "0.4")])
def test_plan_model_and_save_give_the_cli_plan(name, budget, files, tmp_path):
    cli = CliRunner()
    r = cli.invoke(app, ["profile", str(files[name]), "--device", "fake:cpu", "-q",
                         "-o", str(tmp_path / "cli.profile.json")])
    assert r.exit_code == 0, r.output
    r = cli.invoke(app, ["plan", str(tmp_path / "cli.profile.json"), "--budget", budget, "-q",
                         "-o", str(tmp_path / "cli.plan.json")])
    assert r.exit_code == 0, r.output
    work = load_workload(str(files[name]))
    plan = slackswap.plan_model(work.model, work.inputs, budget=budget)
    assert plan.save(tmp_path / "api.plan.json") == (str(tmp_path / "api.plan.json"),
                                                      str(tmp_path / "api.profile.json"))
    ours, theirs = (json.loads((tmp_path / f).read_text()) for f in ("api.plan.json",
                                                                     "cli.plan.json"))
    assert ours["decisions"] == theirs["decisions"] and ours["schedule"] == theirs["schedule"]
    assert ours["profile_fingerprint"] == theirs["profile_fingerprint"]
    assert ours["budget_bytes"] == theirs["budget_bytes"]
    plan_file = str(tmp_path / "api.plan.json")
    for args in (["show", plan_file], ["simulate", plan_file, "-q"],
                 ["compare", str(tmp_path / "api.profile.json"), "--budget", budget, "-q",
                  "--planners", "slackswap,swap-all"],
                 ["apply", plan_file, "--model", str(files[name]), "-q",
                  "-o", str(tmp_path / "patched.py")]):
        r = cli.invoke(app, args)
        assert r.exit_code == 0, (args, r.output)


def test_patched_model_trains_bitwise_like_eager(tmp_path):
    eager, work = _twins(TINY_GPT)
    plan = slackswap.plan_model(work.model, work.inputs, budget=0.3)
    assert plan.actions()["keep"] < len(plan.profile.saved_activations)
    want = _train(eager.model, eager)
    assert slackswap.patch(work.model, plan) is work.model
    got = _train(work.model, work)
    assert got[0] == want[0] and all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
    assert work.model.forward.__slackswap__.last_run.rerun_ops > 0
    import pickle

    from slackswap_cli.run.eager.inplace import is_patched
    assert is_patched(pickle.loads(pickle.dumps(work.model)))    # torch.save(model) keeps it
    with pytest.raises(InputError, match="already patched"):
        slackswap.plan_model(work.model, work.inputs, budget=0.5)
    assert slackswap.unpatch(work.model) is work.model
    assert slackswap.plan_model(work.model, work.inputs, budget=0.5).feasible


def test_loss_fn_and_compile_with_aot_eager_train_like_eager():
    eager, work = _twins(TINY_GPT, dropout=0.0)
    model, (idx, targets) = work.model, work.inputs
    want = _train(eager.model, eager, steps=2)
    plan = slackswap.plan_model(model, {"idx": idx, "targets": targets}, budget=0.4,
                                loss_fn=lambda out, inputs: out * 1.0)
    assert plan.feasible
    compiled = slackswap.compile(model, plan, backend="aot_eager")
    assert compiled._slackswap_partitions
    got = _train(compiled, work, steps=2)
    assert got[0] == want[0]


def test_a_loss_fn_model_replans_at_another_batch_with_that_loss_fn():
    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(4))
            self.head = torch.nn.Linear(16, 10)

        def forward(self, x):
            for fc in self.fc:
                x = torch.tanh(fc(x))
            return self.head(x)

    def loss_fn(out, inputs):
        return torch.nn.functional.cross_entropy(out, inputs[1])

    torch.manual_seed(0)
    eager, model = Logits(), Logits()
    model.load_state_dict(eager.state_dict())
    plan = slackswap.plan_model(model, (torch.randn(64, 16),), budget=0.6,
                                loss_fn=lambda out, inputs: out.logsumexp(-1).mean())
    slackswap.patch(model, plan)
    x, y = torch.randn(5, 16), torch.randint(0, 10, (5,))      # another batch: re-planned
    for m in (eager, model):
        loss_fn(m(x), (x, y)).backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(eager.parameters(), model.parameters()))
    assert len(model.forward.__slackswap__.sigs.plans) >= 2


def test_errors_are_slackswap_errors_with_hints():
    work = load_workload(str(TINY_GPT))
    cases = [
        (dict(budget="auto"), InputError, "needs a CUDA device"),
        (dict(budget="2"), InfeasibleError, "floor"),
        (dict(budget="half"), InputError, "cannot read budget"),
        (dict(budget=0.5, planner="nope"), InputError, "unknown planner"),
        (dict(budget=0.5, device="cuda"), InputError, "parameters are on cpu"),
        (dict(budget=0.5, device="gpu"), InputError, "unknown device"),
    ]
    for kwargs, kind, needle in cases:
        with pytest.raises(kind) as e:
            slackswap.plan_model(work.model, work.inputs, **kwargs)
        assert needle in e.value.message + (e.value.hint or ""), (kwargs, e.value.message)
        assert e.value.hint, kwargs
    with pytest.raises(InfeasibleError) as e:
        slackswap.plan_model(work.model, work.inputs, budget="2")
    assert not e.value.plan.feasible and "--" not in e.value.hint
    with pytest.raises(InputError, match="inputs without any tensor"):
        slackswap.plan_model(work.model, (1, 2), budget=0.5)
    with pytest.raises(InputError, match="takes the Plan"):
        slackswap.patch(work.model, "plan.json")


def test_a_model_that_cannot_be_traced_says_so():
    class Broken(torch.nn.Module):
        def __init__(self, how):
            super().__init__()
            self.fc, self.how = torch.nn.Linear(4, 4), how

        def forward(self, x):
            if self.how == "values":     # fake tensors have none
                return self.fc(x).sum() if x.sum() > 0 else self.fc(x).mean()
            return self.fc(x) if self.how == "no loss" else self.fc(x[:, :3]).sum()

    cases = [("values", "auto"), ("no loss", "auto"), ("no loss", "cpu"), ("shapes", "auto"),
             ("shapes", "cpu")]
    for how, device in cases:
        with pytest.raises(SlackswapError) as e:
            slackswap.plan_model(Broken(how), (torch.ones(2, 4),), budget=0.5, device=device)
        assert isinstance(e.value, TraceError) and e.value.hint, (how, device, e.value)
        assert "Traceback" not in e.value.message


def test_budget_from_the_device_arithmetic():
    from slackswap_cli.fit import StaticMemory, default_reserve, device_budget
    from slackswap_cli.run.api import optimizer_name
    from slackswap_cli.units import GIB
    static = StaticMemory(10 * GIB, 10 * GIB, 20 * GIB, 0, 0, 0)
    total = 80 * GIB
    # nobody else on the device: fit's arithmetic
    assert device_budget(total, 30 * GIB, 50 * GIB, static) == 40 * GIB - default_reserve(total)
    # another process holds 5 GiB
    assert device_budget(total, 25 * GIB, 50 * GIB, static) == 35 * GIB - default_reserve(total)
    lin = torch.nn.Linear(2, 2)
    assert optimizer_name(torch.optim.AdamW(lin.parameters())) == ("adamw", False)
    assert optimizer_name(torch.optim.Adam(lin.parameters(), amsgrad=True))[0] == "adam-amsgrad"
    assert optimizer_name(torch.optim.SGD(lin.parameters(), momentum=0.9))[0] == "sgd-momentum"
    assert optimizer_name("sgd") == ("sgd", False)
    with pytest.raises(InputError):
        optimizer_name(torch.optim.Adagrad(lin.parameters()))


def _hf_train(files, tmp_path, callbacks):
    pytest.importorskip("accelerate")
    from transformers import Trainer, TrainingArguments
    work = load_workload(str(files["llama"]))
    ids = work.inputs["input_ids"]

    args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2,
                             max_steps=3, learning_rate=1e-2, logging_steps=1, seed=0,
                             report_to=[], save_strategy="no", use_cpu=True,
                             dataloader_num_workers=0, disable_tqdm=True)
    trainer = Trainer(model=work.model, args=args, train_dataset=token_dataset(ids), callbacks=callbacks)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return losses, [p.detach().clone() for p in work.model.parameters()], work.model


def test_hf_trainer_callback_trains_bitwise_like_the_plain_trainer(files, tmp_path,
                                                                   monkeypatch):
    want_losses, want_params, _ = _hf_train(files, tmp_path, [])
    callback = slackswap.SlackswapCallback(budget=0.3)
    checks = []
    check_step = slackswap.run.api.check_step
    monkeypatch.setattr(slackswap.run.api, "check_step",
                        lambda *a, **kw: checks.append(1) or check_step(*a, **kw))
    losses, params, model = _hf_train(files, tmp_path, [callback])
    assert len(checks) == 1 and callback.check_report.parameters > 0   # checked once, passed
    assert len(losses) == 3 and losses == want_losses
    assert all(torch.equal(a, b) for a, b in zip(params, want_params))
    assert callback.plan.feasible and callback.plan.actions()["keep"] < len(
        callback.plan.profile.saved_activations)
    assert model.forward.__slackswap__.last_run.rerun_ops > 0


def _readme_block() -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Use it in training", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_readme_example_runs_as_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    code = _readme_block()
    assert "plan_model" in code and "patch" in code
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    assert namespace["plan"].feasible and namespace["loss"].grad_fn is not None
    saved = sorted(p.name for p in tmp_path.iterdir())
    assert saved == ["tiny_gpt.plan.json", "tiny_gpt.profile.json"]
    r = CliRunner().invoke(app, ["show", "tiny_gpt.plan.json", "--json"])
    assert r.exit_code == 0, r.output


def test_the_library_face_is_lazy_and_listed():
    assert {"plan_model", "patch", "unpatch", "compile", "Plan", "SlackswapCallback"} <= set(
        dir(slackswap))
    with pytest.raises(AttributeError):
        slackswap.no_such_thing
    assert slackswap.plan_model is sys.modules["slackswap_cli.run.api"].plan_model


def test_without_torch_the_library_face_says_what_to_install():
    from helpers import run_torch_blocked
    r = run_torch_blocked("""
        import slackswap_cli
        try:
            slackswap_cli.plan_model
        except ImportError as exc:
            assert "needs torch" in str(exc) and "pip install" in str(exc), exc
            print("ok")
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("ok")


def test_hf_trainer_callback_below_the_floor_names_the_budget_that_trains(files, tmp_path):
    """A budget below the model's floor stops the first step with the callback's own
    InfeasibleError, whose hint is the SlackswapCallback budget to pass; that budget trains."""
    with pytest.raises(InfeasibleError, match=r"SlackswapCallback\(budget=0.05\)") as e:
        _hf_train(files, tmp_path, [slackswap.SlackswapCallback(budget=0.05)])
    fits = re.match(r"SlackswapCallback\(budget=([0-9.]+)\) or more", e.value.hint)
    assert fits, e.value.hint
    callback = slackswap.SlackswapCallback(budget=float(fits.group(1)))
    losses, _, _ = _hf_train(files, tmp_path, [callback])
    assert len(losses) == 3 and callback.plan.feasible
