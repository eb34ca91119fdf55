"""Split a joint forward+backward graph by a plan into the code of a forward and a backward step.

The joint graph (`trace.joint.capture_joint`) holds one training step in execution order. Its
forward nodes become the forward step, its backward nodes the backward step, both in their
original order, so the patched step runs the same aten ops in the same order as eager autograd
(the same random numbers are drawn in the same order: dropout masks are equal).

The forward values that backward reads are the *saved* values. The plan decides, per storage
root (a tensor and its views/in-place aliases share one decision, as in the profile):

- **keep**: forward hands the value to the step store (`s.keep`); backward takes it back at
  its first use (`s.take`) and drops it after its last use.
- **swap**: forward starts a host copy of the root right after the last op that writes into
  it (`s.offload`) and drops the device tensor after its last forward use; backward issues the
  copy back at the plan's prefetch point (`s.prefetch`) and waits for it before the first use
  (`s.wait`). Views of the root are re-derived from the restored root (views cost nothing);
  in-place ops are not re-run (their effect is in the copied data).
- **recompute**: nothing is saved; backward re-runs exactly the chains `chains.lay_out` lays
  out for the plan, the ones the simulator costed: before a backward op, the ops of its chain
  in forward order. Their inputs are materialised on demand: kept values are taken, swapped
  roots are waited for (fetched early when a chain needs them before their own first use,
  never recomputed), views and in-place aliases are re-derived from their sources. Recomputed
  saved values stay until their last use; the chain's temporaries are dropped after it (and
  re-run if another chain needs them). Random ops are never re-run: a plan that would do so is
  refused. An op that mutates one of
  its arguments as a side effect (BatchNorm's running statistics) is re-run on a clone of that
  argument, so buffers are updated exactly once, as in eager.

Statements carry the variables they define and use; one liveness pass then frees every value
(`x = None`) right after its last use, the way eager autograd frees what nobody holds.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from ...chains import Layout, action_codes, lay_out
from ...chains import tables as chain_tables
from ...errors import InputError
from ...schema import Action, Plan, Profile
from ...trace.aten import is_inplace as aten_is_inplace
from ...trace.aten import returns_view, written_positions
from ...trace.graph_profile import is_random_op

RESERVED = {"torch", "aten", "inplace", "step_runtime", "GraphRow", "OpRow", "_s", "_device",
            "None", "float"}



class PlanApplyError(InputError):
    """The plan asks for something that cannot be carried out on this graph."""


class UnknownConstant(PlanApplyError):
    """A traced tensor constant whose values a fake trace does not know (re-trace for real)."""


@dataclass
class Stmt:
    code: str
    defs: tuple[str, ...] = ()
    uses: tuple[str, ...] = ()
    comment: str = ""


@dataclass
class StepCode:
    forward: list[Stmt]
    backward: list[Stmt]
    forward_args: list[str]          # placeholder names (params, buffers, inputs)
    tangent: str
    loss: str
    grads: list[str | None]          # backward return values, one per returned gradient
    kept: list[str] = field(default_factory=list)
    swapped: list[str] = field(default_factory=list)
    recomputed: list[str] = field(default_factory=list)
    recomputed_ops: int = 0          # op calls the backward re-runs


# --------------------------------------------------------------------------------------------
# Formatting nodes as Python
# --------------------------------------------------------------------------------------------
def fmt_arg(a, device_type: str) -> str:
    if isinstance(a, fx.Node):
        return a.name
    if isinstance(a, bool) or a is None or isinstance(a, (int, str)):
        return repr(a)
    if isinstance(a, float):
        if math.isinf(a):
            return "float('inf')" if a > 0 else "float('-inf')"
        if math.isnan(a):
            return "float('nan')"
        return repr(a)
    if isinstance(a, (list, tuple)):
        inner = ", ".join(fmt_arg(x, device_type) for x in a)
        if isinstance(a, tuple) and not isinstance(a, list):
            return f"({inner},)" if len(a) == 1 else f"({inner})"
        return f"[{inner}]"
    if isinstance(a, dict):
        return "{" + ", ".join(f"{k!r}: {fmt_arg(v, device_type)}" for k, v in a.items()) + "}"
    if isinstance(a, torch.device):
        return "_device" if a.type == device_type else f"torch.device({str(a)!r})"
    if isinstance(a, (torch.dtype, torch.layout, torch.memory_format)):
        return str(a)
    raise PlanApplyError(f"cannot write the graph argument {a!r} ({type(a).__name__}) as code",
                         hint="the patched module supports graphs of aten ops on tensors and "
                              "Python constants")


def op_expr(node: fx.Node, device_type: str, clone_args: tuple[int, ...] = ()) -> str:
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        raise PlanApplyError(f"node {node.name} calls {target!r}, which is not an aten op",
                             hint="only graphs traced to aten ops can be patched")
    args = []
    for i, a in enumerate(node.args):
        text = fmt_arg(a, device_type)
        if i in clone_args and isinstance(a, fx.Node):
            text = f"{text}.clone()"   # a side-effect write goes to a throwaway copy
        args.append(text)
    args += [f"{k}={fmt_arg(v, device_type)}" for k, v in node.kwargs.items()]
    ns = str(target).split(".")[0]
    prefix = "aten." if ns == "aten" else "torch.ops."
    name = str(target)[len("aten."):] if ns == "aten" else str(target)
    return f"{prefix}{name}({', '.join(args)})"


def _uses(node: fx.Node) -> tuple[str, ...]:
    return tuple(dict.fromkeys(a.name for a in node.all_input_nodes))


def is_random(node: fx.Node) -> bool:
    """Draws random numbers (dropout, bernoulli_, attention with dropout_p > 0): never re-run."""
    return is_random_op(node)


def written_args(node: fx.Node) -> list[int]:
    """Positions of the arguments an op writes in place (schema `a!`, plus hidden BN writes)."""
    return written_positions(node.target, node.args, lambda a: isinstance(a, fx.Node))


def is_inplace(node: fx.Node) -> bool:
    """An op whose result is its first argument, written in place (`relu_`, `bernoulli_`)."""
    return (isinstance(node.target, torch._ops.OpOverload) and bool(node.args)
            and aten_is_inplace(node.target))


# --------------------------------------------------------------------------------------------
# Partitioning
# --------------------------------------------------------------------------------------------
class _Graph:
    """The joint graph plus the profile's view of it (tensor ids, roots, the plan's actions)."""

    def __init__(self, gm: fx.GraphModule, phase: dict[str, str], profile: Profile, plan: Plan):
        self.nodes = list(gm.graph.nodes)
        self.gm = gm
        self.pos = {n.name: i for i, n in enumerate(self.nodes)}
        self.by_name = {n.name: n for n in self.nodes}
        self.phase = phase
        self.profile = profile
        tid = {t.name: t.id for t in profile.tensors}
        first_reader: dict[tuple[str, int], str] = {}
        for n in self.nodes:
            if n.op == "call_function" and n.target is operator.getitem:
                first_reader.setdefault((n.args[0].name, int(n.args[1])), n.name)
        self.tid: dict[str, int] = {}
        for n in self.nodes:
            name = n.name
            if n.op == "call_function" and n.target is operator.getitem:
                name = first_reader[(n.args[0].name, int(n.args[1]))]
            if name in tid:
                self.tid[n.name] = tid[name]
        cands = {t.id for t in profile.saved_activations}
        self.action: dict[int, str] = {}
        for d in plan.decisions:
            if d.tensor not in cands:
                raise PlanApplyError(f"the plan decides on tensor {d.tensor}, which is not a saved "
                                     "activation of the profile",
                                     hint="re-run `slackswap plan` on this profile")
            self.action[d.tensor] = d.action
        self.candidates = cands
        self.op_id = {op.name: op.id for op in profile.ops}
        self.op_node = {op.id: self.by_name[op.name] for op in profile.ops
                        if op.name in self.by_name}

    def is_forward(self, n: fx.Node) -> bool:
        return n.op in ("call_function", "get_attr") and self.phase.get(n.name) == "forward"

    def root_tid(self, n: fx.Node) -> int | None:
        t = self.tid.get(n.name)
        return None if t is None else self.profile.root(t)

    def group_action(self, n: fx.Node) -> str | None:
        """keep/swap/recompute of n's storage root; None when the root is no planner candidate."""
        r = self.root_tid(n)
        if r is None or r not in self.candidates:
            return None
        return self.action.get(r, Action.KEEP)

    def root_node(self, n: fx.Node) -> fx.Node | None:
        r = self.root_tid(n)
        if r is None:
            return None
        name = self.profile.tensors[r].name
        return self.by_name.get(name)


