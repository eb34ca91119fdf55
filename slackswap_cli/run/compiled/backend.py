"""`compile_planned(model)`: the plan carried out inside `torch.compile`.

How the plan reaches the graph. torch.compile hands AOTAutograd's joint forward+backward graph
of each captured piece (one per graph break, one per compiled block) to a *partition function*
that splits it into the forward and backward graphs. `compile_planned` passes its own
(`PlanPartition`): it lines the graph's forward ops up with the profile's (`graph_plan.line_up`:
op overload, occurrence, result shapes and dtypes), tags what lines up and then calls torch's
own `min_cut_rematerialization_partition`:

- a root the plan keeps: `node.meta["recompute"] = MUST_SAVE` (the partitioner may not
  recompute it, so it is saved when backward reads it);
- an op a recompute chain of the plan re-runs: `MUST_RECOMPUTE` (the partitioner re-runs it in
  backward, from what is saved);
- a root the plan swaps: `MUST_SAVE` and `should_offload`; after partitioning, the saved value
  is offloaded with torch's own insertion passes (`_activation_offloading`): `device_put` to
  the host after its last forward use and back before its first backward use; on CUDA with
  torch's `ao.offload`/`ao.reload` on a side stream, waits sunk to the end of forward and
  reloads prefetched (`activation_offload_sink_wait`, `activation_reload_prefetch`). torch's
  own chooser (`choose_offload_sets`) refuses getitem nodes, so every output of a multi-output
  op (layer norm's result, dropout's mask) would stay on the device; slackswap marks the
  nodes itself (`saved_for_offloading`) and refuses only what the insertion cannot carry:
  views, tensors that do not cover their storage and graph inputs (counted as `refused`). A
  saved value that is also a model output (a KV cache's tensor) is offloaded for backward
  while the caller gets the device tensor, as in eager (torch's own chooser refuses it).

A CPU dropout run of the profile (`scaled_dot_product_attention`'s math path calls `at::dropout`
from C++, traced as `empty_like`, `bernoulli_`, `div_`, `mul`) lines up with the graph's
`native_dropout` (`graph_plan.graph_units`); where the plan recomputes its result and keeps its
mask, a graph holding native_dropout as one random node (aot_eager; inductor with
`fallback_random`) gets the result re-made as `input * mask * scale`, equal bit for bit in
fp32, so backward can recompute it (inductor without it decomposes native_dropout itself).
Views of an offloaded or recomputed result are re-derived in backward (tagged MUST_RECOMPUTE;
`verify` counts them apart from recomputed ops). The partitioner's CSE runs first; rows that
line up only before it (an op merged into an identical earlier one) are reported as merged.

Inductor changes the graph before partitioning in two ways the plan is carried through: its
no-op removal drops a copy (a `clone` keeping its input's layout, a `cat` of one tensor: a
Hugging Face KV cache's first `torch.cat([empty, key_states])`), whose row then lines up with
nothing: the op whose whole result it copied (`graph_plan.copies`) takes its decision
(`stand_in_copies`); and a decomposed reader (layer norm) may read values of its own instead
of a root the plan swaps: those are offloaded in the root's place (`substitute_unread`).
And the partitioner may move the part of a decomposed backward op that reads only one
offloaded or recomputed root into forward and save its result instead (GPT-2's
`1 - tanh(x)**2`, a transposed copy of an attention input): every value made from such roots
alone is re-derived in backward (`derived.tag_derived`), so the root is what is saved.

Ops that do not line up are left to the partitioner; how many line up is said once per graph
on stderr. Nothing global changes: the backend is an `aot_autograd` backend or inductor with
`options={"custom_partitioner_fn": ..., "fx_graph_cache": False}`, both scoped to this compiled
object (the FX-graph and AOTAutograd caches key on the captured graph, not on the plan, so a
cached graph would skip the partition: they are off for it).

Private torch API used (tested with torch 2.13, 2.14 and 2.15: `torch_api.PARTS["compile"]`,
other versions are refused by name; the list of all of slackswap's is `torch_api.PRIVATE_API`):
`torch._functorch.partitioners.min_cut_rematerialization_partition` (and `get_default_op_list`),
`torch._functorch.compile_utils.fx_graph_cse`, `torch._functorch.config.cse`,
`torch._functorch._activation_offloading.activation_offloading` (offload_chosen_sets,
offload_chosen_sets_async, activation_offload_sink_wait_async,
activation_reload_prefetch_async, CPU_OFFLOAD_PREFIX), `torch._dynamo.backends.common
.aot_autograd`, `torch._dynamo.backends.debugging.boxed_nop`,
`torch._inductor.custom_graph_pass.CustomPartitionerFn`, and the node meta keys `recompute`,
`should_offload`, `saved_for_offloading`.
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch._guards import CompileContext
from torch.utils.checkpoint import CheckpointPolicy

from ...errors import InputError
from ...profile_build import dtype_name
from ...table_rows import GraphRow
from ...torch_api import PARTS, refuse_untested
from ..notes import tell
from .derived import tag_derived
from .graph_ops import GraphOp, lined_rows, model_ops, on_cuda, partitioner_cse, split_joint
from .graph_plan import block_name, block_rows, graph_units, line_up, op_key
from .offload import offload, substitute_unread
from .report import GraphReport, measure, measure_stood_in
from .sym_sizes import solve
from .tags import OFFLOAD, stand_in_copies, tag_op, tag_views

TESTED_TORCH = PARTS["compile"].tested


BACKENDS = ("inductor", "aot_eager")


def check_torch_version() -> None:
    """Refuse a torch whose partitioner internals this runtime was not tested with
    (`torch_api.PARTS["compile"]`)."""
    refuse_untested("compile")


class PlanPartition:
    """The partition function of one `compile_planned` call (see the module docstring).

    `rows`: the graph_table rows this compiled object may hold (all, or one block's), in
    order; graphs are matched against the rows after the last one matched before (graph
    breaks come in execution order), or against all rows when that lines up too little (a
    recompile)."""

    def __init__(self, table: dict, rows: list[int], *, label: str = "", quiet: bool = False):
        self.table, self.rows, self.label, self.quiet = table, rows, label, quiet
        self.cursor = 0
        self.reports: list[GraphReport] = []

    # the partitioner ----------------------------------------------------------------------
    def __call__(self, gm: fx.GraphModule, joint_inputs, **kwargs):
        # (torch's private partitioner APIs are imported where used, after the version
        # check: `refuse_untested` names a torch outside the tested set before they load)
        from torch._functorch import config as functorch_config
        from torch._functorch.partitioners import min_cut_rematerialization_partition
        merged: set[int] = set()
        n_out = kwargs["num_fwd_outputs"]
        sizes = solve(gm, self._candidates(), dtype_name)
        if functorch_config.cse:
            # the partitioner merges identical ops first (Llama's two causal masks): merged
            # before lining up; the rows that line up only before the merge are reported
            before = lined_rows(self._match(model_ops(split_joint(gm, n_out)[0], sizes)))
            gm.graph = partitioner_cse(gm, n_out)
            gm.recompile()
        fwd_nodes, after_tangent = split_joint(gm, n_out)
        graph_ops = model_ops(fwd_nodes, sizes)
        matched, stood, copied = self._tag(gm, graph_ops, after_tangent)
        if functorch_config.cse:
            merged = before - lined_rows(matched)
        merged |= copied
        kwargs.setdefault("compiler", "inductor")
        fw, bw = min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)
        substituted = substitute_unread(fw, n_out, graph_ops, matched, sizes)
        refused = offload(fw, bw, n_out, on_cuda(gm), sizes)
        report = measure(fw, bw, n_out, graph_ops, matched, self.table, sizes, substituted)
        report.refused_offloads = refused
        report.merged_rows = sorted(merged)
        report.rows = sorted(set(report.rows) | set(stood))
        report.stood_in = {r: h.name for r, h in stood.items()}
        measure_stood_in(report, stood, self.table, sizes)
        report.compile_id = _compile_id()
        report.symbolic, report.symbols = sizes.symbolic, sizes.solved()
        self.reports.append(report)
        if not self.quiet:
            self._say(report)
        return fw, bw

    def _say(self, report: GraphReport) -> None:
        """One line on stderr per graph: how much of it lines up."""
        where = f" ({self.label})" if self.label else ""
        extra = f"; {report.refused_offloads} swap(s) kept: not offloadable" \
            if report.refused_offloads else ""
        if report.symbolic:
            at = ", ".join(f"{k}={v}" for k, v in report.symbols.items())
            extra += (f"; dynamic shapes, lined up at the profiled sizes ({at}): the plan holds "
                      f"at every size" if at else "; dynamic shapes whose sizes match no "
                      "profiled input: re-profile at a shape this graph takes")
        tell(f"compiled graph {len(self.reports)}{where}: "
             f"{report.lined_up_ops} of {report.graph_ops} forward ops line up with the "
             f"profile, {report.graph_ops - report.lined_up_ops} left to torch's "
             f"partitioner{extra}")

    def _candidates(self) -> list[tuple[list, str | None]]:
        """The shapes a graph's inputs may have had in the profiled step: the model's inputs,
        then the inputs of this object's rows in order (a block's graph reads hidden states)."""
        ops = self.table["ops"]
        out = [(list(s), d) for s, d in self.table.get("inputs", ())]
        out += [(list(s), None) for r in self.rows for s in ops[r].input_shapes]
        return out

    def _match(self, graph_ops: list[GraphOp]) -> dict[GraphOp, tuple[GraphRow, list[int]]]:
        """Line the graph's ops up with the rows; op -> (the row it lined up with, the table
        rows that row stands for: `graph_plan.graph_units`)."""
        keys = [op_key(g.target, g.results()) for g in graph_ops]
        ops = self.table["ops"]

        def attempt(start: int) -> dict[GraphOp, tuple[GraphRow, list[int]]]:
            units = graph_units(ops, self.rows[start:])
            got = line_up(keys, [u[0] for u in units])
            return {g: units[k] for g, k in zip(graph_ops, got) if k is not None}

        matched = attempt(self.cursor)
        if self.cursor and len(matched) < 0.5 * len(graph_ops):
            matched = attempt(0)
        return matched

    def _tag(self, gm: fx.GraphModule, graph_ops: list[GraphOp], after_tangent: set[fx.Node]
             ) -> tuple[dict[GraphOp, tuple[GraphRow, list[int]]], dict[int, fx.Node], set[int]]:
        """Line the graph's ops up (`_match`) and tag what lines up; returns the line-up, the
        copy rows whose base stands in for them and the copy rows held as their base's
        (`stand_in_copies`)."""
        matched = self._match(graph_ops)
        if matched:
            self.cursor = self.rows.index(max(lined_rows(matched))) + 1
        moved: set[fx.Node] = set()      # offloaded and recomputed results
        for g, (row, _) in matched.items():
            moved |= tag_op(g, row)
        stood, copied = stand_in_copies(self.table, set(self.rows), matched)
        for r, h in stood.items():
            tag = self.table["ops"][r].tags[0]
            h.meta["recompute"] = CheckpointPolicy.MUST_SAVE
            h.meta["should_offload"] = tag == OFFLOAD
            if tag == OFFLOAD:
                moved.add(h)
        tag_views(gm, moved, after_tangent)
        tag_derived(gm, moved, after_tangent)
        return matched, stood, copied


def _compile_id() -> str:
    """Dynamo's id of the compile running now ("frame/compile of that frame"), or ""."""
    cid = CompileContext.current_compile_id()
    return "" if cid is None else f"{cid.frame_id}/{cid.frame_compile_id}"


