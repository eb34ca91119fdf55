"""Turn a traced joint graph (`joint.capture_joint`) into a profile.

Naming (the patched module of `apply` finds its tensors by these names):

- every `call_function` node is an op named after the node, except `operator.getitem`, which
  only picks one output of a multi-output op;
- a tensor is named after the node that holds it: placeholders by their own name, a
  single-output op's result by the op's name, the i-th result of a multi-output op by the
  getitem node that reads it (``"<op>.<i>"`` if nothing reads it);
- ids follow graph order.

Kinds: placeholders are parameters, buffers or inputs (the tangent d loss/d loss is an input);
`get_attr` constants are buffers; op results are activations, except the parameter gradients
the step returns (`gradient`: they end up in `.grad`, outside activation memory).

Aliasing: a view or an in-place op's result shares its input's storage. Its `alias_of` is the
storage root (the first tensor that owned the storage), so memory counts the root once and
keeps it alive while any alias is read. Two sources, in this order:

1. storage identity, when known: FakeTensors carry storages that views share exactly as real
   ones do, and real runs give their addresses (see `storage_keys_*`; the keys: storage.py);
2. the op schema: a return with `alias_info` aliases the argument with the same alias set
   (`view`, `t`, `split`, `detach`, `bernoulli_`, ...), plus `_unsafe_view` and friends, which
   are views that the schema does not declare.

Where both are known and agree, the schema's root is taken. One case of storage sharing is
ignored: outputs of one op that the schema declares fresh but that share a storage with each
other. Meta kernels do this where the real kernel does not (`mkldnn_rnn_layer_backward`
returns one tensor as both bias gradients under FakeTensorMode, two on CPU), and a profile
must not depend on whether the step was traced with fake or real tensors: `apply` re-traces
with fake tensors and compares fingerprints. Such an output is its own root of its own bytes.

A view of a parameter or input stays kind `activation` but aliases a non-activation root, so it
adds no activation bytes and is never a planner candidate.

Recomputable: not for a root that an op mutates in place after creating it (re-running its
producer would not reproduce it), nor for the results of random ops (`nondeterministic_seeded`
in the op's tags: dropout, bernoulli, rand*, ...; attention kernels only when `dropout_p > 0`),
nor for what an op makes from a value that a later op overwrites in place (a *stale read*).
Chains work on roots, and a root holds one value: the one its last in-place write left. An
in-place op whose backward needs the value it overwrites (`silu_`, `hardswish_`, `mul_` by a
tensor that needs a gradient, ...: autograd's `original_self`) is traced as `clone(x)`, then
`silu_(x)`; re-running that `clone` in backward would copy `silu(x)`, kept or swapped under
`x`'s root, and backward would get wrong gradients without an error. So the clone is kept or
swapped, never recomputed (tests/test_inplace_ops.py runs every such op of torch's
derivatives).
"""
from __future__ import annotations

import operator
from typing import Callable

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor

from ..errors import InputError
from ..profile_build import ProfileBuilder, dtype_name
from ..schema import Profile
from .aten import UNDECLARED_VIEWS, packet_name
from .costs import is_random_op, node_flops, tensor_nbytes
from .dtensor import is_collective
from .joint import JointGraph
from .storage import storage_nbytes, storage_object_key

# Ops that allocate without writing a byte (their roofline cost is zero).
ALLOCATING_ONLY = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
                   "empty_permuted"}


def target_name(target) -> str:
    """`aten.mm.default` for OpOverloads; a readable name for anything else."""
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    return getattr(target, "__name__", None) or str(target)


