"""The torch versions slackswap was tested with, and every private torch API it uses.

One version check for the parts that read torch's internals (`refuse_untested`): a torch
outside a part's tested set is refused for that part only, naming the version, the tested ones
and what still works; the rest of slackswap runs on it. `PRIVATE_API` lists each private API,
where slackswap uses it, the torch versions it was tested on and what slackswap does without
it; docs/design.md ("Private torch API") shows the same table, and tests/test_torch_api.py
checks that every private torch name the code spells is listed here and that the running
torch has each one.

How a version was tested: the whole test suite passed on it (2.13.0: CI, `make test`; 2.14.1
and 2.15.0: `make test-torch TORCH=...`, PyPI CUDA builds run on a CPU). Another version: add
it to a part's versions after `make test-torch TORCH=x.y.z` passes (and diff
`torch/_functorch/partitioners.py` against the tested ones' for the compiled path).

This module imports no torch at import time (the planners run without torch).
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import SlackswapError

#: minor versions the whole suite passed on
TESTED_TORCH = ("2.13", "2.14", "2.15")


@dataclass(frozen=True)
class Part:
    """A part of slackswap that needs torch internals some versions may not have."""
    what: str              # what the user runs, for the message
    tested: tuple[str, ...]
    hint: str              # what still works / what to do on another version


PARTS = {
    # partitioner hooks, offload passes and node tags of AOTAutograd / inductor
    "compile": Part("compile_planned (and verify --compile)", TESTED_TORCH,
                    "run the plan in eager with patch(model) (verify without --compile): it "
                    "does not read torch's partitioner"),
    # the saved set read from min_cut_rematerialization_partition's private callee
    "torch_choice": Part("compare --with-torch-compile", TESTED_TORCH,
                         "leave --with-torch-compile out: the other planners do not need "
                         "torch's partitioner"),
    # joint._cpu_grouped_mm: fp32/fp16 `_grouped_mm` through 2.13's bf16-only meta rule
    # (2.14's takes bf16 and fp16, not fp32). 2.15's own rule takes fp32/fp16, so the lift is
    # not needed (nor applied) there.
    "grouped_mm_lift": Part("tracing fp32/fp16 aten._grouped_mm with fake tensors",
                            ("2.13", "2.14"),
                            "build the model in bf16, or profile with --device cpu"),
}


def release(version: str | None = None) -> str:
    """'2.15.0+cu132' -> '2.15' (the running torch's when `version` is None)."""
    if version is None:
        import torch  # only here: this module is torch-free ([no torch], design.md)
        version = torch.__version__
    parts = version.split("+")[0].split(".")
    return ".".join(parts[:2])


def is_tested(part: str, version: str | None = None) -> bool:
    return release(version) in PARTS[part].tested


def refuse_untested(part: str, version: str | None = None, *, error=None) -> None:
    """Raise `error` (SlackswapError by default) when `part` was not tested on this torch."""
    if version is None:
        import torch
        version = torch.__version__
    if is_tested(part, version):
        return
    p = PARTS[part]
    raise (error or SlackswapError)(
        f"{p.what} relies on private torch API that changes between versions; it was tested "
        f"with torch {', '.join(v + '.x' for v in p.tested)} only, and this is torch {version}",
        hint=f"install torch {p.tested[-1]}.x, or {p.hint}")


@dataclass(frozen=True)
class PrivateAPI:
    api: str               # the private name (module.attribute, or a tensor attribute)
    used_in: str           # slackswap modules that use it
    tested: tuple[str, ...]
    without: str           # what slackswap does where it is missing or changed


_ALL = TESTED_TORCH
PRIVATE_API: tuple[PrivateAPI, ...] = (
    # eager recorder and runtime -----------------------------------------------------------
    PrivateAPI("torch.utils._python_dispatch.TorchDispatchMode",
               "run/eager/first_call.py, run/eager/branches.py, run/verify/memtrace.py", _ALL,
               "the eager runtime (patch, verify) cannot run: no fallback"),
    PrivateAPI("torch.utils._pytree (tree_map, tree_leaves, tree_flatten)",
               "run/*, trace/*", _ALL, "none (stable in practice since 2.0)"),
    PrivateAPI("Tensor._version, Tensor._base",
               "run/eager/first_call.py, run/eager/holding.py, run/eager/backward.py, run/eager/steady_call.py, "
               "run/verify/excess.py", _ALL,
               "the runtime cannot tell in-place writes and views apart: no fallback"),
    PrivateAPI("UntypedStorage._cdata", "trace/storage.py", _ALL,
               "none: the identity of a fake tensor's storage"),
    # fake tensors and tracing -------------------------------------------------------------
    PrivateAPI("torch._subclasses.fake_tensor (FakeTensorMode, FakeTensor, "
               "unset_fake_temporarily, DataDependentOutputException, "
               "DynamicOutputShapeException; FakeTensor also as torch._subclasses.FakeTensor)",
               "trace/*, run/api.py, run/written/step.py, run/eager/replan.py, run/eager/branches.py, "
               "run/written/code.py", _ALL,
               "no fallback: profiling, replanning and patch(model) need fake tensors"),
    PrivateAPI("torch._subclasses.fake_tensor.CONSTANT_NUMEL_LIMIT, "
               "FakeTensorMode.fake_tensor_converter",
               "trace/fake_build.py", _ALL,
               "no fallback: building a model under fake tensors fails"),
    PrivateAPI("torch._guards.detect_fake_mode", "trace/joint.py", _ALL,
               "tracing a model built under fake tensors fails"),
    PrivateAPI("torch._dynamo.config.error_on_nested_fx_trace (set False while a fake model "
               "is built and its step traced), beside torch.compiler.set_stance('force_eager')",
               "trace/fake_build.py (eager_stance), trace/joint.py", _ALL,
               "read with hasattr/getattr: where missing, a function the model compiles "
               "itself (torchtitan's flex attention) is refused by make_fx or, built under "
               "fake tensors, runs inductor's code on them"),
    PrivateAPI("torch.fx.experimental.proxy_tensor.make_fx (tracing_mode=, "
               "_allow_non_fake_inputs=, _error_on_data_dependent_ops=), get_proxy_mode",
               "trace/joint.py", _ALL, "profiling cannot trace: no fallback"),
    PrivateAPI("torch.utils.checkpoint._checkpoint_without_reentrant_generator (2.13), "
               "_checkpoint_without_reentrant_generator_impl (2.14, 2.15), CheckpointFunction",
               "trace/joint.py", _ALL,
               "a name missing is not replaced: checkpoint regions would trace with their "
               "RNG restore, which is refused"),
    PrivateAPI("torch.nn.init._no_grad_trunc_normal_", "trace/fake_build.py", _ALL,
               "read with getattr: skipped where missing"),
    PrivateAPI("FakeTensor.__deepcopy__, torch.linspace, torch.utils.swap_tensors (replaced "
               "process-wide while a fake model is built, restored in a finally)",
               "trace/fake_build.py", _ALL,
               "public names: replaced and restored on every version"),
    PrivateAPI("torch._ops.OpOverload", "run/written/code.py, trace/graph_profile.py", _ALL,
               "none (isinstance checks on FX node targets)"),
    PrivateAPI("logger names torch._subclasses.fake_tensor, "
               "torch.fx.experimental.proxy_tensor, torch.fx.experimental.symbolic_shapes",
               "trace/joint.py", _ALL, "a renamed logger is simply not silenced"),
    PrivateAPI("torch._meta_registrations._meta_grouped_mm_common, "
               "_create_grouped_mm_output_tensor", "trace/joint.py", ("2.13", "2.14"),
               "only 2.13 and 2.14 need it (their meta rules refuse fp32); elsewhere torch's "
               "rule runs unchanged (2.15's takes fp32/fp16 itself)"),
    # pipeline parallelism: the schedules' order of actions -------------------------------
    PrivateAPI("torch.distributed.pipelining._schedule_visualizer.get_schedule_ops; "
               "torch.distributed.pipelining.schedules._PipelineSchedule, "
               "_PipelineScheduleRuntime (sends waited at the step's end; from 2.15 a "
               "forward send after its microbatch's backward), _Action "
               "(computation_type, stage_index, microbatch_index, sub_actions)",
               "run/parallel/pipeline.py", ("2.13", "2.14", "2.15"),
               "plan_pipeline and schedule_order fail where missing: no fallback (the "
               "torch-free slackswap_cli.pipeline.stages takes an order written by hand)"),
    PrivateAPI("torch.distributed.pipelining._backward.stage_backward_input (returns the "
               "parameter groups: 'grads' captured at their 'intermediates')",
               "run/parallel/split_backward.py", ("2.13",),
               "plan_pipeline fails for a split-backward schedule where missing: no fallback"),
    # tensor parallelism: DTensor models traced and run on their local shards --------------
    PrivateAPI("DTensor._local_tensor (the local shard, the very tensor its op made); "
               "torch.distributed._functional_collectives.AsyncCollectiveTensor (elem, "
               "completed, trigger_wait); Module._distribute_module_applied, "
               "Module._forward_pre_hooks, Module._forward_hooks (our body hooks put before "
               "the ones distribute_module added)",
               "run/parallel/dtensor.py, trace/dtensor.py, run/verify/memtrace.py", _ALL,
               "a tensor parallel model's saved DTensors are not placed (the pack fails) and "
               "its TP hooks' ops do not line up: no fallback"),
    # compiled path: compile_planned, verify --compile, compare --with-torch-compile --------
    PrivateAPI("torch._functorch.partitioners.min_cut_rematerialization_partition, "
               "get_default_op_list", "run/compiled/backend.py, run/compiled/offload.py, trace/torch_choice.py", _ALL,
               "refused by version (PARTS['compile'], PARTS['torch_choice'])"),
    PrivateAPI("torch._functorch.partitioners._extract_fwd_bwd_modules (2nd argument: "
               "saved_values)", "trace/torch_choice.py", _ALL,
               "refused by version (PARTS['torch_choice'])"),
    PrivateAPI("torch._functorch.partitioners._extract_fwd_bwd_outputs",
               "run/compiled/graph_ops.py (the CSE key of 2.14 and 2.15 only)", ("2.14", "2.15"),
               "used where fx_graph_cse takes extra_node_key (2.14, 2.15); not on 2.13"),
    PrivateAPI("torch._functorch.compile_utils.fx_graph_cse (extra_node_key= on 2.14, 2.15)",
               "run/compiled/graph_ops.py", _ALL, "refused by version (PARTS['compile'])"),
    PrivateAPI("torch._functorch.config (cse, activation_memory_budget, patch)",
               "run/compiled/backend.py, trace/torch_choice.py", _ALL, "refused by version"),
    PrivateAPI("torch._functorch._activation_offloading.activation_offloading "
               "(offload_chosen_sets[_async], activation_offload_sink_wait_async, "
               "activation_reload_prefetch_async, CPU_OFFLOAD_PREFIX)",
               "run/compiled/offload.py, run/compiled/report.py", _ALL, "refused by version (PARTS['compile'])"),
    PrivateAPI("node.meta keys recompute (CheckpointPolicy), should_offload, "
               "saved_for_offloading, original_aten, from_node, val",
               "run/compiled/tags.py, offload.py, graph_ops.py, report.py", _ALL,
               "refused by version (PARTS['compile'])"),
    PrivateAPI("torch._guards.CompileContext.current_compile_id", "run/compiled/backend.py", _ALL,
               "refused by version (PARTS['compile']): the graph reports' compile ids"),
    PrivateAPI("torch._dynamo.backends.common.aot_autograd, "
               "torch._dynamo.backends.debugging.boxed_nop", "run/compiled/backend.py", _ALL,
               "refused by version (PARTS['compile'])"),
    PrivateAPI("torch._inductor.custom_graph_pass.CustomPartitionerFn, inductor options "
               "custom_partitioner_fn, fx_graph_cache", "run/compiled/backend.py", _ALL,
               "refused by version (PARTS['compile'])"),
    PrivateAPI("SymInt.node (torch.fx.experimental.sym_node.SymNode: .expr, the sympy size "
               "expression; .hint)",
               "run/compiled/sym_sizes.py", _ALL,
               "refused by version (PARTS['compile']): a graph with symbolic sizes is read "
               "without guards through them"),
    # outside the package: the GPU check's race run, enabled by environment variable
    PrivateAPI("torch.cuda._sanitizer (TORCH_CUDA_SANITIZER=1; CUDASanitizerErrors, by name)",
               "slackswap_testkit/race_check.py (benchmarks/gpu_check.py)", _ALL,
               "the race check's row records the step's error instead of a race: its "
               "bitwise check still runs"),
)
