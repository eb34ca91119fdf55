"""Workload files: --arg parsing, loading, and a clear error for every way a workload can be wrong."""
import textwrap

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from slackswap_cli import Workload
from slackswap_cli.errors import InputError, TraceError
from slackswap_cli.trace.workload import (
    load_entry,
    load_workload,
    parse_workload_args,
    workload_name,
)


# -- --arg ----------------------------------------------------------------------------------
def test_args_are_python_literals_and_bare_words_are_strings():
    got = parse_workload_args(["n_layer=2", "p=0.5", "flag=True", "none=None", "shape=(1, 2)",
                               "name='a b'", "dtype=bfloat16", "path=dir/file.txt"])
    assert got == {"n_layer": 2, "p": 0.5, "flag": True, "none": None, "shape": (1, 2),
                   "name": "a b", "dtype": "bfloat16", "path": "dir/file.txt"}
    assert parse_workload_args([]) == {} and parse_workload_args(None) == {}


@pytest.mark.parametrize("item", ["n_layer", "=3", "1x=3", "a-b=3", "x=(1,", "x=a b", "x=[1"])
def test_bad_args_raise_input_error_with_hint(item):
    with pytest.raises(InputError) as exc:
        parse_workload_args([item])
    assert item.split("=")[0] in exc.value.message or "--arg" in exc.value.message
    assert exc.value.hint


def test_repeated_arg_is_an_error():
    with pytest.raises(InputError, match="twice"):
        parse_workload_args(["a=1", "a=2"])


# -- loading --------------------------------------------------------------------------------
def write(tmp_path, body, name="model.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


GOOD = """
    import torch
    NAME = "lin"

    def workload(n=3, bias=True):
        model = torch.nn.Linear(n, 1, bias=bias)
        return model, (torch.ones(2, n),), lambda out, inputs: out.sum()

    def other():
        return workload(n=5)
"""


def test_load_tuple_with_loss_fn_and_args(tmp_path):
    path = write(tmp_path, GOOD)
    work = load_workload(path, args={"n": 4})
    assert isinstance(work, Workload) and work.model.in_features == 4
    assert work.loss_fn(work.model(*work.inputs), work.inputs).dim() == 0
    assert load_workload(path, entry="other").model.in_features == 5
    work, module = load_entry(path)
    assert workload_name(module, path) == "lin"


def test_name_defaults_to_file_stem(tmp_path):
    path = write(tmp_path, GOOD.replace('NAME = "lin"', ""), name="my-net.py")
    _, module = load_entry(path)
    assert workload_name(module, path) == "my-net"


def test_same_file_name_in_two_folders_does_not_clash(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    pa = write(tmp_path / "a", GOOD)
    pb = write(tmp_path / "b", GOOD.replace("torch.nn.Linear(n, 1", "torch.nn.Linear(n, 2"))
    assert load_workload(pa).model.out_features == 1
    assert load_workload(pb).model.out_features == 2


def test_workload_dataclass_and_dict_inputs_accepted(tmp_path):
    path = write(tmp_path, """
        import torch
        from slackswap_cli import Workload

        class M(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = torch.nn.Linear(2, 2)
            def forward(self, x, scale=1.0):
                return self.lin(x).sum() * scale

        def workload():
            return Workload(M(), {"x": torch.ones(1, 2), "scale": 2.0})
    """)
    work = load_workload(path)
    assert isinstance(work.inputs, dict) and work.loss_fn is None


def test_fake_mode_builds_fake_model_and_inputs(tmp_path):
    path = write(tmp_path, GOOD)
    work = load_workload(path, args={"n": 1 << 14}, fake_mode=FakeTensorMode())
    assert isinstance(work.model.weight, FakeTensor)
    assert isinstance(work.inputs[0], FakeTensor)


def test_model_built_outside_entry_is_refused_under_fake(tmp_path):
    path = write(tmp_path, """
        import torch
        MODEL = torch.nn.Linear(2, 1)
        def workload():
            return MODEL, (torch.ones(1, 2),), lambda o, i: o.sum()
    """)
    with pytest.raises(TraceError, match="inside workload") as exc:
        load_workload(path, fake_mode=FakeTensorMode())
    assert "--device cpu" in exc.value.hint


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a torch without CUDA")
def test_cuda_tensors_under_fake_mode_without_cuda_are_refused(tmp_path):
    path = write(tmp_path, """
        import torch
        def workload():
            model = torch.nn.Linear(2, 1, device="cuda")
            return model, (torch.ones(1, 2, device="cuda"),), lambda o, i: o.sum()
    """)
    # a clean error now, rather than a process abort at the first traced op
    with pytest.raises(InputError, match="CUDA") as exc:
        load_workload(path, fake_mode=FakeTensorMode())
    assert "CPU" in exc.value.hint


def test_device_moves_model_and_inputs(tmp_path):
    work = load_workload(write(tmp_path, GOOD), device="cpu")
    assert work.model.weight.device.type == "cpu" and work.inputs[0].device.type == "cpu"


# -- errors ---------------------------------------------------------------------------------
def test_missing_file(tmp_path):
    with pytest.raises(InputError, match="does not exist") as exc:
        load_workload(tmp_path / "nope.py")
    assert exc.value.hint


def test_directory_is_not_a_workload(tmp_path):
    with pytest.raises(InputError, match="directory"):
        load_workload(tmp_path)


def test_no_entry_function_lists_the_functions(tmp_path):
    path = write(tmp_path, GOOD)
    with pytest.raises(InputError, match="no function named 'train'") as exc:
        load_workload(path, entry="train")
    assert "workload" in exc.value.hint and "other" in exc.value.hint and "--entry" in exc.value.hint


def test_unknown_argument_shows_the_signature(tmp_path):
    with pytest.raises(InputError, match="does not take") as exc:
        load_workload(write(tmp_path, GOOD), args={"layers": 2})
    assert "bias" in exc.value.hint


def test_workload_that_raises(tmp_path):
    path = write(tmp_path, """
        def workload():
            raise ValueError("out of cheese")
    """)
    with pytest.raises(TraceError, match="out of cheese") as exc:
        load_workload(path)
    assert exc.value.hint


def test_file_that_fails_to_import(tmp_path):
    with pytest.raises(TraceError, match="ModuleNotFoundError"):
        load_workload(write(tmp_path, "import no_such_module_here\n"))


def test_syntax_error(tmp_path):
    with pytest.raises(InputError, match="syntax error at line 2"):
        load_workload(write(tmp_path, "x = 1\ndef workload(:\n"))


@pytest.mark.parametrize("ret, needle", [
    ("torch.nn.Linear(2, 1)", "returned a Linear"),
    ("(torch.nn.Linear(2, 1),)", "of length 1"),
    ("('model', (torch.ones(1),))", "not a torch.nn.Module"),
    ("(torch.nn.Linear(2, 1), 3)", "inputs of type int"),
    ("(torch.nn.Linear(2, 1), (1, 2))", "without any tensor"),
    ("(torch.nn.Linear(2, 1), (torch.ones(1, 2),), 'loss')", "not callable"),
])
def test_wrong_return_shapes(tmp_path, ret, needle):
    path = write(tmp_path, f"""
        import torch
        def workload():
            return {ret}
    """)
    with pytest.raises(TraceError, match=needle) as exc:
        load_workload(path)
    assert "(model, inputs)" in exc.value.hint or "loss" in exc.value.hint or "inputs" in exc.value.hint