def _schema_aliases(node: fx.Node) -> tuple[dict[int, fx.Node], list[fx.Node]]:
    """(output index -> input node it aliases, input nodes the op writes in place)."""
    schema = getattr(node.target, "_schema", None)
    aliased: dict[int, fx.Node] = {}
    written: list[fx.Node] = []
    if schema is None:
        return aliased, written
    bound = {}
    for i, arg in enumerate(schema.arguments):
        if i < len(node.args) and not arg.kwarg_only:
            bound[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            bound[arg.name] = node.kwargs[arg.name]
    alias_args = [(a, bound.get(a.name)) for a in schema.arguments if a.alias_info is not None]
    for a, value in alias_args:
        if a.alias_info.is_write and isinstance(value, fx.Node):
            written.append(value)
    for i, ret in enumerate(schema.returns):
        info = ret.alias_info
        if info is None:
            continue
        match = [v for a, v in alias_args if a.alias_info.before_set & info.before_set]
        if not match and len(alias_args) == 1:  # `Tensor(a)[]` returns parse with an empty set
            match = [alias_args[0][1]]
        if match and isinstance(match[0], fx.Node):
            aliased[i] = match[0]
    if not aliased and packet_name(node.target) in UNDECLARED_VIEWS and node.args \
            and isinstance(node.args[0], fx.Node):
        aliased[0] = node.args[0]
    return aliased, written


def storage_keys_from_fake(joint: JointGraph) -> dict[str, int]:
    """Node name (or "<op>.<i>") -> storage identity, from the FakeTensors the tracer recorded.

    `capture_joint` traces through fake tensors (also for real models), whose views share
    storage exactly like real ones. A graph whose values carry no FakeTensors gives {} (the
    schema then decides; a real run can supply keys: `measure.storage_keys_from_run`).
    """
    keys: dict[str, int] = {}
    for node in joint.gm.graph.nodes:
        val = node.meta.get("val")
        vals = val if isinstance(val, (tuple, list)) else [val]
        for i, v in enumerate(vals):
            if isinstance(v, FakeTensor) and storage_nbytes(v) > 0:
                name = node.name if not isinstance(val, (tuple, list)) else f"{node.name}.{i}"
                keys[name] = storage_object_key(v)
    return keys


def joint_to_profile(joint: JointGraph, *, workload: dict, env: dict,
                     op_times_us: dict[str, float] | None = None, time_source: str = "roofline",
                     hardware=None, storage_keys: dict[str, int | tuple] | None = None,
                     storage_sizes: dict[str, int] | None = None,
                     summary_extra: dict | None = None,
                     progress: Callable[[str], None] | None = None) -> Profile:
    """Build the profile of `joint`.

    Times: `op_times_us[op name]` when given (measured), else `hardware.roofline_us(flops,
    bytes)`. `storage_keys` (tensor name -> storage identity) overrides the storages read from
    a fake trace; see the module docstring for how aliases are found. `storage_sizes` (tensor
    name -> storage bytes of a real run) raises a root's size where the real kernel allocated
    more than its fake result holds (sizes do not enter the fingerprint).
    """
    if op_times_us is None and hardware is None:
        raise InputError("a profile needs op times: pass measured times or a hardware preset",
                         hint="use --hardware PRESET for roofline costs")
    if storage_keys is None:
        storage_keys = storage_keys_from_fake(joint)
    nodes = list(joint.gm.graph.nodes)
    g = _GraphProfile(joint, nodes, storage_keys, storage_sizes or {})
    g.add_leaves()
    source = "measured" if op_times_us is not None else time_source
    n_calls = sum(1 for n in nodes if n.op == "call_function")
    done = 0
    for node in nodes:
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        done += 1
        if progress is not None and done % 5000 == 0:
            progress(f"building profile: {done}/{n_calls} nodes")
        inputs, outputs, flops, nbytes = g.add_results(node)
        if op_times_us is not None:
            time_us = float(op_times_us.get(node.name, 0.0))
        else:
            time_us = hardware.roofline_us(flops, nbytes)
        g.b.add_op(node.name, target_name(node.target), joint.phase.get(node.name, "forward"),
                   inputs, outputs, module=joint.module.get(node.name, ""), flops=flops,
                   bytes=nbytes, time_us=time_us, time_source=source)
    g.mark_gradients()
    g.mark_recomputable()
    b = g.b
    extra = {"n_tensors": len(b.tensors),
             "flops": sum(o.flops for o in b.ops),
             "time_source": source,
             "checkpoints_inlined": joint.checkpoints_inlined,
             **(summary_extra or {})}
    if joint.checkpoint_held:     # what the model's own checkpoints hold (trace/checkpointed.py)
        extra["checkpoint_held"] = sorted({g.root(g.tid_of[n]) for n in joint.checkpoint_held
                                           if n in g.tid_of})
    return b.build(workload=workload, env=env, summary_extra=extra)


class _GraphProfile:
    """The profile of a joint graph while it is being built: tensors by node name, storage
    roots, and what makes a root non-recomputable (see the module docstring)."""

    def __init__(self, joint: JointGraph, nodes: list[fx.Node],
                 storage_keys: dict[str, int | tuple], storage_sizes: dict[str, int]):
        self.joint, self.nodes = joint, nodes
        self.storage_keys, self.storage_sizes = storage_keys, storage_sizes
        self.b = ProfileBuilder()
        self.tid_of: dict[str, int] = {}          # node name (getitems included) -> tensor id
        self.root_of_key: dict[int, int] = {}     # storage key -> root tensor id (first owner)
        self.key_of_root: dict[int, int] = {}     # root tensor id -> storage key
        self.random_roots: set[int] = set()
        # per op in order: (the roots it reads, the tensors it makes); a root mutated in
        # place -> the index of the last op that writes it
        self.reads: list[tuple[set[int], list[int]]] = []
        self.last_write: dict[int, int] = {}
        self.tensor_vals: list[torch.Tensor] = []  # meta val of each tensor id (byte counts)
        # getitem nodes name the outputs of multi-output ops
        self.picked: dict[tuple[str, int], list[fx.Node]] = {}
        for node in nodes:
            if node.op == "call_function" and node.target is operator.getitem \
                    and isinstance(node.args[0], fx.Node):
                self.picked.setdefault((node.args[0].name, int(node.args[1])), []).append(node)

    def root(self, t: int) -> int:
        r = self.b.tensors[t].alias_of
        return t if r is None else r

    def add_tensor(self, name: str, kind: str, val: torch.Tensor, alias_of: int | None,
                   key_name: str, siblings: tuple[int, ...] = ()) -> int:
        """A tensor; storage identity, when known, decides its root, the schema's `alias_of`
        is the fallback."""
        b = self.b
        key = self.storage_keys.get(key_name)
        declared = alias_of
        if declared is not None and b.tensors[declared].alias_of is not None:
            declared = b.tensors[declared].alias_of
        shared_with_sibling = False
        if key is not None:
            if declared is not None and self.key_of_root.get(declared) == key:
                alias_of = declared           # the schema and the storage agree
            else:
                alias_of = self.root_of_key.get(key)
                if declared is None and alias_of in siblings:
                    # a fresh output sharing storage with another output of the same op: meta
                    # kernels do this where real kernels do not (see the module docstring)
                    alias_of, shared_with_sibling = None, True
        else:
            alias_of = declared
        if alias_of is not None or shared_with_sibling:
            size = tensor_nbytes(val)
        else:
            size = max(storage_nbytes(val), tensor_nbytes(val),
                       self.storage_sizes.get(key_name, 0))
        tid = b.add_tensor(name, kind, tuple(val.shape), dtype_name(val.dtype), size_bytes=size,
                           alias_of=alias_of)
        if key is not None and alias_of is None:
            self.key_of_root[tid] = key
            self.root_of_key.setdefault(key, tid)
        self.tensor_vals.append(val)
        return tid

    def add_leaves(self) -> None:
        """Placeholders (parameters, buffers, inputs; the tangent is an input) and constants."""
        kinds = iter(self.joint.placeholder_kinds())
        for node in self.nodes:
            if node.op == "placeholder":
                kind = next(kinds)
                val = node.meta.get("val")
                if isinstance(val, torch.Tensor):
                    self.tid_of[node.name] = self.add_tensor(
                        node.name, "input" if kind == "tangent" else kind, val, None, node.name)
            elif node.op == "get_attr":
                val = node.meta.get("val")
                if val is None:
                    val = getattr(self.joint.gm, str(node.target), None)
                if isinstance(val, torch.Tensor):
                    self.tid_of[node.name] = self.add_tensor(node.name, "buffer", val, None,
                                                             node.name)

    def add_results(self, node: fx.Node) -> tuple[list[int], list[int], int, int]:
        """The tensors op `node` produces; returns (inputs, outputs, flops, bytes) of the op."""
        b, tid_of = self.b, self.tid_of
        val = node.meta.get("val")
        multi = isinstance(val, (tuple, list))
        vals = list(val) if multi else [val]
        aliased, written = _schema_aliases(node)
        inputs = list(dict.fromkeys(tid_of[a.name] for a in node.all_input_nodes
                                    if a.name in tid_of))
        random = is_random_op(node) or is_collective(node.target)    # not re-run either
        outputs: list[int] = []
        writes: list[int] = []
        for i, v in enumerate(vals):
            if not isinstance(v, torch.Tensor):
                continue
            if multi:
                readers = self.picked.get((node.name, i), [])
                name = readers[0].name if readers else f"{node.name}.{i}"
                key_name = f"{node.name}.{i}"
            else:
                readers, name, key_name = [], node.name, node.name
            src = aliased.get(i)
            alias_of = tid_of.get(src.name) if src is not None else None
            tid = self.add_tensor(name, "activation", v, alias_of, key_name, tuple(outputs))
            tid_of[name] = tid
            for r in readers:
                tid_of[r.name] = tid
            outputs.append(tid)
            root = b.tensors[tid].alias_of
            if root is None or (src is not None and any(w is src for w in written)):
                writes.append(tid)  # a fresh tensor, or an in-place write into its input
            if random:
                self.random_roots.add(tid if root is None else root)
        k = len(self.reads)                 # this op's index (ops are added in this order)
        for w in written:
            if w.name in tid_of:
                self.last_write[self.root(tid_of[w.name])] = k
        self.reads.append(({self.root(t) for t in inputs}, outputs))
        flops, nbytes = self._cost(node, inputs, outputs, writes)
        return inputs, outputs, flops, nbytes

    def _cost(self, node: fx.Node, inputs: list[int], outputs: list[int],
              writes: list[int]) -> tuple[int, int]:
        """(flops, bytes): each distinct input read once (a view reads no more than its root
        holds), each non-view output written once; views move nothing, allocation alone
        writes nothing."""
        b = self.b
        if (outputs and not writes) or packet_name(node.target) in ALLOCATING_ONLY:
            return 0, 0
        nbytes = 0
        for t in inputs:
            root = b.tensors[t].alias_of
            own = tensor_nbytes(self.tensor_vals[t])
            nbytes += own if root is None else min(own, b.tensors[root].size_bytes)
        for t in writes:
            nbytes += tensor_nbytes(self.tensor_vals[t])
        return node_flops(node), nbytes

    def mark_gradients(self) -> None:
        """Returned gradients (and their roots, when backward produced them) leave activation
        memory."""
        b = self.b
        out_node = next(n for n in reversed(self.nodes) if n.op == "output")
        returned = [n for n in pytree.tree_leaves(list(out_node.args[0])[1:])
                    if isinstance(n, fx.Node)]
        for n in returned:
            t = self.tid_of.get(n.name)
            if t is None:
                continue
            root = b.tensors[t].alias_of
            for x in (t, root):
                if x is not None and b.tensors[x].kind == "activation" \
                        and b.tensors[x].producer is not None \
                        and b.ops[b.tensors[x].producer].phase == "backward":
                    b.tensors[x].kind = "gradient"
        # An output nothing reads, of a backward op whose other results are returned gradients,
        # is a gradient too: when a meta kernel returns one tensor for two gradients (see the
        # module docstring), the traced step returns that tensor twice and leaves its twin
        # unread, but only on the first trace in a process (FakeTensor's dispatch cache builds
        # fresh outputs later). The kind must not depend on which trace this was.
        read = {t for op in b.ops for t in op.inputs} | {t.alias_of for t in b.tensors}
        for op in b.ops:
            if op.phase != "backward" or not any(b.tensors[t].kind == "gradient"
                                                 for t in op.outputs):
                continue
            for t in op.outputs:
                x = b.tensors[t]
                if x.kind == "activation" and x.alias_of is None and t not in read:
                    x.kind = "gradient"

    def stale_reads(self) -> set[int]:
        """Tensors made by an op that read a value a later op overwrote in place: `clone(x)`
        before `silu_(x)` (autograd's copy of what the in-place op overwrites, for its
        backward), `mul(x, w)` before `x.add_(1)`. A chain re-running that op would read the
        storage as the later write left it, so it cannot be re-run (see the module
        docstring)."""
        out: set[int] = set()
        for k, (roots, outputs) in enumerate(self.reads):
            if any(self.last_write.get(r, -1) > k for r in roots):
                out.update(outputs)
        return out

    def mark_recomputable(self) -> None:
        """Roots mutated in place, made by random ops or collectives (and their waits:
        trace/dtensor.py) or by an op that read a value later overwritten in place cannot be
        recomputed; an alias is recomputable exactly when its
        root is (it is re-derived from the root)."""
        b = self.b
        for t in self.last_write.keys() | self.random_roots:
            b.tensors[t].recomputable = False
        for t in self.stale_reads():
            b.tensors[self.root(t)].recomputable = False
        for t in b.tensors:
            if t.alias_of is not None:
                t.recomputable = t.recomputable and b.tensors[t.alias_of].recomputable


def first_difference(expected: Profile, got: Profile) -> str:
    """Where two profiles' graphs first differ, in words (for a fingerprint mismatch).

    Compares what the fingerprint hashes, in its order: each op's target, phase and wiring,
    then each tensor's kind, shape, dtype and storage root; names the first differing op (for
    a tensor, the op that made it).
    """
    def op_desc(p: Profile, i: int) -> str:
        o = p.ops[i]
        return f"op {i} ({o.name}, {o.target}, {o.phase})"

    for i, (a, b) in enumerate(zip(expected.ops, got.ops)):
        if (a.target, a.phase) != (b.target, b.phase):
            return f"first difference at {op_desc(got, i)}, where the profile has {op_desc(expected, i)}"
        if (a.inputs, a.outputs) != (b.inputs, b.outputs):
            return (f"first difference at {op_desc(got, i)}: it reads {list(b.inputs)} and writes "
                    f"{list(b.outputs)}, where the profile's reads {list(a.inputs)} and writes "
                    f"{list(a.outputs)}")
    if len(expected.ops) != len(got.ops):
        n = min(len(expected.ops), len(got.ops))
        extra = op_desc(got, n) if len(got.ops) > n else op_desc(expected, n)
        return (f"{len(got.ops)} ops where the profile has {len(expected.ops)}; the first one "
                f"only one of them has is {extra}")
    for a, b in zip(expected.tensors, got.tensors):
        fields = ("kind", "shape", "dtype", "alias_of")
        va, vb = [getattr(a, f) for f in fields], [getattr(b, f) for f in fields]
        if va != vb:
            f = fields[next(k for k in range(len(fields)) if va[k] != vb[k])]
            made = (f", made by {op_desc(got, b.producer)}" if b.producer is not None else "")
            return (f"first difference at tensor {b.id} ({b.name}{made}): {f} "
                    f"{getattr(b, f)!r} where the profile has {getattr(a, f)!r}")
    if len(expected.tensors) != len(got.tensors):
        return f"{len(got.tensors)} tensors where the profile has {len(expected.tensors)}"
    return "the graphs hash differently but no field differs"
