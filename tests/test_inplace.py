"""patch: the plan runs inside the model's own forward and autograd's backward.

Real models (tiny GPT, HF GPT-2/BERT/Llama from configs, a BatchNorm CNN) are profiled with
fake tensors, planned, applied, and patched in place; three AdamW steps then give bitwise the
losses and parameters of the unpatched model, and the step holds less for backward as the
budget falls. The model object is the same, returns what it returned (a Hugging Face
`ModelOutput` with `.loss` and `.logits`), runs its hooks, and is untouched in eval mode.
"""

import pytest
import torch
from helpers import two_us_kernels
from workloads import HW, profiled, token_dataset

from slackswap_cli.errors import InputError
from slackswap_cli.run import swap as swap_engine
from slackswap_cli.run.emit import apply_plan, load_patched
from slackswap_cli.trace.joint import loss_from_output, split_inputs
from slackswap_cli.trace.workload import load_workload

_NO_DROPOUT: dict = {}


def patched_module(tmp_path, files, name, frac, planner="slackswap", args=None):
    if args:
        from slackswap_cli.trace import profile_workload
        key = (name, tuple(sorted(args.items())))
        if key not in _NO_DROPOUT:
            _NO_DROPOUT[key] = profile_workload(str(files[name]), device="fake", hardware=HW,
                                                args=args)
        prof = _NO_DROPOUT[key]
    else:
        prof = profiled(files, name)
    peak = prof.summary["peak_activation_bytes"]
    from slackswap_cli.planners import make_plan
    plan = make_plan(planner, prof, HW, int(peak * frac), frac)
    path = tmp_path / f"{name}_{planner}_{frac}.py"
    path.write_text(apply_plan(plan, prof, args=args))
    return load_patched(str(path)), plan


def train(model, work, steps=3, seed=0, autocast=None):
    """`steps` AdamW steps from the same seed; (losses, final parameters, last output).
    `autocast`: a dtype to run forward and loss under (backward outside, as torch advises)."""
    import contextlib
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, out = [], None
    torch.manual_seed(seed)
    for _ in range(steps):
        a, kw = split_inputs(work.inputs)
        with (torch.autocast("cpu", dtype=autocast) if autocast else contextlib.nullcontext()):
            out = model(*a, **kw)
            loss = loss_from_output(out, work.inputs, work.loss_fn)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()], out


def twin(files, name):
    a, b = load_workload(str(files[name])), load_workload(str(files[name]))
    b.model.load_state_dict(a.model.state_dict())
    return a, b


def run_of(model):
    return model.forward.__slackswap__.last_run


@pytest.mark.parametrize("name,frac", [("tiny_gpt", 0.3), ("gpt2", 0.5), ("bert", 0.4),
                                       ("llama", 0.3), ("cnn", 0.75)])
def test_patched_in_place_trains_bitwise_like_eager(name, frac, files, tmp_path):
    mod, plan = patched_module(tmp_path, files, name, frac)
    eager, work = twin(files, name)
    want_losses, want_params, want_out = train(eager.model, eager)
    model = mod.patch(work.model)
    assert model is work.model                        # patched in place, same object
    losses, params, out = train(model, work)
    assert losses == want_losses
    assert all(torch.equal(p, q) for p, q in zip(params, want_params))
    assert type(out) is type(want_out)                # a ModelOutput stays a ModelOutput
    for b1, b2 in zip(eager.model.buffers(), work.model.buffers()):
        assert torch.equal(b1, b2)                    # BatchNorm statistics updated once
    run = run_of(model)
    n_planned = sum(1 for a in plan.decisions if a.action != "keep")
    assert n_planned > 0
    assert len(run.rec_of_op) > 0.6 * len(mod.TABLE["ops"])   # most ops aligned


