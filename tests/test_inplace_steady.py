"""patch: later calls at the same signature run on saved-tensor hooks alone (steady state), and
what users do to a patched model (in place).

The first call at a signature records every op; the calls after it follow that call's pack
decisions by position and give bitwise the eager losses, gradients and buffers, with the same
bytes held after forward and the same ops re-run. Other control flow at the same shapes is
caught and the call keeps the rest as eager does. Copies of a patched model (deepcopy,
AveragedModel, torch.save of the whole model) run their own parameters; BatchNorm in training
mode is recomputed with its statistics updated once; a dtype change re-plans; HF gradient
checkpointing and torch.compile are said once on stderr.
"""
import copy
import gc
import io
import weakref

import pytest
import torch
from helpers import two_us_kernels
from workloads import HW, hand_plan, profiled, write_patched

from slackswap_cli import op_cost
from slackswap_cli.errors import InputError
from slackswap_cli.planners import make_plan
from slackswap_cli.run.eager.inplace import is_patched
from slackswap_cli.run.eager.recorded import OpRecord, OutRef, prepare_replay, view_geometry
from slackswap_cli.run.emit import load_patched
from slackswap_cli.trace import profile_workload
from slackswap_cli.trace.joint import loss_from_output, split_inputs
from slackswap_cli.trace.workload import load_workload

_PROFILES: dict = {}
BRANCHY = '''
import torch, torch.nn as nn, torch.nn.functional as F
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.mode = nn.Linear(16, 64), nn.Linear(64, 4), "gelu"
    def forward(self, x, y):
        h = self.fc1(x)
        h = F.gelu(h) if self.mode == "gelu" else torch.tanh(h)
        return F.cross_entropy(self.fc2(h), y)
def workload(batch=8):
    torch.manual_seed(0)
    return Net(), (torch.randn(batch, 16), torch.randint(0, 4, (batch,)))
'''


@pytest.fixture(autouse=True)
def _costs(monkeypatch):
    two_us_kernels(monkeypatch)   # plans that recompute as well as swap (see helpers)


def _profile(files, name, args=None):
    key = (name, tuple(sorted((args or {}).items())), op_cost.default_cost_model().digest)
    if key not in _PROFILES:
        _PROFILES[key] = (profile_workload(str(files[name]), device="fake", hardware=HW,
                                           args=args) if args else profiled(files, name))
    return _PROFILES[key]


def _patched(tmp_path, files, name, frac=None, args=None, actions=None):
    prof = _profile(files, name, args)
    if actions is not None:
        plan = hand_plan(prof, actions)
    else:
        peak = prof.summary["peak_activation_bytes"]
        plan = make_plan("slackswap", prof, HW, int(peak * frac), frac)
    return load_patched(str(write_patched(tmp_path, plan, prof, name=f"p_{name}.py",
                                          args=args))), plan, prof


def _twins(path, args=None):
    a, b = load_workload(str(path), args=args), load_workload(str(path), args=args)
    b.model.load_state_dict(a.model.state_dict())
    return a, b


def _steps(work, n, each=None):
    """n AdamW steps; (losses, parameters, buffers, [what `each(model)` said per step])."""
    opt = torch.optim.AdamW(work.model.parameters(), lr=1e-2)
    torch.manual_seed(0)
    losses, seen = [], []
    for i in range(n):
        a, kw = split_inputs(work.inputs)
        loss = loss_from_output(work.model(*a, **kw), work.inputs, work.loss_fn)
        if each is not None:
            seen.append(each(work.model, i))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return (losses, [p.detach().clone() for p in work.model.parameters()],
            [b.clone() for b in work.model.buffers()], seen)


def _same(want, got):
    assert got[0] == want[0]
    assert all(torch.equal(p, q) for p, q in zip(got[1], want[1]))
    assert all(torch.equal(p, q) for p, q in zip(got[2], want[2]))


def _run(model):
    return model.forward.__slackswap__.last_run


@pytest.mark.parametrize("name,frac,args", [("tiny_gpt", 0.5, {"dropout": 0.0}),
                                            ("llama", 0.3, None), ("cnn", 0.5, None)])
