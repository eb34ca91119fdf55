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
- **recompute**: nothing is saved; right before the first backward use, backward re-runs the
  producer and, recursively, whatever it needs that is not at hand (the *chain*): kept and
  swapped values are taken, recomputed saved values stay until their last use, and transient
  values of the chain are dropped after it (and recomputed again if another chain needs them).
  Random ops are never re-run: a plan that would do so is refused. An op that mutates one of
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

from .errors import InputError
from .schema import Plan, Profile

RESERVED = {"torch", "aten", "rt", "_s", "_device", "None", "float"}

# Ops that update BatchNorm running statistics in place without declaring it in their schema:
# target packet name -> positions of the mutated arguments.
_HIDDEN_WRITES = {"native_batch_norm": (3, 4), "cudnn_batch_norm": (3, 4),
                  "miopen_batch_norm": (3, 4), "_native_batch_norm_legit": (3, 4),
                  "_batch_norm_with_update": (3, 4)}


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
    from .trace.graph_profile import is_random_op
    return is_random_op(node)


def written_args(node: fx.Node) -> list[int]:
    """Positions of the arguments an op writes in place (schema `a!`, plus hidden BN writes)."""
    target = node.target
    schema = getattr(target, "_schema", None)
    out = []
    if schema is not None:
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write and i < len(node.args):
                out.append(i)
    packet = getattr(getattr(target, "overloadpacket", None), "__name__", "")
    if packet in _HIDDEN_WRITES:
        training = node.args[5] if len(node.args) > 5 else True
        if training:
            out += [i for i in _HIDDEN_WRITES[packet] if i < len(node.args)
                    and isinstance(node.args[i], fx.Node)]
    return out


def is_inplace(node: fx.Node) -> bool:
    """An op whose result is its first argument, written in place (`relu_`, `bernoulli_`)."""
    return (isinstance(node.target, torch._ops.OpOverload) and 0 in written_args(node)
            and node.target._schema.returns and node.target._schema.returns[0].alias_info is not None)


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
        return self.action.get(r, "keep")

    def root_node(self, n: fx.Node) -> fx.Node | None:
        r = self.root_tid(n)
        if r is None:
            return None
        name = self.profile.tensors[r].name
        return self.by_name.get(name)


def partition(gm: fx.GraphModule, phase: dict[str, str], profile: Profile, plan: Plan,
              placeholder_names: list[str], device_type: str) -> StepCode:
    import sys
    limit = sys.getrecursionlimit()
    # a recompute chain may reach back through many layers (one frame per value on the way)
    sys.setrecursionlimit(max(limit, 50_000))
    try:
        return _partition(gm, phase, profile, plan, placeholder_names, device_type)
    finally:
        sys.setrecursionlimit(limit)