def _inductor_partitioner(partition: PlanPartition):
    """`partition` as inductor's `custom_partitioner_fn` (a CustomPartitionerFn)."""
    from torch._inductor.custom_graph_pass import CustomPartitionerFn

    class InductorPartitioner(CustomPartitionerFn):
        def __call__(self, gm, joint_inputs, **kwargs):
            return partition(gm, joint_inputs, **kwargs)

        def uuid(self):
            return None        # never cache (fx_graph_cache is off as well)

        def __reduce__(self):  # inductor may pickle its config: a stand-in, not the plan
            return (str, ("slackswap plan partition",))

    return InductorPartitioner()


def _backend(backend: str, partition: PlanPartition, options: dict | None):
    """torch.compile arguments that run `partition` as the partitioner of `backend`."""
    if backend == "aot_eager":
        if options:
            raise InputError("options= applies to the inductor backend only",
                             hint="drop options, or use backend='inductor'")
        from torch._dynamo.backends.common import aot_autograd
        from torch._dynamo.backends.debugging import boxed_nop
        return {"backend": aot_autograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop,
                                        partition_fn=partition,
                                        keep_inference_input_mutations=True)}
    if backend not in BACKENDS:
        raise InputError(f"compile_planned runs backend {' or '.join(map(repr, BACKENDS))}, "
                         f"not {backend!r}",
                         hint="a plan needs a backend whose partitioner it can set")
    opts = dict(options or {})
    if opts.get("custom_partitioner_fn") is not None:
        raise InputError("options sets custom_partitioner_fn, which compile_planned sets",
                         hint="drop custom_partitioner_fn from options")
    opts["custom_partitioner_fn"] = _inductor_partitioner(partition)
    # the caches key on the graph torch captured, not on the plan: a graph compiled under
    # another plan (or none) would come back without this partition running
    opts["fx_graph_cache"] = False
    return {"backend": "inductor", "options": opts}


