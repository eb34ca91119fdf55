"""The traced profile of real models: saved bytes against eager autograd, kinds, lifetimes,
random ops, aliases, the workload header, and tracing errors."""
from pathlib import Path

import pytest
import torch
import torch.utils._pytree as pytree

from slackswap_cli.errors import InputError, TraceError
from slackswap_cli.hardware import PRESETS
from slackswap_cli.trace import profile_workload
from slackswap_cli.trace.graph_profile import joint_to_profile
from slackswap_cli.trace.joint import _cuda_dropout, capture_joint, loss_from_output, split_inputs
from slackswap_cli.trace.workload import load_workload

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
HW = PRESETS["a100-pcie4"]
TINY = {
    "tiny_gpt": dict(n_layer=2, d_model=64, n_head=4, seq=32, batch=2),
    "gpt2_xl": dict(n_layer=2, n_embd=64, n_head=4, seq=32, batch=2, vocab=128, dtype="float32"),
    "bert_large": dict(n_layer=2, hidden=64, n_head=4, seq=32, batch=2, vocab=128,
                       dtype="float32"),
    "llama_7b": dict(n_layer=2, hidden=64, n_head=4, intermediate=172, seq=32, batch=2,
                     vocab=128, dtype="float32"),
}


def eager_saved_bytes(work, cuda_dropout: bool = False) -> tuple[int, int]:
    """Bytes and count of distinct storages autograd saves in an eager forward.

    Parameters, buffers and inputs are left out (not activations); views of one storage
    count once, as in the profile. `cuda_dropout`: run F.dropout as CUDA does (the fused
    kernel with a 1-byte bool mask), as fake traces do.
    """
    model = work.model.train()
    excluded = {t.untyped_storage().data_ptr()
                for t in [*model.parameters(), *model.buffers(), *pytree.tree_leaves(work.inputs)]
                if isinstance(t, torch.Tensor)}
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in excluded and s.nbytes() > 0:
            seen[s.data_ptr()] = s.nbytes()
        return t

    args, kwargs = split_inputs(work.inputs)
    with _cuda_dropout(cuda_dropout), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(*args, **kwargs)
        loss_from_output(out, work.inputs, work.loss_fn)  # the loss's saved tensors too
    return sum(seen.values()), len(seen)


def profile(example, device="fake", **extra):
    return profile_workload(EXAMPLES / f"{example}.py", args={**TINY[example], **extra},
                            device=device, hardware=HW)


@pytest.fixture(scope="module")
def gpt():
    return profile("tiny_gpt")


# -- saved bytes against eager ----------------------------------------------------------------
def build(model, inputs):
    return joint_to_profile(capture_joint(model, inputs), workload={}, env={}, hardware=HW)