def test_recompute_and_swap_really_happen_and_memory_falls(files, tmp_path):
    """Without dropout (a fake profile takes CUDA's fused dropout, a CPU run decomposes it, so
    those ops do not align and their tensors stay as eager keeps them)."""
    args = {"dropout": 0.0}
    held = {}
    for frac in (1.0, 0.7, 0.5):
        mod, plan = patched_module(tmp_path, files, "tiny_gpt", frac, args=args)
        assert plan.feasible
        work = load_workload(str(files["tiny_gpt"]), args=args)
        model = mod.patch(work.model)
        loss = model(*work.inputs)
        run = run_of(model)
        held[frac] = run.held_device_bytes()
        # after forward the step holds exactly what the plan keeps: swapped roots are on the
        # host and recomputed ones were let go
        prof = _NO_DROPOUT[("tiny_gpt", (("dropout", 0.0),))]
        assert held[frac] == sum(prof.tensors[d.tensor].size_bytes for d in plan.decisions
                                 if d.action == "keep")
        assert len(run.rec_of_op) == len(mod.TABLE["ops"]) - 3   # all but autograd's detaches
        assert all(run.usable.values())
        loss.backward()
        acts = {d.action for d in plan.decisions}
        assert acts & {"swap", "recompute"} or frac == 1.0
        if "recompute" in acts:
            assert run.rerun_ops > 0
        if "swap" in acts:
            assert run.metas                          # roots copied to host memory
    assert held[1.0] > held[0.7] > held[0.5]
    # keep-all holds what eager autograd saves: the profile's saved bytes
    assert held[1.0] == prof.summary["saved_bytes"]


def test_eval_mode_and_no_grad_run_the_original_forward(files, tmp_path):
    mod, _ = patched_module(tmp_path, files, "tiny_gpt", 0.3)
    work = load_workload(str(files["tiny_gpt"]))
    model = mod.patch(work.model)
    model.eval()
    with torch.no_grad():
        model(*work.inputs)
    assert run_of(model) is None
    model.train()
    with torch.no_grad():
        model(*work.inputs)
    assert run_of(model) is None
    model(*work.inputs)
    assert run_of(model) is not None


def test_unpatch_restores_and_double_patch_is_refused(files, tmp_path):
    mod, _ = patched_module(tmp_path, files, "tiny_gpt", 0.3)
    work = load_workload(str(files["tiny_gpt"]))
    cls_forward = type(work.model).forward
    mod.patch(work.model)
    with pytest.raises(InputError, match="already patched"):
        mod.patch(work.model)
    mod.unpatch(work.model)
    assert "forward" not in work.model.__dict__
    assert work.model.forward.__func__ is cls_forward
    with pytest.raises(InputError, match="not patched"):
        mod.unpatch(work.model)


def test_hooks_registered_after_patching_run(files, tmp_path):
    mod, _ = patched_module(tmp_path, files, "tiny_gpt", 0.3)
    work = load_workload(str(files["tiny_gpt"]))
    model = mod.patch(work.model)
    seen = []
    model.blocks[0].register_forward_hook(lambda m, a, o: seen.append("block"))
    model.register_forward_pre_hook(lambda m, a: seen.append("root"))
    model(*work.inputs).backward()
    assert seen == ["root", "block"]