def partition(gm: fx.GraphModule, phase: dict[str, str], profile: Profile, plan: Plan,
              device_type: str) -> StepCode:
    g = _Graph(gm, phase, profile, plan)
    for n in g.nodes:
        if n.name in RESERVED:
            raise PlanApplyError(f"graph node named {n.name!r} clashes with a name the patched "
                                 "module uses")
    out_node = next(n for n in reversed(g.nodes) if n.op == "output")
    loss_node, *grad_nodes = list(out_node.args[0])
    placeholders = [n for n in g.nodes if n.op == "placeholder"]
    tangent = placeholders[-1].name
    forward = [n for n in g.nodes if g.is_forward(n)]
    backward = [n for n in g.nodes if n.op in ("call_function", "get_attr")
                and not g.is_forward(n)]
    kept, swap_roots = _saved_values(g, forward, backward, grad_nodes)
    fstmts = _forward_stmts(g, forward, kept, swap_roots, loss_node, device_type)
    lay = _layout(profile, plan)
    em = _BackwardEmitter(g, lay, kept, swap_roots, device_type,
                          persistent={p.name for p in placeholders})
    grads = _backward_stmts(em, g, plan, lay, backward, grad_nodes, swap_roots, device_type)
    bstmts = em.stmts
    # a kept root whose views backward takes instead (and that no chain re-derives from) is
    # not stored at all: the store would hold it to the end of the step
    unused = set(kept) - em.taken
    fstmts = [st for st in fstmts if not (st.code.startswith("_s.keep(")
                                          and st.uses and st.uses[0] in unused)]
    kept = {k: v for k, v in kept.items() if k not in unused}

    args = [p.name for p in placeholders[:-1]]
    _insert_frees(fstmts, keep=set(args))
    _insert_frees(bstmts, keep=set(args) | {tangent})
    return StepCode(forward=fstmts, backward=bstmts, forward_args=args, tangent=tangent,
                    loss=loss_node.name, grads=grads, kept=sorted(kept),
                    swapped=sorted(swap_roots), recomputed=sorted(em.recomputed_roots),
                    recomputed_ops=em.rerun_ops)


