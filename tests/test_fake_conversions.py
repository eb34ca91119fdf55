"""--device fake builds models the way people write them: `.to(torch.bfloat16)`, `.half()`,
`.float()`, `.to("cpu")` after building, and value-dependent init (`trunc_normal_`)."""
import textwrap
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from typer.testing import CliRunner

from slackswap_cli.cli import app
from slackswap_cli.errors import TraceError
from slackswap_cli.hardware import load_hardware
from slackswap_cli.trace import profile_workload
from slackswap_cli.trace.workload import load_workload

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
HW = load_hardware("a100-pcie4")


def write(tmp_path, body, name="model.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


CONVERTED = """
    import torch

    def workload(conv="to_bf16"):
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        model = {{"to_bf16": lambda m: m.to(torch.bfloat16),
                 "half": lambda m: m.half(),
                 "half_float": lambda m: m.half().float(),
                 "to_cpu": lambda m: m.to("cpu"),
                 "bfloat16": lambda m: m.bfloat16(),
                 "both": lambda m: m.to(device="cpu", dtype=torch.bfloat16)}}[conv](model)
        dtype = next(model.parameters()).dtype
        return model, (torch.ones(3, 4, dtype=dtype),), lambda out, inputs: out.float().sum()
"""


@pytest.mark.parametrize("conv,dtype", [("to_bf16", torch.bfloat16), ("half", torch.float16),
                                        ("half_float", torch.float32), ("to_cpu", torch.float32),
                                        ("bfloat16", torch.bfloat16), ("both", torch.bfloat16)])
def test_module_conversions_work_on_fake_parameters(tmp_path, conv, dtype):
    work = load_workload(write(tmp_path, CONVERTED.format()), args={"conv": conv},
                         fake_mode=FakeTensorMode())
    params = list(work.model.parameters())
    assert len(params) == 4
    for p in params:
        assert isinstance(p, FakeTensor) and isinstance(p, torch.nn.Parameter)
        assert p.dtype == dtype and p.device.type == "cpu" and p.requires_grad
    # and the converted model traces into a profile
    prof = profile_workload(str(tmp_path / "model.py"), args={"conv": conv}, device="fake",
                            hardware=HW)
    assert prof.saved_activations


def test_conversion_keeps_tied_weights_tied(tmp_path):
    path = write(tmp_path, """
        import torch

        class Tied(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = torch.nn.Embedding(16, 8)
                self.head = torch.nn.Linear(8, 16, bias=False)
                self.head.weight = self.emb.weight

            def forward(self, ids):
                return self.head(self.emb(ids)).float().logsumexp(-1).mean()

        def workload():
            return Tied().to(torch.bfloat16), (torch.zeros(2, 3, dtype=torch.long),)
    """)
    model = load_workload(path, fake_mode=FakeTensorMode()).model
    assert model.head.weight is model.emb.weight
    assert model.emb.weight.dtype == torch.bfloat16
    assert len(list(model.parameters())) == 1


def test_trunc_normal_init_works_under_fake_tensors_and_still_draws_for_real(tmp_path):
    path = write(tmp_path, """
        import torch

        def workload():
            model = torch.nn.Linear(4, 4)
            torch.nn.init.trunc_normal_(model.weight, std=0.02, a=-0.03, b=0.03)
            return model, (torch.ones(2, 4),), lambda out, inputs: out.sum()
    """)
    fake = load_workload(path, fake_mode=FakeTensorMode())
    assert isinstance(fake.model.weight, FakeTensor)
    real = load_workload(path)   # outside the fake build, torch's own init runs and draws
    w = real.model.weight.detach()
    assert w.abs().max() <= 0.03 and w.std() > 0
    original = torch.nn.init._no_grad_trunc_normal_
    assert getattr(original, "__module__", "") == "torch.nn.init"
    assert torch.utils.swap_tensors.__module__ == "torch.utils"


def test_hugging_face_vit_init_and_half_under_fake_tensors(tmp_path):
    pytest.importorskip("transformers")
    path = write(tmp_path, """
        import torch
        from transformers import ViTConfig, ViTForImageClassification

        def workload():
            config = ViTConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                               intermediate_size=37, image_size=32, patch_size=8, num_labels=3)
            model = ViTForImageClassification(config).half()   # init calls trunc_normal_
            pixels = torch.randn(2, 3, 32, 32, dtype=torch.float16)
            return model, {"pixel_values": pixels, "labels": torch.tensor([0, 2])}
    """)
    work = load_workload(path, fake_mode=FakeTensorMode())
    assert {p.dtype for p in work.model.parameters()} == {torch.float16}
    prof = profile_workload(str(path), device="fake", hardware=HW)
    assert prof.saved_activations


def test_value_dependent_build_code_gets_a_clear_error(tmp_path):
    path = write(tmp_path, """
        import torch

        def workload():
            model = torch.nn.Linear(4, 4)
            if model.weight.sum() > 0:
                model.weight.data.neg_()
            return model, (torch.ones(2, 4),), lambda out, inputs: out.sum()
    """)
    with pytest.raises(TraceError, match=r"reads a tensor's values while building \(model.py:6\)") as exc:
        load_workload(path, fake_mode=FakeTensorMode())
    assert "--device cpu" in exc.value.hint
    load_workload(path)   # fine on real tensors


BUILT = """
    import sys, torch
    sys.path.insert(0, {examples!r})
    from tiny_gpt import TinyGPT

    def workload(direct=False, dropout=0.1):
        torch.manual_seed(0)
        if direct:   # built in bf16 from the start
            torch.set_default_dtype(torch.bfloat16)
            try:
                model = TinyGPT(64, 16, 1, 32, 4, dropout)
            finally:
                torch.set_default_dtype(torch.float32)
        else:        # built in fp32, then converted
            model = TinyGPT(64, 16, 1, 32, 4, dropout).to(torch.bfloat16)
        idx = torch.randint(0, 64, (2, 16))
        return model, (idx, idx)
"""


def test_fake_profile_of_to_bf16_equals_the_model_built_in_bf16(tmp_path):
    path = str(write(tmp_path, BUILT.format(examples=str(EXAMPLES))))
    converted = profile_workload(path, args={"direct": False}, device="fake", hardware=HW)
    direct = profile_workload(path, args={"direct": True}, device="fake", hardware=HW)
    assert converted.fingerprint == direct.fingerprint
    assert {t.dtype for t in converted.tensors if t.kind == "parameter"} == {"bfloat16"}


def test_real_cpu_to_bf16_still_works_and_matches_a_fake_cpu_trace(tmp_path):
    path = str(write(tmp_path, BUILT.format(examples=str(EXAMPLES))))
    real = profile_workload(path, device="cpu")
    fake = profile_workload(path, device="fake:cpu", hardware=HW)
    assert real.fingerprint == fake.fingerprint
    assert {t.dtype for t in real.tensors if t.kind == "parameter"} == {"bfloat16"}


@pytest.mark.slow
def test_llama_written_with_to_bf16_profiles_plans_applies_and_verifies(tmp_path):
    """A tiny `LlamaForCausalLM(config).to(torch.bfloat16)` profiled with
    --device fake (exit 3 before), planned at half its peak, applied and verified on this CPU."""
    pytest.importorskip("transformers")
    tiny = ["--arg", "n_layer=1", "--arg", "hidden=32", "--arg", "n_head=2",
            "--arg", "intermediate=64", "--arg", "seq=8", "--arg", "vocab=64"]
    runner = CliRunner()

    def run(*args):
        r = runner.invoke(app, [str(a) for a in args])
        assert r.exit_code == 0, r.stdout + r.stderr
        return r

    prof, plan, patched = tmp_path / "llama.json", tmp_path / "plan.json", tmp_path / "llama_p.py"
    run("profile", EXAMPLES / "llama_7b_to_bf16.py", "--device", "fake", *tiny, "-o", prof)
    assert '"bfloat16"' in prof.read_text()
    run("plan", prof, "--budget", "0.5", "-o", plan)
    run("apply", plan, "-o", patched)
    r = run("verify", patched, "--steps", "2")
    assert "PASSED" in r.stdout


def test_settings_computed_with_linspace_work_under_fake_tensors(tmp_path):
    """`torch.linspace(0, rate, n).tolist()` (stochastic depth in ConvNeXt and many vision
    models) gives the same numbers while building under fake tensors as for real."""
    path = write(tmp_path, """
        import torch

        def workload(n=4):
            rates = [x.item() for x in torch.linspace(0, 0.3, n)]
            big = torch.linspace(0, 1, 10_000)            # large: stays an ordinary fake tensor
            model = torch.nn.Sequential(*[torch.nn.Dropout(r) for r in rates],
                                        torch.nn.Linear(4, 4))
            return model, (torch.ones(2, 4),), lambda out, inputs: out.sum()
    """)
    fake = load_workload(path, fake_mode=FakeTensorMode()).model
    real = load_workload(path).model
    assert [m.p for m in fake[:4]] == [m.p for m in real[:4]] == pytest.approx([0, 0.1, 0.2, 0.3])
    assert torch.linspace.__module__ != __name__ and "fake_build" not in torch.linspace.__module__


def test_hugging_face_convnext_with_drop_path_profiles_under_fake_tensors(tmp_path):
    pytest.importorskip("transformers")
    path = write(tmp_path, """
        import torch
        from transformers import ConvNextConfig, ConvNextForImageClassification

        def workload():
            config = ConvNextConfig(hidden_sizes=[8, 16], depths=[1, 1], num_stages=2,
                                    num_labels=3, drop_path_rate=0.1)
            model = ConvNextForImageClassification(config).to(torch.bfloat16)
            pixels = torch.randn(2, 3, 32, 32, dtype=torch.bfloat16)
            return model, {"pixel_values": pixels, "labels": torch.tensor([0, 2])}
    """)
    prof = profile_workload(str(path), device="fake", hardware=HW)
    assert prof.saved_activations


def test_process_wide_replacements_are_undone_after_an_exception():
    """`fake_build` replaces torch functions process-wide while a fake model is built (and
    sets dynamo's stance to force_eager and its error_on_nested_fx_trace off: `eager_stance`),
    and `branches.eager_branches` tells transformers its tensors are not fake during one trace:
    both put everything back when the code inside raises."""
    import pytest
    import transformers.utils.import_utils as tu
    from torch._dynamo import config as dynamo_config
    from torch._dynamo import eval_frame
    from torch._subclasses import fake_tensor as ft
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from slackswap_cli.run.eager.branches import eager_branches
    from slackswap_cli.trace.fake_build import fake_build

    def state():
        return (torch.utils.swap_tensors, torch.linspace, ft.CONSTANT_NUMEL_LIMIT,
                FakeTensor.__dict__.get("__deepcopy__"),
                getattr(torch.nn.init, "_no_grad_trunc_normal_", None), tu.is_fake_tensor,
                eval_frame._stance.stance, dynamo_config.error_on_nested_fx_trace)
    before = state()
    assert before[-2:] == ("default", True)
    with pytest.raises(RuntimeError, match="inside"):
        with fake_build(FakeTensorMode()):
            assert torch.linspace is not before[1]           # (replaced while active)
            assert state()[-2:] == ("force_eager", False)
            raise RuntimeError("inside")
    assert all(a is b for a, b in zip(state(), before))
    shadow = torch.nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match="inside"):
        with eager_branches(shadow, []):
            assert not tu.is_fake_tensor(FakeTensorMode().from_tensor(torch.ones(1)))
            raise RuntimeError("inside")
    assert all(a is b for a, b in zip(state(), before)) and "forward" not in shadow.__dict__