def test_gradient_accumulation_is_exact(files, tmp_path):
    mod, _ = patched_module(tmp_path, files, "tiny_gpt", 0.3)
    eager, work = twin(files, "tiny_gpt")
    model = mod.patch(work.model)
    grads = []
    for m in (eager.model, model):
        torch.manual_seed(1)
        for _ in range(2):
            (m(*work.inputs) / 2).backward()
        grads.append([p.grad.clone() for p in m.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_hf_trainer_trains_the_patched_model_like_the_original(files, tmp_path):
    pytest.importorskip("accelerate")
    from transformers import Trainer, TrainingArguments
    mod, _ = patched_module(tmp_path, files, "gpt2", 0.5)
    eager, work = twin(files, "gpt2")
    ids = work.inputs["input_ids"]

    results = []
    for model in (eager.model, mod.patch(work.model)):
        args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2,
                                 max_steps=3, learning_rate=1e-2, logging_steps=1, seed=0,
                                 report_to=[], save_strategy="no", use_cpu=True,
                                 dataloader_num_workers=0)
        trainer = Trainer(model=model, args=args, train_dataset=token_dataset(ids))
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        results.append((losses, [p.detach().clone() for p in model.parameters()]))
    (l1, p1), (l2, p2) = results
    assert len(l1) == 3 and l1 == l2
    assert all(torch.equal(a, b) for a, b in zip(p1, p2))


def test_autocast_profile_patched_model_trains_like_eager_under_autocast(files, tmp_path):
    """fp32 weights + autocast bf16: profiled under `--autocast bf16` for a CPU (`fake:cpu`:
    random ops as a CPU draws them), the patched model under the same autocast equals eager."""
    from slackswap_cli.planners import make_plan
    from slackswap_cli.trace import profile_workload
    prof = profile_workload(str(files["tiny_gpt"]), device="fake:cpu", hardware=HW,
                            autocast="bf16")
    peak = prof.summary["peak_activation_bytes"]
    plan = make_plan("recompute-only", prof, HW, int(peak * 0.4), 0.4)
    path = tmp_path / "autocast_patched.py"
    path.write_text(apply_plan(plan, prof))
    mod = load_patched(str(path))
    eager, work = twin(files, "tiny_gpt")
    want_losses, want_params, _ = train(eager.model, eager, autocast=torch.bfloat16)
    model = mod.patch(work.model)
    losses, params, _ = train(model, work, autocast=torch.bfloat16)
    assert losses == want_losses
    assert all(torch.equal(p, q) for p, q in zip(params, want_params))
    run = run_of(model)
    assert run.rerun_ops > 0 and len(run.rec_of_op) > 0.9 * len(mod.TABLE["ops"])


def test_another_input_shape_is_planned_for_once_and_trains_exactly(files, tmp_path, capfd):
    """The last short batch: a new shape's first call is recorded on the profiled plan (ops
    lined up by rank, no trace), its limit guessed from the profile's saved bytes; a table
    written before it named them is traced at the new shape and planned for (said once on
    stderr), cached. The profiled shape keeps its plan; results stay exact."""
    from slackswap_cli.run.eager import inplace as replay
    args = {"dropout": 0.0}
    mod, _ = patched_module(tmp_path, files, "tiny_gpt", 0.4, args=args)
    from slackswap_cli.trace.workload import load_workload as load
    small = {**args, "batch": 3}
    eager = load(str(files["tiny_gpt"]), args=small)
    want, _, _ = train(eager.model, eager, steps=2)
    older = {k: v for k, v in mod.TABLE.items() if k != "saved_by_shape"}
    for table in (mod.TABLE, older):
        work = load(str(files["tiny_gpt"]), args=small)
        model = replay.patch(work.model, mod.META, table)
        got, _, _ = train(model, work, steps=2)
        assert got == want
        run = run_of(model)
        assert len(run.rec_of_op) == len(run.table.ops) - 3    # all but autograd's detaches
        assert run.rerun_ops > 0 or run.metas
        err = capfd.readouterr().err
        if table is mod.TABLE:            # borrowed: no trace, held to the limit it settled
            assert run.t.borrowed and run.table.source is mod.TABLE and "new inputs" not in err
            assert run.report()["held_bytes"] <= 1.05 * run.t.limit
        else:
            assert not run.t.borrowed and run.table.source is not table
            assert err.count("new inputs 3x32, 3x32 on cpu") == 1 and "planned for them" in err
        assert "lined up" not in err
    base = load(str(files["tiny_gpt"]), args=args)
    model(*base.inputs)                                   # the profiled shape: its own plan
    assert run_of(model).table.source is older


def test_without_replanning_another_shape_runs_unplanned_and_says_so(files, tmp_path, capfd):
    mod, _ = patched_module(tmp_path, files, "tiny_gpt", 0.4)
    from slackswap_cli.run.eager import inplace
    from slackswap_cli.trace.workload import load_workload as load
    eager = load(str(files["tiny_gpt"]), args={"batch": 3})
    work = load(str(files["tiny_gpt"]), args={"batch": 3})
    model = inplace.patch(work.model, mod.META, mod.TABLE, replan=False)
    want, _, _ = train(eager.model, eager, steps=2)
    got, _, _ = train(model, work, steps=2)
    assert got == want
    err = capfd.readouterr().err
    assert err.count("lined up") == 1 and "re-profile at these shapes" in err


def test_a_compiled_model_is_refused_and_a_ddp_wrapper_patches_its_module(files, tmp_path):
    mod, _ = patched_module(tmp_path, files, "tiny_gpt", 0.4)
    work = load_workload(str(files["tiny_gpt"]))
    with pytest.raises(InputError, match="torch.compile"):
        mod.patch(torch.compile(work.model))
    dp = torch.nn.DataParallel(work.model)
    assert mod.patch(dp) is dp
    assert "forward" in work.model.__dict__
    mod.unpatch(dp)
    assert "forward" not in work.model.__dict__


def test_hf_model_at_a_shorter_sequence_is_replanned_and_exact(files, tmp_path):
    """Dynamic padding: a shorter sequence than profiled. The first call runs the profiled
    plan borrowed (HF GPT-2 branches otherwise under fake tensors: it then plans again along
    its branches); the second runs that plan, whose chains read swapped values fetched by
    earlier chains (held until every chain that reads them ran)."""
    mod, _ = patched_module(tmp_path, files, "gpt2", 0.4)
    eager, work = twin(files, "gpt2")
    mod.patch(work.model)
    ids = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(3))
    for call in range(2):
        grads = []
        for m in (eager.model, work.model):
            torch.manual_seed(0)
            m(input_ids=ids, labels=ids).loss.backward()
            grads.append([p.grad.clone() for p in m.parameters()])
            m.zero_grad(set_to_none=True)
        assert all(torch.equal(a, b) for a, b in zip(*grads)), call
        run = run_of(work.model)
        assert run.t.borrowed == (call == 0)
    assert run.table.source is not mod.TABLE and run.rerun_ops > 0