# Eager autograd (saved_tensors_hooks, one entry per distinct storage) and the traced graph
# (forward values read by backward, one entry per alias root) describe the same step. They may
# differ in which view of a storage is saved (eager keeps `t()` of an input where the graph
# keeps the matrix it was made from) but a storage is a storage: on torch 2.13 the bytes and
# counts agree exactly. The 1% tolerance leaves room for another torch version saving a small
# index tensor (targets, positions) as its own copy rather than a view of an input; a missed
# dropout mask or a double-counted view in a 2-layer model moves the total by 2% or more, so
# the tests still catch real mistakes.
@pytest.mark.parametrize("example", list(TINY))
def test_fake_trace_saved_bytes_match_eager_autograd(example):
    work = load_workload(EXAMPLES / f"{example}.py", args=TINY[example])
    eager_bytes, eager_count = eager_saved_bytes(work, cuda_dropout=True)
    prof = profile(example)
    assert prof.summary["saved_bytes"] == pytest.approx(eager_bytes, rel=0.01)
    assert abs(prof.summary["n_saved"] - eager_count) <= max(1, eager_count // 50)


def test_real_trace_saved_bytes_match_eager_autograd():
    # a real trace keeps the device's own dropout (on a CPU: a float mask), like eager
    work = load_workload(EXAMPLES / "gpt2_xl.py", args=TINY["gpt2_xl"])
    eager_bytes, eager_count = eager_saved_bytes(work)
    prof = build(work.model, work.inputs)
    assert prof.summary["saved_bytes"] == pytest.approx(eager_bytes, rel=0.01)
    assert abs(prof.summary["n_saved"] - eager_count) <= max(1, eager_count // 50)


def test_fake_trace_differs_from_eager_only_by_cuda_dropout_masks(gpt):
    # A fake trace stands for a GPU: where F.dropout takes CUDA's fused path, each mask is a
    # 1-byte bool instead of a float32 tensor on the CPU. Everything else is the same storage.
    work = load_workload(EXAMPLES / "tiny_gpt.py", args=TINY["tiny_gpt"])
    real = build(work.model, work.inputs)
    fused = [t for t in gpt.saved_activations  # masks (the embedding dropout's output is too)
             if gpt.ops[t.producer].target == "aten.native_dropout.default" and t.dtype == "bool"]
    # if fused masks appear, they are the embedding dropout and two per layer
    assert len(fused) in (0, 1 + 2 * TINY["tiny_gpt"]["n_layer"])
    numel = sum(torch.Size(t.shape).numel() for t in fused)
    assert gpt.summary["saved_bytes"] == real.summary["saved_bytes"] - numel * (4 - 1)


# -- kinds ------------------------------------------------------------------------------------
def test_kinds(gpt):
    work = load_workload(EXAMPLES / "tiny_gpt.py", args=TINY["tiny_gpt"])
    n_params = len(list(work.model.parameters()))
    roots = [t for t in gpt.tensors if t.alias_of is None]
    by_kind = {k: [t for t in roots if t.kind == k] for k in ("parameter", "input", "buffer",
                                                              "gradient", "activation")}
    assert len(by_kind["parameter"]) == n_params
    assert len(by_kind["input"]) == 3                   # token ids, targets, tangent
    assert by_kind["input"][-1].shape == ()             # the tangent d loss / d loss
    assert len(by_kind["gradient"]) == n_params         # one gradient root per parameter
    for t in by_kind["parameter"] + by_kind["input"]:
        assert t.producer is None and not t.recomputable
    for t in by_kind["gradient"]:
        assert gpt.ops[t.producer].phase == "backward"
    # gradients are not activation memory: no saved candidate is a gradient or a parameter
    assert all(t.kind == "activation" for t in gpt.saved_activations)
    # one gradient root per parameter, as large as it (a bias gradient's root may keep a
    # reduced dimension of size 1: compare element counts)
    numel = lambda shape: torch.Size(shape).numel()
    assert sorted(numel(t.shape) for t in by_kind["gradient"]) == \
        sorted(p.numel() for p in work.model.parameters())


# -- lifetimes --------------------------------------------------------------------------------
def test_lifetimes(gpt):
    nf = gpt.n_forward
    assert 0 < nf < len(gpt.ops)
    for t in gpt.tensors:
        assert list(t.consumers) == sorted(t.consumers)
        if t.producer is not None:
            assert all(c > t.producer for c in t.consumers)
    for t in gpt.saved_activations:
        first_bwd = gpt.first_backward_use(t.id)
        assert t.producer < nf <= first_bwd                     # made in forward, read in backward
        assert gpt.last_use[t.id] >= first_bwd                  # alive until its last backward use
        assert gpt.ops[gpt.last_use[t.id]].phase == "backward"
    # a forward value nobody in backward reads is not saved
    for t in gpt.tensors:
        if t.kind == "activation" and t.alias_of is None and t.producer is not None \
                and t.producer < nf and not t.saved:
            uses = [c for a in (t.id, *gpt.aliases.get(t.id, ())) for c in gpt.tensors[a].consumers]
            assert all(c < nf for c in uses)


# -- random ops -------------------------------------------------------------------------------
def test_dropout_masks_are_saved_and_not_recomputable(gpt):
    fixed = [t for t in gpt.saved_activations if not t.recomputable]
    masks = [t for t in fixed if t.dtype == "bool" or
             gpt.ops[t.producer].target == "aten.empty_like.default"]
    # 2 layers x (attention-probability, attention-output and MLP dropout) + embedding dropout
    assert len(masks) == 2 * 3 + 1
    for t in masks:
        producer = gpt.ops[t.producer].target
        if producer == "aten.native_dropout.default":      # fused (CUDA-style) dropout
            assert t.dtype == "bool"
        else:   # CPU dropout: empty_like, then bernoulli_ and div_ in place
            assert producer == "aten.empty_like.default"
            writers = {gpt.ops[gpt.tensors[a].producer].target for a in gpt.aliases[t.id]}
            assert "aten.bernoulli_.float" in writers
    # the other fixed tensors are outputs of a fused dropout (re-running it would draw another
    # mask): the embedding dropout's output, which the first layer norm saves
    others = [t for t in fixed if t not in masks]
    assert all(gpt.ops[t.producer].target == "aten.native_dropout.default" for t in others)
    assert len(others) <= 1
    # everything else saved may be recomputed
    assert all(t.recomputable for t in gpt.saved_activations if t not in fixed)


class RandomOps(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(4, 4))

    def forward(self, x):
        h = x @ self.w
        out, mask = torch.ops.aten.native_dropout(h, 0.5, True)
        noise = torch.rand_like(h)
        return (out * noise).sum() + (mask.float() * h).sum()


def test_random_op_outputs_are_not_recomputable():
    prof = build(RandomOps(), (torch.ones(4, 4),))
    by_name = {t.name: t for t in prof.tensors}
    random_targets = {"aten.native_dropout.default", "aten.rand_like.default"}
    random_outs = [t for t in prof.tensors if t.producer is not None
                   and prof.ops[t.producer].target in random_targets]
    assert len(random_outs) == 3                              # out, mask, noise
    assert not any(t.recomputable for t in random_outs)
    assert by_name["mm"].recomputable                         # its input is an ordinary matmul
    assert {t.name for t in prof.saved_activations if not t.recomputable} >= {
        t.name for t in random_outs if t.saved}


# -- aliases ----------------------------------------------------------------------------------
class Views(torch.nn.Module):
    """h = relu(x @ w) is saved once although backward reads it through two views."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        h = torch.relu(x @ self.w.t())
        t = h.t()
        return h.view(-1).sum() + (t * t).sum()


def test_a_view_of_a_saved_tensor_is_counted_once():
    model, x = Views(), torch.randn(8, 8)
    prof = build(model, (x,))
    relu = next(t for t in prof.tensors if t.name == "relu")
    # by hand: the only saved activation storage is h, 8 x 8 float32 = 256 bytes (mm saves the
    # input x and the parameter w, relu's backward and t*t's backward read h and its view)
    assert [t.id for t in prof.saved_activations] == [relu.id]
    assert prof.summary["saved_bytes"] == 256
    assert eager_saved_bytes(type("W", (), {"model": model, "inputs": (x,), "loss_fn": None})) \
        == (256, 1)
    views = [t for t in prof.tensors if t.alias_of == relu.id]
    assert {prof.ops[t.producer].target for t in views} >= {"aten.t.default",
                                                             "aten.view.default"}
    for t in views:
        op = prof.ops[t.producer]
        assert op.bytes == 0 and op.time_us == 0.0 and op.flops == 0
    # a view of a parameter aliases the parameter: no activation bytes, never a candidate
    w = next(t for t in prof.tensors if t.kind == "parameter")
    w_views = [t for t in prof.tensors if t.alias_of == w.id]
    assert w_views and all(t.kind == "activation" for t in w_views)
    assert not any(t.alias_of == w.id for t in prof.saved_activations)


class InPlace(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        h = x @ self.w
        h.mul_(2)
        return (h * h).sum()


def test_in_place_results_alias_their_root_and_make_it_not_recomputable():
    prof = build(InPlace(), (torch.randn(4, 4),))
    mul_ = next(o for o in prof.ops if o.target == "aten.mul_.Tensor" or o.target == "aten.mul_.Scalar")
    out = prof.tensors[mul_.outputs[0]]
    root = prof.tensors[out.alias_of]
    assert prof.ops[root.producer].target == "aten.mm.default"
    assert not root.recomputable                           # re-running mm would miss the * 2
    assert mul_.bytes == 2 * 4 * 4 * 4                     # reads and writes 16 floats in place
    assert [t.id for t in prof.saved_activations] == [root.id]


# -- real and fake traces agree ---------------------------------------------------------------
def test_real_and_fake_traces_give_the_same_graph():
    # without dropout (whose fake trace takes the GPU's fused path) the graphs are identical
    args = {**TINY["tiny_gpt"], "dropout": 0.0}
    work = load_workload(EXAMPLES / "tiny_gpt.py", args=args)
    real = build(work.model, work.inputs)
    fake = profile("tiny_gpt", dropout=0.0)
    assert real.fingerprint == fake.fingerprint
    assert [t.alias_of for t in real.tensors] == [t.alias_of for t in fake.tensors]


# -- header -----------------------------------------------------------------------------------
def test_workload_header_and_env(gpt):
    w, env = gpt.workload, gpt.env
    assert w["name"] == "tiny_gpt" and w["entry"] == "workload"
    assert Path(w["path"]).is_absolute() and w["path"].endswith("examples/tiny_gpt.py")
    assert w["args"] == TINY["tiny_gpt"]
    assert w["input_shapes"] == {"args[0]": [2, 32], "args[1]": [2, 32]}
    assert w["input_dtypes"] == {"args[0]": "int64", "args[1]": "int64"}
    assert env["device"] == "fake" and env["hardware"] == HW.to_dict()
    assert env["torch_version"] == torch.__version__
    assert all(o.time_source == "roofline" for o in gpt.ops)


def test_hugging_face_header_names_keyword_inputs():
    prof = profile("llama_7b")
    assert prof.workload["name"] == "llama-7b"
    assert prof.workload["input_shapes"] == {"input_ids": [2, 32], "labels": [2, 32]}
    modules = {o.module for o in prof.ops}
    assert "model.layers.1.mlp.down_proj" in modules
    assert any(o.target == "aten._scaled_dot_product_flash_attention_for_cpu.default"
               for o in prof.ops)


# -- errors -----------------------------------------------------------------------------------
def write(tmp_path, body):
    path = tmp_path / "model.py"
    path.write_text(body)
    return path


def test_data_dependent_control_flow_under_fake_tensors(tmp_path):
    path = write(tmp_path, """
import torch
class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
    def forward(self, x):
        y = self.lin(x)
        if y.sum().item() > 0:
            y = y * 2
        return y.sum()
def workload():
    return M(), (torch.randn(2, 4),)
""")
    with pytest.raises(TraceError, match="data-dependent") as exc:
        profile_workload(path, device="fake", hardware=HW)
    assert exc.value.hint
    # the refusal names the model's line that read the value
    assert "at model.py:9: if y.sum().item() > 0:" in exc.value.message


def test_output_that_is_not_a_loss(tmp_path):
    path = write(tmp_path, """
import torch
def workload():
    return torch.nn.Linear(4, 3), (torch.randn(2, 4),)
""")
    with pytest.raises(TraceError, match="scalar") as exc:
        profile_workload(path, device="fake", hardware=HW)
    assert "loss_fn" in exc.value.hint or "mean" in exc.value.hint
    path = write(tmp_path, """
import torch
class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)
    def forward(self, x):
        return {"logits": self.lin(x)}
def workload():
    return M(), (torch.randn(2, 4),)
""")
    with pytest.raises(TraceError, match="not a loss"):
        profile_workload(path, device="fake", hardware=HW)


def test_device_errors(tmp_path):
    path = EXAMPLES / "tiny_gpt.py"
    with pytest.raises(InputError, match="unknown device"):
        profile_workload(path, device="tpu", hardware=HW)
    with pytest.raises(InputError, match="hardware"):
        profile_workload(path, device="fake", hardware=None)
    if not torch.cuda.is_available():
        with pytest.raises(InputError, match="CUDA") as exc:
            profile_workload(path, device="cuda", hardware=HW)
        assert "--device fake" in exc.value.hint