def _saved_values(g: _Graph, forward: list[fx.Node], backward: list[fx.Node],
                  grad_nodes) -> tuple[dict[str, fx.Node], dict[str, fx.Node]]:
    """The forward values backward reads (and the returned grads need), by how backward gets
    them: (kept: taken from the store, swapped roots: root name -> root node); the rest is
    recomputed. Refuses a plan that recomputes what cannot be recomputed."""
    fwd_set = {n.name for n in forward}
    bneed: dict[str, fx.Node] = {}
    for b in backward:
        for a in b.all_input_nodes:
            if a.name in fwd_set:
                bneed.setdefault(a.name, a)
    for gnode in grad_nodes:
        if isinstance(gnode, fx.Node) and gnode.name in fwd_set:
            bneed.setdefault(gnode.name, gnode)
    kept: dict[str, fx.Node] = {}            # taken from the store
    swap_roots: dict[str, fx.Node] = {}      # root name -> root node
    for name, n in bneed.items():
        act = g.group_action(n)
        root = g.root_node(n)
        if act == Action.SWAP:
            if root is None or root.name not in fwd_set:
                raise PlanApplyError(f"the plan swaps {name}, whose storage root is not a forward value")
            swap_roots[root.name] = root
        elif act == Action.RECOMPUTE:
            pass
        else:
            kept[name] = n
            if act == Action.KEEP and root is not None and root.name in fwd_set:
                kept[root.name] = root  # views of a kept root re-derive from it (same storage)
    tensors = g.profile.tensors
    for tid, act in g.action.items():
        if act == Action.RECOMPUTE and not tensors[tid].recomputable:
            raise PlanApplyError(f"the plan recomputes {tensors[tid].name}, which is not "
                                 "recomputable (a random op's result or mutated in place)",
                                 hint="re-run `slackswap plan`; planners never recompute these")
    return kept, swap_roots


def _forward_stmts(g: _Graph, forward: list[fx.Node], kept: dict[str, fx.Node],
                   swap_roots: dict[str, fx.Node], loss_node: fx.Node,
                   device_type: str) -> list[Stmt]:
    """The forward step: every forward op, a swapped root's offload after the last op that
    writes into its storage, a kept value's `keep`, and the loss returned."""
    copy_after: dict[str, list[str]] = {}
    for rname, root in swap_roots.items():
        last = root
        rt = g.root_tid(root)
        for n in forward:
            if g.pos[n.name] > g.pos[last.name] and is_inplace(n) and g.root_tid(n) == rt:
                last = n
        copy_after.setdefault(last.name, []).append(rname)

    fstmts: list[Stmt] = []
    for n in forward:
        fstmts.append(_define(n, g, device_type))
        for rname in copy_after.get(n.name, []):
            fstmts.append(Stmt(f"_s.offload({rname!r}, {rname})", uses=(rname,),
                               comment="swap: copy to host now, device memory freed after last forward use"))
        if n.name in kept:
            fstmts.append(Stmt(f"_s.keep({n.name!r}, {n.name})", uses=(n.name,)))
    fstmts.append(Stmt(f"return {loss_node.name}", uses=(loss_node.name,)))
    return fstmts