def test_verify_checks_the_in_place_patch_too(files, tmp_path):
    """`verify` also trains the model patched in place against eager; with a `fake:cpu`
    profile (random ops as a CPU draws them) every op lines up and the in-place step holds
    what the written-out step holds."""
    from slackswap_cli.planners import make_plan
    from slackswap_cli.run.verify.verify import verify
    from slackswap_cli.trace import profile_workload
    prof = profile_workload(str(files["tiny_gpt"]), device="fake:cpu", hardware=HW)
    peak = prof.summary["peak_activation_bytes"]
    plan = make_plan("slackswap", prof, HW, int(peak * 0.4), 0.4)
    path = tmp_path / "v.py"
    path.write_text(apply_plan(plan, prof))
    r = verify(str(path), steps=2, check_trace=False)
    assert r.passed, r.reasons
    ip = r.inplace
    assert ip["max_loss_rel_diff"] == 0 and ip["max_grad_rel_diff"] == 0
    # every op: make_fx's detaches (2.13's profile has them, 2.15's none) are not counted as
    # missed (run/eager/lineup.py's TRACE_ONLY)
    assert ip["ops_lined_up"] == ip["profile_forward_ops"]
    assert ip["held_bytes_after_forward"] == r.patched_peak_bytes


def test_strict_refuses_other_shapes(files, tmp_path):
    from slackswap_cli.errors import FingerprintMismatch
    from slackswap_cli.trace.workload import load_workload as load
    mod, _ = patched_module(tmp_path, files, "tiny_gpt", 0.4)
    work = load(str(files["tiny_gpt"]), args={"batch": 3})
    model = mod.patch(work.model, strict=True)
    with pytest.raises(FingerprintMismatch, match="3x32, 3x32 on cpu"):
        model(*work.inputs)
    model.eval()
    model(*work.inputs)                        # evaluation never needs the plan