COMPILED_INSIDE = """
    import torch, torch.nn as nn, torch.nn.functional as F

    # compiled at import, as torchtitan 0.3.0 compiles create_block_mask and flex_attention
    scale = torch.compile(lambda x, s: x * s)
    band = torch.compile(lambda pos: (pos[:, None] >= pos[None, :]).float())

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

        def forward(self, x, mask):
            h = scale(F.gelu(self.fc1(x)), 2.0)
            return (mask @ self.fc2(h)).pow(2).mean()

    def workload():
        torch.manual_seed(0)
        return Net(), (torch.randn(4, 8), band(torch.arange(4)))
"""


def test_functions_the_model_compiled_itself_build_and_trace_under_fake_tensors(tmp_path):
    """A workload that builds an input with a `torch.compile`d function and calls another in
    forward profiles with --device fake: both run their Python there (`eager_stance`), where
    inductor's code would run on fake tensors (a segmentation fault on torch 2.13 and 2.15,
    hence a process of its own) and make_fx would refuse dynamo's frame."""
    import json
    import os
    import subprocess
    import sys
    path = write(tmp_path, COMPILED_INSIDE)
    out = tmp_path / "p.json"
    exe = os.path.join(os.path.dirname(sys.executable), "slackswap")
    res = subprocess.run([exe, "profile", str(path), "--device", "fake", "--hardware",
                          "a100-pcie4", "-o", str(out)], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, (res.returncode, res.stderr[-2000:])
    ops = [o["target"] for o in json.loads(out.read_text())["ops"]]
    assert "aten.gelu.default" in ops and "aten.mul.Tensor" in ops, ops