def test_later_calls_run_on_hooks_alone_bitwise_like_eager(name, frac, args, files, tmp_path):
    mod, plan, _ = _patched(tmp_path, files, name, frac, args)
    eager, work = _twins(files[name], args)
    want = _steps(eager, 4)
    mod.patch(work.model)
    work.model.forward.__slackswap__.measure_held = True
    got = _steps(work, 4, lambda m, i: (_run(m).kind, _run(m).held_device_bytes(),
                                        getattr(_run(m), "broken", None)))
    _same(want, got)
    kinds = [k for k, _, _ in got[3]]
    # the HF Llama's first call plans again along eager's branches (no mask in eager: see
    # run/eager/branches.py), so the second records that plan
    records = 2 if name == "llama" else 1
    assert kinds == ["first"] * records + ["steady"] * (4 - records)
    assert not any(b for _, _, b in got[3][records:])         # every pack lined up
    assert len({h for _, h, _ in got[3][records - 1:]}) == 1   # the same bytes held each step
    run = _run(work.model)
    assert run.rerun_ops > 0 and run.metas                     # steady state recomputes, swaps
    if name != "cnn":             # the transformers' replayed views: by geometry, bitwise
        assert any(rec.geom for rec in run.records)


def _geometry(func, base, *args):
    rec = OpRecord(func, (OutRef(0, 0), *args), {}, None, None, None, ())
    prepare_replay(rec)
    with torch.no_grad():
        return rec, func(base, *args), view_geometry(rec, [base, *args], func(base, *args))


@pytest.mark.parametrize("func,args", [
    (torch.ops.aten.transpose.int, (1, 2)), (torch.ops.aten.view.default, ([4, 6, 5],)),
    (torch.ops.aten.slice.Tensor, (2, 1, 4)), (torch.ops.aten.split.Tensor, (2, 1)),
    (torch.ops.aten.expand.default, ([3, 4, 6, 5],))])
def test_a_replayed_view_is_re_derived_by_its_geometry_with_the_same_aliasing(func, args):
    base = torch.randn(8, 6, 5)[2:6]        # a view itself, at an offset
    rec, want, geom = _geometry(func, base, *args)
    assert geom and geom[0] == (base.shape, base.stride(), base.storage_offset())
    wants = [want] if isinstance(want, torch.Tensor) else want
    for w, (size, stride, offset) in zip(wants, geom[1], strict=True):
        got = torch.Tensor.as_strided(base, size, stride, offset)
        assert got._base is base._base and torch.equal(got, w)
        assert (got.shape, got.stride(), got.storage_offset(), got.dtype) == \
            (w.shape, w.stride(), w.storage_offset(), w.dtype)


@pytest.mark.parametrize("func,base,args", [
    (torch.ops.aten.view.dtype, torch.randn(4, 6), (torch.int32,)),
    (torch.ops.aten.view_as_real.default, torch.randn(4, 6, dtype=torch.complex64), ()),
    (torch.ops.aten.transpose.int, torch.randn(4, 6, dtype=torch.complex64).conj(), (0, 1)),
    (torch.ops.aten.clone.default, torch.randn(4, 6), ())])
def test_dtype_changing_complex_conjugate_and_non_views_keep_the_op(func, base, args):
    assert _geometry(func, base, *args)[2] is False


def test_a_keep_all_plan_runs_on_hooks_alone_with_no_checks(files, tmp_path):
    """A keep-all plan's steady state skips the per-pack checks (nothing depends on which
    tensor is which) and still reports what a run reports: bitwise eager, the same bytes held
    after forward as its first call, nothing re-run."""
    args = {"dropout": 0.0}
    mod, _, _ = _patched(tmp_path, files, "tiny_gpt", actions={}, args=args)
    eager, work = _twins(files["tiny_gpt"], args)
    want = _steps(eager, 3)
    mod.patch(work.model)
    work.model.forward.__slackswap__.measure_held = True
    got = _steps(work, 3, lambda m, i: (_run(m).kind, _run(m).held_device_bytes(),
                                        _run(m).rerun_ops))
    _same(want, got)
    assert [k for k, _, _ in got[3]] == ["first", "keep_all", "keep_all"]
    assert _run(work.model).tpl.keep_only
    assert len({h for _, h, _ in got[3]}) == 1 and got[3][0][1] > 0
    assert all(n == 0 for _, _, n in got[3])
    # not measuring (the default): no saved-tensor hooks at all, nothing noted
    work.model.forward.__slackswap__.measure_held = False
    packed = []

    def outer(x):            # hooks of the caller's: with none of the patch's inside, it sees all
        packed.append(x)
        return x
    with torch.autograd.graph.saved_tensors_hooks(outer, lambda x: x):
        again = _steps(work, 2, lambda m, i: (_run(m).kind, _run(m).kept_refs))
    assert all(k == "keep_all" and r == [] for k, r in again[3])
    assert len(packed) >= 2 * len(_run(work.model).tpl.seq)    # (every pack of 2 steps)
    with pytest.raises(InputError, match="measure_held = True"):
        _run(work.model).held_device_bytes()


