"""torch_api: one version check for the parts that read torch internals, and a list of every
private torch API slackswap uses (checked against the code and against the running torch)."""
import ast
import importlib
import re
from pathlib import Path

import pytest
import torch

from slackswap_cli import torch_api
from slackswap_cli.errors import InputError, SlackswapError

SRC = Path(torch_api.__file__).parent


def test_release_and_refusal_name_the_versions():
    assert torch_api.release("2.15.0+cu132") == "2.15"
    assert torch_api.release("2.13.1") == "2.13"
    assert torch_api.is_tested("compile", "2.13.0+cpu")
    assert torch_api.is_tested("compile", "2.14.1")
    assert torch_api.is_tested("compile", "2.15.0")
    assert not torch_api.is_tested("compile", "2.16.0")
    assert not torch_api.is_tested("compile", "2.150.0")
    with pytest.raises(SlackswapError, match=r"torch 2\.13\.x, 2\.14\.x, 2\.15\.x only, and "
                                             r"this is torch 2\.16\.0") as e:
        torch_api.refuse_untested("compile", "2.16.0")
    assert "patch(model)" in e.value.hint
    with pytest.raises(InputError, match=r"torch 2\.12\.0"):
        torch_api.refuse_untested("torch_choice", "2.12.0", error=InputError)
    torch_api.refuse_untested("compile", "2.15.0+cu132")


def test_running_torch_is_a_tested_one_for_the_compiled_path():
    """The suite is run on tested versions only (CI: 2.13; make test-torch: the others)."""
    assert torch_api.is_tested("compile"), (
        f"torch {torch.__version__} is not in torch_api.TESTED_TORCH: run the suite and add it")


def test_every_private_torch_name_the_code_spells_is_listed():
    """Each `torch...._name` (and torch.fx.experimental.*) in slackswap_cli's code (comments
    aside) is named in a PRIVATE_API row."""
    pattern = re.compile(r"\b(torch(?:\.[A-Za-z0-9_]+)*\._[A-Za-z0-9_]+|"
                         r"torch\.fx\.experimental\.[A-Za-z0-9_]+)")
    public = ("torch.__version__", "torch.__file__", "torch.ops.", "torch.Tensor.__")
    listed = " ".join(a.api for a in torch_api.PRIVATE_API)
    missing = {}
    for path in SRC.rglob("*.py"):
        if path.name == "torch_api.py":
            continue
        for line in path.read_text().splitlines():
            for m in pattern.finditer(line.split("#")[0]):
                name = m.group(1)
                if not name.startswith(public) and name not in listed:
                    missing.setdefault(name, str(path.relative_to(SRC)))
    assert not missing, f"private torch names used but not in torch_api.PRIVATE_API: {missing}"


def _private_uses(tree) -> set[str]:
    """The private torch names a module imports (`from torch._x import y` -> torch._x.y,
    `import torch._x`) or spells as an attribute chain (`torch._ops.OpOverload`)."""
    def dotted(n):
        parts = []
        while isinstance(n, ast.Attribute):
            parts.append(n.attr)
            n = n.value
        return ".".join([n.id, *reversed(parts)]) if isinstance(n, ast.Name) else ""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
            names |= {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names if a.name.startswith("torch")}
        elif isinstance(node, ast.Attribute) and not isinstance(getattr(node, "parent", None),
                                                                ast.Attribute):
            names.add(dotted(node))
    return {n for n in names if n.startswith("torch.") and not n.startswith("torch.ops.")
            and (re.search(r"\._[a-z]", n) or ".fx.experimental." in n)}


def test_each_private_import_is_in_a_row_naming_its_module_and_attribute():
    """Stricter than the text scan above: a private name the code imports or reaches through
    `torch.` must appear in one PRIVATE_API row, its module and its last attribute in that
    same row (`from torch._guards import CompileContext` is not covered by a row that lists
    only `torch._guards.detect_fake_mode`)."""
    def covered(name):
        for a in torch_api.PRIVATE_API:
            if name in a.api:
                return True
            module, _, attr = name.rpartition(".")
            if re.search(rf"\b{re.escape(module)}\b", a.api) and re.search(
                    rf"\b{re.escape(attr)}\b", a.api):
                return True
        return False
    missing = {}
    for path in SRC.rglob("*.py"):
        if path.name == "torch_api.py":
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):          # mark parents: only whole chains are names
            for child in ast.iter_child_nodes(node):
                child.parent = node
        for name in _private_uses(tree):
            if not covered(name):
                missing.setdefault(name, str(path.relative_to(SRC)))
    assert not missing, f"private torch names not in a torch_api.PRIVATE_API row: {missing}"