def compile_planned(model: torch.nn.Module, table: dict, *, block=None,
                    per_block: bool = False, backend: str = "inductor", quiet: bool = False,
                    **compile_kwargs):
    """`torch.compile(model, **compile_kwargs)` with the plan applied in its joint graphs.

    - the whole model (default): returns what torch.compile returns;
    - `block=i` (or a module path): `model` is repeated block i of the profiled model (the
      torchtitan way: compile each block); it gets that block's part of the plan;
    - `per_block=True`: compiles every repeated block of `model` in place (each child of the
      blocks' container is replaced by its compiled module) and returns `model`.

    The partition function is reachable as `result._slackswap_partitions` (a list: one per
    compiled object), whose `reports` say what each graph carries out.
    """
    check_torch_version()
    if per_block:
        if block is not None:
            raise InputError("pass block= or per_block=True, not both",
                             hint="per_block compiles every block; block= is for one")
        return _compile_blocks(model, table, backend=backend, quiet=quiet, **compile_kwargs)
    if isinstance(block, int):
        name = block_name(table, block)
    else:
        name = block or ""
    rows = block_rows(table, name)
    if not rows:
        raise InputError(f"module {name!r} runs no op of the profile",
                         hint="pass the module path of a block, e.g. 'model.layers.0'")
    partition = PlanPartition(table, rows, label=name, quiet=quiet)
    args = _backend(backend, partition, compile_kwargs.pop("options", None))
    compiled = torch.compile(model, **args, **compile_kwargs)
    compiled._slackswap_partitions = [partition]
    return compiled


def _compile_blocks(model, table, *, backend, quiet, **compile_kwargs):
    container = table.get("container")
    if container is None:
        raise InputError("the profiled model has no repeated blocks",
                         hint="use compile_planned(model) on the whole model")
    try:
        parent = model.get_submodule(container)
    except AttributeError:
        raise InputError(f"the model has no submodule {container!r} (the profiled model's "
                         "blocks)", hint="pass the model that was profiled") from None
    partitions = []
    for child_name, child in list(parent.named_children()):
        if not child_name.isdigit():
            continue
        compiled = compile_planned(child, table, block=int(child_name), backend=backend,
                                   quiet=quiet, **compile_kwargs)
        parent.register_module(child_name, compiled)
        partitions += compiled._slackswap_partitions
    model._slackswap_partitions = partitions
    return model