def _partition(gm: fx.GraphModule, phase: dict[str, str], profile: Profile, plan: Plan,
               placeholder_names: list[str], device_type: str) -> StepCode:
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
    fwd_set = {n.name for n in forward}

    # forward values backward reads (the saved values), and what the returned grads need
    bneed: dict[str, fx.Node] = {}
    for b in backward:
        for a in b.all_input_nodes:
            if a.name in fwd_set:
                bneed.setdefault(a.name, a)
    for gnode in grad_nodes:
        if isinstance(gnode, fx.Node) and gnode.name in fwd_set:
            bneed.setdefault(gnode.name, gnode)

    # decide, for each saved value, how backward gets it
    kept: dict[str, fx.Node] = {}            # taken from the store
    swap_roots: dict[str, fx.Node] = {}      # root name -> root node
    for name, n in bneed.items():
        act = g.group_action(n)
        root = g.root_node(n)
        if act == "swap":
            if root is None or root.name not in fwd_set:
                raise PlanApplyError(f"the plan swaps {name}, whose storage root is not a forward value")
            swap_roots[root.name] = root
        elif act == "recompute":
            pass
        else:
            kept[name] = n
            if act == "keep" and root is not None and root.name in fwd_set:
                kept[root.name] = root  # views of a kept root re-derive from it (same storage)
    for tid, act in g.action.items():
        if act == "recompute" and not profile.tensors[tid].recomputable:
            raise PlanApplyError(f"the plan recomputes {profile.tensors[tid].name}, which is not "
                                 "recomputable (a random op's result or mutated in place)",
                                 hint="re-run `slackswap plan`; planners never recompute these")

    # -- forward ---------------------------------------------------------------------------
    # a swapped root is copied out after the last op that writes into its storage
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

    # -- backward --------------------------------------------------------------------------
    prefetch_at = _prefetch_points(g, plan, swap_roots, backward, bneed)
    bstmts: list[Stmt] = []
    persistent: set[str] = {p.name for p in placeholders}
    recomputed_roots: set[str] = set()
    counter = {"ops": 0}

    def need(x: fx.Node, transient: set[str], top: int | None, depth: int = 0) -> None:
        if x.op == "placeholder" or x.name in persistent or x.name in transient:
            return
        if depth > 20000:
            raise PlanApplyError(f"recompute chain of {x.name} is too deep")
        if x.name in kept:
            bstmts.append(Stmt(f"{x.name} = _s.take({x.name!r})", defs=(x.name,)))
            persistent.add(x.name)
            return
        rtid = g.root_tid(x)
        # a swapped value that a chain needs before its own first use: recompute it for the
        # chain when it can be (as the planner costs it), rather than fetch it early
        early = (g.group_action(x) == "swap" and rtid != top
                 and group_first_use.get(rtid, -1) > cur["pos"]
                 and profile.tensors[rtid].recomputable)
        if early:
            mark = (len(bstmts), set(persistent), set(transient), counter["ops"])
            try:
                replay(x, transient, top, depth, early=True)
                return
            except PlanApplyError:  # the chain needs a random or in-place value: fetch instead
                del bstmts[mark[0]:]
                persistent.clear()
                persistent.update(mark[1])
                transient.clear()
                transient.update(mark[2])
                counter["ops"] = mark[3]
        if x.name in swap_roots:
            bstmts.append(Stmt(f"{x.name} = _s.wait({x.name!r})", defs=(x.name,),
                               comment="swap: host copy back on the device"))
            persistent.add(x.name)
            return
        replay(x, transient, top, depth, early=False)

    def replay(x: fx.Node, transient: set[str], top: int | None, depth: int, early: bool) -> None:
        """Re-derive x from its inputs: a view, an in-place alias, or a recomputed op."""
        act = g.group_action(x)
        if x.target is operator.getitem:
            need(x.args[0], transient, top, depth + 1)
            bstmts.append(Stmt(f"{x.name} = {x.args[0].name}[{int(x.args[1])}]", defs=(x.name,),
                               uses=(x.args[0].name,)))
        elif x.op == "get_attr":
            bstmts.append(_define(x, g, device_type))
        elif is_inplace(x):
            if act not in ("swap", "keep"):
                raise PlanApplyError(
                    f"backward needs {x.name}, written in place by {x.target}, and it cannot be "
                    "recomputed", hint="re-run `slackswap plan`: this value must be kept or swapped")
            src = x.args[0]
            need(src, transient, top, depth + 1)
            bstmts.append(Stmt(f"{x.name} = {src.name}", defs=(x.name,), uses=(src.name,),
                               comment="in-place op: its effect is already in the data"))
        else:
            if is_random(x):
                raise PlanApplyError(
                    f"recomputing {x.name} would re-run the random op {x.target}",
                    hint="re-run `slackswap plan`: random results must be kept or swapped")
            if act == "keep" and not _is_view(x):
                raise PlanApplyError(f"backward needs {x.name}, which the plan keeps, but it was "
                                     "not saved", hint="this is a bug in apply; please report it")
            for a in x.all_input_nodes:
                need(a, transient, top, depth + 1)
            clones = tuple(i for i in written_args(x))
            st = _define(x, g, device_type, clone_args=clones)
            if act == "recompute" and g.root_node(x) is x:
                recomputed_roots.add(x.name)
            if not _is_view(x) or act == "recompute":
                target = profile.tensors[top].name if top is not None else ""
                st.comment = (f"recompute {target or x.name}" if g.root_tid(x) == top or not target
                              else f"recompute, on the way to {target}")
            bstmts.append(st)
            if not _is_view(x):
                counter["ops"] += 1
        # a recomputed value stays until its last use when its own group is what backward asked
        # for; recomputed on the way to another value, it is dropped after that chain (as the
        # planner assumes)
        stays = not early and (act in ("keep", "swap")
                               or (act == "recompute" and g.root_tid(x) == top))
        (persistent if stays else transient).add(x.name)

    group_first_use: dict[int, int] = {}
    for i, b in enumerate(backward):
        for a in b.all_input_nodes:
            if a.name in fwd_set and g.root_tid(a) is not None:
                group_first_use.setdefault(g.root_tid(a), i)
    cur = {"pos": 0}
    for i, b in enumerate(backward):
        cur["pos"] = i
        for rname in prefetch_at.get(b.name, []):
            bstmts.append(Stmt(f"_s.prefetch({rname!r})", comment="swap: copy back ahead of use"))
        transient: set[str] = set()
        for a in b.all_input_nodes:
            if a.name in fwd_set:
                need(a, transient, g.root_tid(a))
        bstmts.append(_define(b, g, device_type))
        persistent.add(b.name)
    grads = []
    for gnode in grad_nodes:
        if isinstance(gnode, fx.Node):
            need(gnode, set(), g.root_tid(gnode))
            grads.append(gnode.name)
        else:
            grads.append(None)
    bstmts.append(Stmt("return [" + ", ".join(x or "None" for x in grads) + "]",
                       uses=tuple(x for x in grads if x)))

    args = [p.name for p in placeholders[:-1]]
    _insert_frees(fstmts, keep=set(args))
    _insert_frees(bstmts, keep=set(args) | {tangent})
    return StepCode(forward=fstmts, backward=bstmts, forward_args=args, tangent=tangent,
                    loss=loss_node.name, grads=grads, kept=sorted(kept),
                    swapped=sorted(swap_roots), recomputed=sorted(recomputed_roots),
                    recomputed_ops=counter["ops"])