def _two_backwards(model, work, steps=3):
    """`steps` AdamW steps, each a forward, `backward(retain_graph=True)` and a second
    backward through the same graph (a weighted loss: the gradients add); after each step,
    the host pool's bytes ever allocated and the last call's state."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, seen = [], []
    for _ in range(steps):
        loss = model(*work.inputs)
        loss.backward(retain_graph=True)
        (0.5 * loss).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        del loss                                       # the graph is gone
        seen.append(swap_engine.host_pool().allocated_bytes)
    return losses, [p.detach().clone() for p in model.parameters()], seen


def test_a_second_backward_through_a_retained_graph_is_exact_and_frees(files, tmp_path,
                                                                        monkeypatch):
    """backward(retain_graph=True) then another backward: swapped tensors fetched again from
    their host copies, recomputed ones made again; bitwise like eager over three steps (the
    recorded first call and two that follow its template); once the graph is gone, nothing
    is left: no host copy held, nothing made, the pool's buffers reused step after step."""
    from slackswap_cli.planners import make_plan
    from slackswap_cli.trace import profile_workload
    two_us_kernels(monkeypatch)   # plans that recompute as well as swap (see helpers)
    args = {"dropout": 0.0}
    prof = profile_workload(str(files["tiny_gpt"]), device="fake", hardware=HW, args=args)
    plan = make_plan("slackswap", prof, HW, int(prof.summary["peak_activation_bytes"] * 0.4))
    path = tmp_path / "twice.py"
    path.write_text(apply_plan(plan, prof, args=args))
    mod = load_patched(str(path))
    acts = [d.action for d in plan.decisions]
    assert acts.count("swap") > 0 and acts.count("recompute") > 0
    eager = load_workload(str(files["tiny_gpt"]), args=args)
    work = load_workload(str(files["tiny_gpt"]), args=args)
    work.model.load_state_dict(eager.model.state_dict())
    want_losses, want_params, _ = _two_backwards(eager.model, eager)
    model = mod.patch(work.model)
    losses, params, pool = _two_backwards(model, work)
    assert losses == want_losses
    assert all(torch.equal(p, q) for p, q in zip(params, want_params))
    run = run_of(model)
    assert run.tpl is not None and not run.broken      # the last step followed the template
    assert run.rerun_ops > 0 and run.swaps
    assert pool[1] == pool[2] > 0                      # host buffers reused, not re-allocated
    assert not run.made and not run.pinned and not run.bound
    assert all(sw.host() is None and sw.dev is None for sw in run.swaps)   # host copies gone


def test_double_backward_is_a_clear_error_not_wrong_gradients(files, tmp_path):
    mod, plan = patched_module(tmp_path, files, "tiny_gpt", 0.4)
    assert any(d.action != "keep" for d in plan.decisions)
    work = load_workload(str(files["tiny_gpt"]))
    model = mod.patch(work.model)
    loss = model(*work.inputs)
    with pytest.raises(InputError, match="create_graph=True"):
        torch.autograd.grad(loss, list(model.parameters()), create_graph=True)


def test_a_slow_planners_plan_is_replanned_by_its_quick_stand_in(files, tmp_path):
    """A MILP takes a minute: inside a training step the registry's stand-in (optimal's
    fallback, slackswap) plans the new shape instead."""
    from slackswap_cli.run.eager.replan import replan_table
    mod, _ = patched_module(tmp_path, files, "tiny_gpt", 0.5)
    work = load_workload(str(files["tiny_gpt"]))
    a, kw = split_inputs(work.inputs)
    short = tuple(x[:, :-3].contiguous() if isinstance(x, torch.Tensor) and x.dim() == 2 else x
                  for x in a)
    table, what = replan_table(work.model, None, short, kw, {**mod.META, "planner": "optimal"})
    assert what.startswith("slackswap at 0.5 of the keep-all peak") and table, what


@pytest.mark.parametrize("name,frac", [("tiny_gpt", 0.3), ("llama", 0.3), ("cnn", 0.75)])
def test_two_forwards_then_one_backward_is_exact(name, frac, files, tmp_path):
    """Two calls whose graphs are alive at once (a loss over two forwards: contrastive pairs,
    a summed micro-batch), on the first call and on later ones: each call's run serves its own
    backward, and the step is bitwise eager's."""
    from slackswap_cli.trace.joint import loss_from_output, split_inputs
    mod, _ = patched_module(tmp_path, files, name, frac)
    eager, work = twin(files, name)
    model = mod.patch(work.model)
    a, kw = split_inputs(work.inputs)
    grads, kinds = [], []
    for m in (eager.model, model):
        torch.manual_seed(1)
        for _ in range(3):                # first calls, then later calls
            m.zero_grad(set_to_none=True)
            first = loss_from_output(m(*a, **kw), work.inputs, work.loss_fn)
            if m is model:
                kinds.append(run_of(m).kind)
            second = loss_from_output(m(*a, **kw), work.inputs, work.loss_fn)
            if m is model:
                kinds.append(run_of(m).kind)
            (first + 2 * second).backward()
        grads.append([p.grad.clone() for p in m.parameters()])
    assert all(torch.equal(g, h) for g, h in zip(*grads))
    assert kinds[-2:] == ["steady", "steady"]
    assert run_of(model).rerun_ops > 0 or run_of(model).metas