def test_a_later_call_measures_what_it_holds_only_when_asked(files, tmp_path):
    """`held_device_bytes` costs a weak reference per kept tensor: later calls take them only
    with `measure_held`, and then report what the first call measured."""
    mod, _, _ = _patched(tmp_path, files, "tiny_gpt", 0.5, {"dropout": 0.0})
    _, work = _twins(files["tiny_gpt"], {"dropout": 0.0})
    mod.patch(work.model)
    state = work.model.forward.__slackswap__


    def each(m, i):          # (after call i's forward: what it noted; then ask for call i+1)
        got = (len(_run(m).kept_refs), _run(m).held_device_bytes() if i != 1 else None)
        state.measure_held = i >= 1
        return got
    seen = _steps(work, 4, each)[3]
    assert seen[0][0] > 0 and seen[1][0] == 0          # the second call noted nothing
    assert seen[0][1] == seen[3][1] > 0                 # first call (recorded) = a measured later one


def test_other_control_flow_at_the_same_shapes_is_caught(tmp_path):
    path = tmp_path / "branchy.py"
    path.write_text(BRANCHY)
    files = {"branchy": path}
    # recompute what the activation saves: gelu's input (fc1's output) in the profile
    mod, _, _ = _patched(tmp_path, files, "branchy", actions={"addmm": "recompute"})
    flips = {2: "tanh", 4: "gelu"}
    results = []
    for patched in (False, True):
        work = load_workload(str(path))
        if patched:
            mod.patch(work.model)
        opt = torch.optim.SGD(work.model.parameters(), lr=0.1)
        losses, seen = [], []
        for i in range(7):
            work.model.mode = flips.get(i, work.model.mode)
            loss = work.model(*work.inputs)
            run = _run(work.model) if patched else None
            loss.backward()
            if patched:
                seen.append((run.kind, run.broken, run.rerun_ops))
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        results.append((losses, [p.detach().clone() for p in work.model.parameters()], seen))
    (want, want_p, _), (got, got_p, seen) = results
    assert got == want and all(torch.equal(p, q) for p, q in zip(got_p, want_p))
    # gelu: recorded, then on hooks (re-running fc1); tanh at step 2: its first saved tensor
    # differs (caught: the rest kept as eager keeps it), step 3 records tanh in full; back to
    # gelu at step 4: the tanh template is caught the same way, step 5 records, 6 runs on hooks
    assert [(k, b) for k, b, _ in seen] == [
        ("first", False), ("steady", False), ("steady", True), ("first", False),
        ("steady", True), ("first", False), ("steady", False)]
    assert seen[1][2] > 0 and seen[6][2] > 0 and seen[2][2] == 0


@pytest.mark.parametrize("how", ["deepcopy", "averaged", "save_load"])
def test_a_copy_of_a_patched_model_runs_its_own_parameters(how, files, tmp_path):
    mod, _, _ = _patched(tmp_path, files, "tiny_gpt", 0.5, {"dropout": 0.0})
    eager, work = _twins(files["tiny_gpt"], {"dropout": 0.0})
    mod.patch(work.model)
    _steps(work, 2)                                  # the live model has run (and recorded)

    def make(model):
        if how == "deepcopy":
            return copy.deepcopy(model)
        if how == "averaged":
            return torch.optim.swa_utils.AveragedModel(model).module
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        return torch.load(buf, weights_only=False)
    dup = make(work.model)
    assert is_patched(dup) and dup.forward.__slackswap__.model is dup
    plain = copy.deepcopy(eager.model)
    plain.load_state_dict(dup.state_dict())
    with torch.no_grad():                            # an EMA copy's weights differ from the live
        for m in (dup, plain):
            for p in m.parameters():
                p.mul_(0.5)
    a, kw = split_inputs(work.inputs)
    for _ in range(2):                               # the copy's first call and a later one
        got = dup(*a, **kw)
        want = plain(*a, **kw)
        assert torch.equal(got, want)
        got.backward()
        want.backward()
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(dup.parameters(),
                                                               plain.parameters()))
        dup.zero_grad()
        plain.zero_grad()
    assert _run(dup).kind == "steady" and _run(dup).rerun_ops > 0
    assert not torch.equal(got, work.model(*a, **kw))   # not the live model's loss