def _backward_stmts(em: _BackwardEmitter, g: _Graph, plan: Plan, lay: Layout,
                    backward: list[fx.Node], grad_nodes, swap_roots: dict[str, fx.Node],
                    device_type: str) -> list[str | None]:
    """Emit the backward step into `em.stmts`: prefetches at the plan's points, each op's
    recompute chain before it, its inputs materialised, the gradients returned. Returns the
    returned gradients' names (None for no gradient)."""
    prefetch_at = _prefetch_points(g, plan, swap_roots, backward, lay)
    chains = lay.chains(g.profile.n_forward)
    for b in backward:
        for rname in prefetch_at.get(b.name, []):
            em.stmts.append(Stmt(f"_s.prefetch({rname!r})", comment="swap: copy back ahead of use"))
        op = g.op_id.get(b.name)
        if op in chains:
            em.chain(op, chains[op])
        if _dead_meta(b, device_type):
            continue
        for a in b.all_input_nodes:
            em.materialize(a)
        em.stmts.append(_define(b, g, device_type))
        em.defined.add(b.name)
    grads = []
    for gnode in grad_nodes:
        if isinstance(gnode, fx.Node):
            em.materialize(gnode)
            grads.append(gnode.name)
        else:
            grads.append(None)
    em.stmts.append(Stmt("return [" + ", ".join(x or "None" for x in grads) + "]",
                         uses=tuple(x for x in grads if x)))
    return grads


def _dead_meta(n: fx.Node, device_type: str) -> bool:
    """A node nothing reads, whose value is on the meta device in a step on another device,
    and that writes nothing: what tracing saw of autograd's zero-tensor fallback (`sgn_`'s
    gradient of a real input is an `_efficientzerotensor`; the fallback works out the result's
    metadata with meta tensors, a Python scalar wrapped on the way). Run for real, its
    `prims.mul` refuses the unwrapped scalar's float64; nothing needs its value."""
    val = n.meta.get("val")
    return (not n.users and device_type != "meta" and isinstance(val, torch.Tensor)
            and val.device.type == "meta" and isinstance(n.target, torch._ops.OpOverload)
            and not n.target._schema.is_mutable and not is_random(n))


def _is_view(n: fx.Node) -> bool:
    if not isinstance(n.target, torch._ops.OpOverload):
        return n.target is operator.getitem
    return returns_view(n.target)


def _define(n: fx.Node, g: _Graph, device_type: str, clone_args: tuple[int, ...] = ()) -> Stmt:
    if n.op == "get_attr":
        return Stmt(f"{n.name} = {_constant(g.gm, str(n.target), n.name)}", defs=(n.name,))
    if n.target is operator.getitem:
        return Stmt(f"{n.name} = {n.args[0].name}[{int(n.args[1])}]", defs=(n.name,),
                    uses=(n.args[0].name,))
    return Stmt(f"{n.name} = {op_expr(n, device_type, clone_args)}", defs=(n.name,), uses=_uses(n))


def _constant(gm: fx.GraphModule, target: str, name: str) -> str:
    """A tensor constant the trace lifted (e.g. an empty KV cache), written as code."""
    val = getattr(gm, target)
    if not isinstance(val, torch.Tensor):
        raise PlanApplyError(f"graph constant {name} is a {type(val).__name__}")
    dtype = str(val.dtype)
    if val.numel() == 0:
        return f"torch.empty({tuple(val.shape)!r}, dtype={dtype}, device=_device)"
    data = getattr(val, "constant", None)
    if data is None and not isinstance(val, torch._subclasses.FakeTensor):
        data = val
    if data is None and val.numel() <= 4096:
        raise UnknownConstant(f"graph constant {name} has no known values in a fake trace")
    if data is None or val.numel() > 4096:
        raise PlanApplyError(f"the model creates a tensor constant ({name}, shape "
                             f"{tuple(val.shape)}) that cannot be written into the patched module",
                             hint="register it as a buffer (self.register_buffer) in the model")
    return (f"torch.tensor({data.detach().cpu().tolist()!r}, dtype={dtype}, device=_device)"
            f".reshape({tuple(val.shape)!r})")