def _is_view(n: fx.Node) -> bool:
    if not isinstance(n.target, torch._ops.OpOverload):
        return n.target is operator.getitem
    rets = n.target._schema.returns
    return bool(rets) and rets[0].alias_info is not None and not rets[0].alias_info.is_write \
        or n.target.overloadpacket.__name__ in ("_unsafe_view", "_reshape_alias")


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


def _prefetch_points(g: _Graph, plan: Plan, swap_roots: dict[str, fx.Node],
                     backward: list[fx.Node], bneed: dict[str, fx.Node]) -> dict[str, list[str]]:
    """Backward node name -> swapped roots whose copy back is issued right before it.

    The plan's prefetch point (its schedule, else the decision's `prefetch_at`) wins; without
    one, a root is prefetched when the previous swapped root (in order of first use) is waited
    for: one copy in flight ahead of use.
    """
    prof = g.profile
    name_of_op = {op.id: op.name for op in prof.ops}
    bpos = {n.name: i for i, n in enumerate(backward)}
    issue: dict[str, int] = {}
    tid_to_root = {g.root_tid(r): r.name for r in swap_roots.values()}
    for d in plan.decisions:
        if d.action == "swap" and d.prefetch_at is not None and d.tensor in tid_to_root:
            op = name_of_op.get(d.prefetch_at)
            if op in bpos:
                issue[tid_to_root[d.tensor]] = bpos[op]
    for ev in plan.schedule:
        if ev.kind == "prefetch" and ev.tensor in tid_to_root:
            op = name_of_op.get(ev.issue_op)
            if op in bpos:
                issue[tid_to_root[ev.tensor]] = bpos[op]
    # first backward use of each swapped root (through any alias)
    first_use: dict[str, int] = {}
    for b in backward:
        for a in b.all_input_nodes:
            r = g.root_node(a) if a.name in bneed else None
            if r is not None and r.name in swap_roots:
                first_use.setdefault(r.name, bpos[b.name])
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


def render(stmts: list[Stmt], indent: str = "    ") -> str:
    lines = []
    for st in stmts:
        lines.append(f"{indent}{st.code}" + (f"  # {st.comment}" if st.comment else ""))
    return "\n".join(lines)