def test_batchnorm_in_training_is_recomputed_with_statistics_updated_once(files, tmp_path):
    """The replay re-runs train-mode native_batch_norm (its running-statistics writes go to
    copies), so the step holds what the plan keeps; before, that root stayed kept."""
    mod, plan, prof = _patched(tmp_path, files, "cnn", actions={"relu": "recompute"})
    eager, work = _twins(files["cnn"])
    want = _steps(eager, 3)
    mod.patch(work.model)
    work.model.forward.__slackswap__.measure_held = True
    got = _steps(work, 3, lambda m, i: (_run(m).held_device_bytes(), dict(_run(m).usable)))
    _same(want, got)                                 # statistics updated once, bitwise
    kept = sum(prof.tensors[d.tensor].size_bytes for d in plan.decisions if d.action == "keep")
    relu = next(t for t in prof.saved_activations if t.name == "relu")
    for held, usable in got[3]:
        assert usable == {relu.id: True}
        assert held < kept + relu.size_bytes // 100  # not keep-all: relu was let go
    assert _run(work.model).rerun_ops > 0


def test_a_dtype_change_after_patch_replans(files, tmp_path, capfd):
    mod, _, _ = _patched(tmp_path, files, "tiny_gpt", 0.5, {"dropout": 0.0})
    eager, work = _twins(files["tiny_gpt"], {"dropout": 0.0})
    mod.patch(work.model)
    eager.model.to(torch.float64)
    work.model.to(torch.float64)
    want = _steps(eager, 2)
    got = _steps(work, 2, lambda m, i: _run(m).table.source is mod.TABLE)
    _same(want, got)
    err = capfd.readouterr().err
    assert err.count("float64 parameters: planned for them") == 1
    assert got[3] == [False, False]                  # the float64 plan ran, not the fp32 one


def test_hf_gradient_checkpointing_after_patch_is_said_once(files, tmp_path, capfd):
    mod, _, _ = _patched(tmp_path, files, "llama", 0.3)
    eager, work = _twins(files["llama"])
    mod.patch(work.model)
    for w in (eager, work):
        w.model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False})
    _same(_steps(eager, 3), _steps(work, 3))
    assert capfd.readouterr().err.count("gradient checkpointing is on") == 1


def test_torch_compile_of_a_patched_model_says_it_runs_unpatched(files, tmp_path, capfd):
    mod, _, _ = _patched(tmp_path, files, "tiny_gpt", 0.5, {"dropout": 0.0})
    eager, work = _twins(files["tiny_gpt"], {"dropout": 0.0})
    mod.patch(work.model)
    compiled = torch.compile(work.model, backend="eager")
    a, kw = split_inputs(work.inputs)
    for _ in range(2):
        got, want = compiled(*a, **kw), eager.model(*a, **kw)
        assert torch.equal(got, want)
    err = capfd.readouterr().err
    assert err.count("the compiled model runs unpatched") == 1
    assert _run(work.model) is None                  # the plan did not run


@pytest.mark.parametrize("name,frac,args", [("tiny_gpt", 1.0, {"dropout": 0.0}),
                                            ("tiny_gpt", 0.5, {"dropout": 0.0}),
                                            ("llama", 0.3, None), ("cnn", 0.5, None)])
def test_a_forward_without_backward_leaks_nothing(name, frac, args, files, tmp_path):
    """A step whose graph is dropped without backward (a skipped non-finite loss, an OOM
    retry): what autograd held is freed, as in eager. (Handing autograd the saved tensor
    itself made a cycle, output -> its node -> the output, that Python's collector cannot
    see: every such call leaked all its kept tensors.)"""
    mod, _, _ = _patched(tmp_path, files, name, frac, args)
    _, work = _twins(files[name], args)
    mod.patch(work.model)
    a, kw = split_inputs(work.inputs)
    for _ in range(3):                    # first call, then later calls, with backward
        loss_from_output(work.model(*a, **kw), work.inputs, work.loss_fn).backward()

    state = work.model.forward.__slackswap__
    state.measure_held = True             # (each call notes what autograd holds, weakly)

    def forward_only(n):
        """n calls without backward: were the first n - 1 runs, and all they held, freed?"""
        runs, held = [], []
        for _ in range(n):
            loss_from_output(work.model(*a, **kw), work.inputs, work.loss_fn)
            runs.append(weakref.ref(state.last_run))
            held.append(list(state.last_run.kept_refs))
        gc.collect()
        assert all(len(h) > 0 for h in held)
        return ([r() is None for r in runs[:-1]],
                [sum(t() is not None for t in h) for h in held[:-1]])
    dead, alive = forward_only(4)
    assert dead == [True] * 3 and alive == [0] * 3     # (the bug: every kept tensor alive)
    state.steady = False                               # the first call's runtime too
    dead, alive = forward_only(3)
    assert dead == [True] * 2 and alive == [0] * 2