def _layout(profile: Profile, plan: Plan) -> Layout:
    """The plan's compute layout (`chains.lay_out`): the backward the simulator ran."""
    tab = chain_tables(profile)
    return lay_out(profile, tab, action_codes(tab, plan.decisions))


class _BackwardEmitter:
    """Writes the backward step as `chains.lay_out` laid it out.

    `defined` holds the names that are valid at the current point of the code. A chain's ops
    are written in the layout's order; their inputs are materialised on demand: kept values are
    taken from the store, swapped roots waited for (each exactly once), views and in-place
    aliases re-derived from their (now resident) sources at no memory cost. After a chain, the
    names whose roots the layout frees (its temporaries) are forgotten, so a later chain
    re-runs them as the simulator does; the roots a chain makes resident stay.
    """

    def __init__(self, g: _Graph, lay: Layout, kept: dict, swap_roots: dict, device_type: str,
                 persistent: set[str]):
        self.g, self.lay, self.kept, self.swap_roots = g, lay, kept, swap_roots
        self.device_type = device_type
        self.defined: set[str] = set(persistent)
        self.taken: set[str] = set()
        self.stmts: list[Stmt] = []
        self.recomputed_roots: set[str] = set()
        self.rerun_ops = 0
        self._chain_defs: list[str] | None = None
        self._target = ""
        made = {}
        for r, t in lay.made:
            made.setdefault(lay.task_owner[t], set()).add(r)
        self._made = made
        # roots of the values taken from the store: they outlive any chain that reads them
        self._kept_roots = {g.profile.root(t) for t in (g.tid.get(n) for n in kept)
                            if t is not None}

    def chain(self, owner: int, ops: tuple[int, ...]) -> None:
        g = self.g
        made = self._made.get(owner, set())
        targets = [g.profile.tensors[r].name for r in sorted(made)]
        self._chain_defs = []
        for p in ops:
            node = g.op_node[p]
            out_roots = {r for r in chain_tables(g.profile).out_roots[p]}
            main = next((g.profile.tensors[r].name for r in sorted(out_roots & made)), None)
            self._target = main or (targets[0] if targets else node.name)
            for a in node.all_input_nodes:
                self.materialize(a)
            if is_random(node):
                raise PlanApplyError(
                    f"recomputing {node.name} would re-run the random op {node.target}",
                    hint="re-run `slackswap plan`: random results must be kept or swapped")
            st = _define(node, g, self.device_type, clone_args=tuple(written_args(node)))
            st.comment = (f"recompute {node.name}" if main == node.name
                          else f"recompute, on the way to {self._target}")
            self.stmts.append(st)
            self._def(node.name)
            self.rerun_ops += 1
            for u in node.users:      # the outputs this chain makes resident, picked now
                if u.target is operator.getitem and g.root_tid(u) in made:
                    self.stmts.append(_define(u, g, self.device_type))
                    self._def(u.name)
            for r in out_roots & made:
                self.recomputed_roots.add(g.profile.tensors[r].name)
        # the chain's temporaries die with it (the layout frees them): forget their names
        stay = made | self._kept_roots
        for name in self._chain_defs:
            r = g.root_tid(g.by_name[name])
            if r is None or r not in stay:
                self.defined.discard(name)
        self._chain_defs = None

    def _def(self, name: str) -> None:
        self.defined.add(name)
        if self._chain_defs is not None:
            self._chain_defs.append(name)

    def _views_only(self, n: fx.Node) -> bool:
        """A multi-output op whose outputs all alias its inputs (`unsafe_split`): a view."""
        tids = [self.g.tid.get(u.name) for u in n.users if u.target is operator.getitem]
        return bool(tids) and all(t is not None and self.g.profile.tensors[t].alias_of is not None
                                  for t in tids)

    def materialize(self, n: fx.Node) -> None:
        """Make forward value `n` valid here without re-running anything the layout did not."""
        if n.name in self.defined:
            return
        g, stmts = self.g, self.stmts
        if n.name in self.kept and n.name not in self.taken:
            stmts.append(Stmt(f"{n.name} = _s.take({n.name!r})", defs=(n.name,)))
            self.taken.add(n.name)
            self.defined.add(n.name)
            return
        if n.name in self.swap_roots:
            stmts.append(Stmt(f"{n.name} = _s.wait({n.name!r})", defs=(n.name,),
                              comment="swap: host copy back on the device"))
            self.defined.add(n.name)
            return
        if n.op == "get_attr":
            stmts.append(_define(n, g, self.device_type))
            self._def(n.name)
            return
        if n.target is operator.getitem:
            self.materialize(n.args[0])
            stmts.append(_define(n, g, self.device_type))
            self._def(n.name)
            return
        if n.op == "call_function" and is_inplace(n):
            src = n.args[0]
            self.materialize(src)
            stmts.append(Stmt(f"{n.name} = {src.name}", defs=(n.name,), uses=(src.name,),
                              comment="in-place op: its effect is already in the data"))
            self._def(n.name)
            return
        r = g.root_tid(n)
        if n.op == "call_function" and (_is_view(n) or self._views_only(n) or (
                r is not None and g.profile.tensors[r].kind != "activation")):
            # a view (of an activation, a parameter or an input): costs no memory, re-derived
            for a in n.all_input_nodes:
                self.materialize(a)
            st = _define(n, g, self.device_type)
            if self._chain_defs is not None:
                st.comment = f"view, on the way to {self._target}"
            stmts.append(st)
            self._def(n.name)
            return
        raise PlanApplyError(f"backward needs {n.name}, which the plan's layout does not make "
                             "resident there", hint="this is a bug in apply; please report it")