@pytest.mark.parametrize("name", [
    "torch.utils._python_dispatch.TorchDispatchMode",
    "torch.utils._pytree.tree_map",
    "torch._subclasses.fake_tensor.FakeTensorMode",
    "torch._subclasses.fake_tensor.FakeTensor",
    "torch._subclasses.fake_tensor.unset_fake_temporarily",
    "torch._subclasses.fake_tensor.CONSTANT_NUMEL_LIMIT",
    "torch._subclasses.fake_tensor.DataDependentOutputException",
    "torch._subclasses.fake_tensor.DynamicOutputShapeException",
    "torch._guards.detect_fake_mode",
    "torch.fx.experimental.proxy_tensor.make_fx",
    "torch.fx.experimental.proxy_tensor.get_proxy_mode",
    "torch._functorch.partitioners.min_cut_rematerialization_partition",
    "torch._functorch.partitioners.get_default_op_list",
    "torch._functorch.partitioners._extract_fwd_bwd_modules",
    "torch._functorch.partitioners._extract_fwd_bwd_outputs",
    "torch._functorch.compile_utils.fx_graph_cse",
    "torch._functorch.config.cse",
    "torch._functorch.config.activation_memory_budget",
    "torch._functorch._activation_offloading.activation_offloading.offload_chosen_sets",
    "torch._functorch._activation_offloading.activation_offloading.offload_chosen_sets_async",
    "torch._functorch._activation_offloading.activation_offloading.CPU_OFFLOAD_PREFIX",
    "torch._functorch._activation_offloading.activation_offloading."
    "activation_offload_sink_wait_async",
    "torch._functorch._activation_offloading.activation_offloading."
    "activation_reload_prefetch_async",
    "torch._dynamo.backends.common.aot_autograd",
    "torch._dynamo.backends.debugging.boxed_nop",
    "torch._inductor.custom_graph_pass.CustomPartitionerFn",
    "torch.fx.experimental.sym_node.SymNode",
    "torch._guards.CompileContext",
    "torch._dynamo.config.error_on_nested_fx_trace",
    "torch._subclasses.FakeTensor",
    "torch.cuda._sanitizer.CUDASanitizerErrors",
])
def test_the_private_api_is_in_this_torch(name):
    module, attr = name.rsplit(".", 1)
    assert hasattr(importlib.import_module(module), attr), f"{name} is gone in torch {torch.__version__}"


def test_tensor_internals_are_in_this_torch():
    x = torch.ones(4)
    v = x[:2]
    assert v._base is x and x._base is None
    before = x._version
    x.add_(1)
    assert x._version == before + 1
    assert isinstance(x.untyped_storage()._cdata, int)


@pytest.mark.skipif(not torch.distributed.is_available(), reason="no torch.distributed")
def test_pipeline_and_tensor_parallel_internals_are_in_this_torch():
    """The PRIVATE_API rows of run/parallel/pipeline.py and the tensor parallel code, as they use them:
    an `_Action`'s fields, the compute kinds `_steps` reads, the schedule classes,
    `get_schedule_ops`' keyword, AsyncCollectiveTensor's slots and `distribute_module`'s mark."""
    import inspect

    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.pipelining import _schedule_visualizer, schedules
    from torch.distributed.tensor import _api as dtensor_api
    from torch.distributed.tensor import distribute_module

    fields = schedules._Action._fields
    assert {"stage_index", "computation_type", "microbatch_index", "sub_actions"} <= set(fields)
    kinds = {c.value for c in schedules._ComputationType}
    assert {"F", "B", "I", "W"} <= kinds, kinds
    assert issubclass(schedules.ScheduleInterleaved1F1B, schedules._PipelineScheduleRuntime)
    assert issubclass(schedules._PipelineScheduleRuntime, schedules._PipelineSchedule)
    params = inspect.signature(_schedule_visualizer.get_schedule_ops).parameters
    assert "num_stages_per_rank" in params
    assert {"elem", "completed"} <= set(AsyncCollectiveTensor.__slots__)
    assert hasattr(AsyncCollectiveTensor, "trigger_wait")
    assert "r._local_tensor = local_tensor" in inspect.getsource(dtensor_api)
    assert "_distribute_module_applied" in inspect.getsource(distribute_module)


def test_the_design_doc_shows_every_row():
    text = (SRC.parent / "docs" / "torch_api.md").read_text()
    for a in torch_api.PRIVATE_API:
        row = f"| `{a.api}` | {a.used_in} | {', '.join(a.tested)} | {a.without} |"
        assert row in text, f"docs/torch_api.md lacks (or has another) row: {row}"