def _prefetch_points(g: _Graph, plan: Plan, swap_roots: dict[str, fx.Node],
                     backward: list[fx.Node], lay: Layout) -> dict[str, list[str]]:
    """Backward node name -> swapped roots whose copy back is issued right before it (and
    before its recompute chain, if it has one).

    The plan's prefetch point (its schedule, else the decision's `prefetch_at`) wins; without
    one, a root is prefetched when the previous swapped root (in order of need) is waited for:
    one copy in flight ahead of use. A root is needed at the first task of the layout that
    reads it: its first backward reader, or a chain before that.
    """
    prof = g.profile
    name_of_op = {op.id: op.name for op in prof.ops}
    bpos = {n.name: i for i, n in enumerate(backward)}
    issue: dict[str, int] = {}
    tid_to_root = {g.root_tid(r): r.name for r in swap_roots.values()}
    for d in plan.decisions:
        if d.action == Action.SWAP and d.prefetch_at is not None and d.tensor in tid_to_root:
            op = name_of_op.get(d.prefetch_at)
            if op in bpos:
                issue[tid_to_root[d.tensor]] = bpos[op]
    for ev in plan.schedule:
        if ev.kind == "prefetch" and ev.tensor in tid_to_root:
            op = name_of_op.get(ev.issue_op)
            if op in bpos:
                issue[tid_to_root[ev.tensor]] = bpos[op]
    # where each swapped root is needed (the backward op owning the first task that reads it)
    first_use: dict[str, int] = {}
    for tid, rname in tid_to_root.items():
        t = lay.need_task.get(tid)
        if t is not None:
            first_use[rname] = bpos[name_of_op[lay.task_owner[t]]]
    order = sorted(swap_roots, key=lambda r: first_use.get(r, len(backward)))
    prev = 0
    for r in order:
        at = issue.get(r, prev)
        at = min(at, first_use.get(r, len(backward) - 1))
        issue[r] = at
        prev = first_use.get(r, prev)
    out: dict[str, list[str]] = {}
    for r, i in issue.items():
        if backward:
            out.setdefault(backward[min(i, len(backward) - 1)].name, []).append(r)
    return out


def _insert_frees(stmts: list[Stmt], keep: set[str]) -> None:
    """Append `x = None` to the statement after which the value of x is no longer used."""
    live: set[str] = set()
    for st in reversed(stmts):
        touched = set(st.uses) | set(st.defs)
        dead = sorted(v for v in touched if v not in live and v not in keep)
        if st.code.startswith("return"):
            dead = []
        if dead:
            st.code += ";  " + " = ".join(dead) + " = None"
        live -= set(st.defs)
        live |= set(st.uses)


def source_lines(stmts: list[Stmt], indent: str = "    ") -> str:
    """The statements as indented Python source, one a line, comments beside."""
    lines = []
    for st in stmts:
        lines.append(f"{indent}{st.code}" + (f"  # {st.comment}" if st.comment else ""))
    return "\n".join(lines)
