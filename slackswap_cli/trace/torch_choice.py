"""torch.compile's own choice of what to save, read back as a plan of the profile (`compare
--with-torch-compile`).

**How torch decides.** Under `torch.compile`, AOTAutograd traces forward+backward into one
joint graph and `torch._functorch.partitioners.min_cut_rematerialization_partition` splits it:
it picks the set of forward values to save for backward (a min cut; with
`torch._functorch.config.activation_memory_budget` below 1, a knapsack between the min cut's
saved set (knob 1) and saving only the inputs (knob 0), in torch's own size terms) and
recomputes everything else backward needs.

**How we run it.** The profile's tensor names ARE the nodes of our joint graph
(`joint.capture_joint`, `graph_profile`), so we give the partitioner that graph itself, re-traced
from the profile's workload with fake tensors (nothing allocated: GPT-2 XL and Llama-7B work on
a laptop) and checked against the profile's fingerprint. The graph already has AOTAutograd's
shape: primal placeholders (parameters, buffers, inputs), one tangent (renamed `tangents_1`, the
name the partitioner looks for) and a flat output `[loss, *grads]` (`num_fwd_outputs=1`). We
chose this over capturing through `aot_function` with our own `partition_fn`: that graph is a
different trace (functionalized, other node names) and would have to be matched to the
profile's nodes by op order, target and shape, which can only be approximate.

The partitioner is called through its public entry point with the knob set by
`torch._functorch.config.patch` (restored on exit). Its choice is read where it is complete:
the `saved_values` it passes to `_extract_fwd_bwd_modules` (a private function, patched for the
duration of the call; we stop there, since the forward and backward modules it would go on to
build are not needed, and extracting them fails on graphs with in-place ops that AOTAutograd
would have functionalized first). Private torch API used: that function's name and its second
argument, `config.activation_memory_budget`; tested with torch 2.13, 2.14 and 2.15, other versions
refused (`torch_api.PARTS["torch_choice"]`).

**From torch's saved set to a plan** (one decision per saved activation root of the profile):

- *keep* a root torch saves, or any view or in-place alias of which it saves;
- *keep* a root that a value torch saves is computed from, when that value is one our trace
  computes in backward from forward values only (torch moved it into forward: it stands in for
  the root, about the same bytes, no recompute);
- *keep* a root whose recompute chain would re-run the producer of a value torch saves that the
  profile does not save (an intermediate backward reads only through recomputed ops, such as
  a projection's output that rotary embeddings are recomputed from): a plan cannot keep that
  value, and recomputing through it would re-run what torch does not (a matmul); keeping the
  root holds about the bytes torch holds, with no recompute. Counted in the notes;
- *recompute* every other root that can be recomputed (its static chain exists);
- *keep* the rest: the profile says they cannot be re-run (random ops' outputs, which inductor
  regenerates from a seed and the simulator cannot, and what is computed from them; roots
  mutated in place such as a ReLU(inplace=True) input).

**The knob search.** Knob 1 (torch's default) if its plan fits the budget in the simulator.
Else a grid (`GRID`: 0, 1/4, 1/2, 3/4); when no grid value fits, up to `SEARCH_STEPS` rounds
try the midpoints on either side of the value whose plan peaks lowest; then bisection
(`SEARCH_STEPS`) between the largest value that fits and the next value tried above it; the
best feasible plan simulated is kept. The
simulated peak does not always fall with the knob: at knob 0 every recomputed value of a chain
comes back at once at the start of backward, which can peak above a middle knob's plan, so
knob 0 is not taken as the floor. When no value tried fits, the plan with the lowest simulated
peak is shown as not fitting, with the simulator's reason. Partitions are cached by knob, so
several budgets share the grid.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import torch.fx as fx

from ..chains import candidate_chain
from ..chains import tables as chain_tables
from ..errors import InputError, TraceError
from ..planners import judge
from ..schema import Action, Decision, Plan, Profile
from ..torch_api import PARTS, refuse_untested
from ..units import fmt_bytes
from ..workload_spec import resolve_workload_path
from .retrace import trace_matching

PLANNER_NAME = "torch.compile"
TESTED_TORCH = PARTS["torch_choice"].tested
GRID = (0.0, 0.25, 0.5, 0.75)   # knob values tried when torch's default (1.0) does not fit
SEARCH_STEPS = 4                # bisection steps after the grid: a resolution of 1/64


def check_torch_version(version: str | None = None) -> None:
    """Refuse a torch the partitioner hook was not tested with (it reads a private function;
    `torch_api.PARTS["torch_choice"]`)."""
    refuse_untested("torch_choice", version, error=InputError)


def resolve_workload(profile: Profile, profile_path: str | Path | None,
                     model: str | Path | None = None) -> Path:
    """The workload file to re-trace: `model` if given, else the profile's `workload.path`.

    A relative path is looked up in the current directory, then in the folder of the profile
    and each folder above it (the repository the profile sits in). InputError when none exists.
    """
    if model is not None:
        p = Path(model).expanduser()
        if not p.is_file():
            raise InputError(f"workload file {model} does not exist",
                             hint="pass the workload .py file the profile was made from with --model")
        return p
    if profile.workload.get("source") == "onnx" or str(profile.workload.get("path", "")).endswith(".onnx"):
        raise InputError("an ONNX profile has no PyTorch training step for torch.compile to partition",
                         hint="profile the PyTorch workload (model.py) to compare with torch.compile")
    recorded = profile.workload.get("path")
    if not recorded:
        raise InputError("the profile does not record its workload file",
                         hint="pass the workload file with --model model.py")
    p = Path(resolve_workload_path(str(Path(recorded).expanduser()),
                                   near=str(profile_path) if profile_path is not None else None))
    if p.is_file():
        return p
    where = "" if p.is_absolute() else " (looked in the current directory and above the profile)"
    raise InputError(f"the profile's workload file {recorded} does not exist{where}",
                     hint="pass the workload file with --model model.py")


# --------------------------------------------------------------------------------------------
# torch's saved set at one knob value
# --------------------------------------------------------------------------------------------
class _Chosen(Exception):
    """Raised from inside the partitioner once it has chosen what to save."""

    def __init__(self, saved):
        super().__init__("saved values chosen")
        self.saved = saved


def _aot_form(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of the joint graph in the form AOTAutograd hands the partitioner (the partitioner
    rewrites the graph it is given; node names are kept, each meta dict copied)."""
    graph = fx.Graph()
    env: dict = {}
    out = graph.graph_copy(gm.graph, env)
    graph.output(out)
    for node in graph.nodes:
        if node.op == "placeholder" and node.target.startswith("tangent"):
            node.target = "tangents_1"
    return fx.GraphModule(gm, graph)


def torch_saved(joint, knob: float) -> list[str]:
    """Names of the joint graph's nodes torch's min-cut partitioner saves for backward with
    `activation_memory_budget=knob` (inputs and parameters included)."""
    # private to torch: loaded only when torch's own choice is asked for
    from torch._functorch import config as fconfig
    from torch._functorch import partitioners

    def chosen(joint_module, saved_values, *args, **kwargs):
        raise _Chosen(list(saved_values))

    gm = _aot_form(joint.gm)
    try:
        with fconfig.patch(activation_memory_budget=float(knob)), \
                mock.patch.object(partitioners, "_extract_fwd_bwd_modules", chosen):
            partitioners.min_cut_rematerialization_partition(gm, None, num_fwd_outputs=1)
    except _Chosen as done:
        return [n.name for n in done.saved if isinstance(n, fx.Node)]
    except Exception as exc:
        text = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        raise TraceError(f"torch's min-cut partitioner failed on this step's graph: {text}",
                         hint="compare without --with-torch-compile; the other planners do not "
                              "need torch") from None
    raise TraceError("torch's partitioner returned without choosing saved values (the graph "
                     "has no backward?)", hint="compare without --with-torch-compile")


# --------------------------------------------------------------------------------------------
# torch's saved set -> one decision per saved activation root
# --------------------------------------------------------------------------------------------
@dataclass
class Choice:
    """torch's choice at one knob value, as decisions on the profile, and how it was mapped."""
    knob: float
    decisions: list[Decision]
    kept_saved: int = 0          # roots torch saves (or saves a view of)
    kept_stand_in: int = 0       # roots a value torch moved into forward is computed from
    fixed: set = field(default_factory=set)   # roots torch does not save but the profile cannot recompute
    recomputed: int = 0
    off_profile: list[int] = field(default_factory=list)   # saved roots the profile does not save
    from_off_profile: set = field(default_factory=set)      # roots kept: torch recomputes them from those

    def notes(self, profile: Profile) -> list[str]:
        out = [f"activation_memory_budget={self.knob:.4g}: torch saves {self.kept_saved} of "
               f"the profile's saved roots and recomputes {self.recomputed}"]
        if self.kept_stand_in:
            out.append(f"{self.kept_stand_in} roots kept because torch saves a value computed "
                       "from them instead (moved from backward into forward)")
        if self.fixed:
            size = sum(profile.tensors[d.tensor].size_bytes for d in self.decisions
                       if d.tensor in self.fixed)
            out.append(f"{len(self.fixed)} roots ({fmt_bytes(size)}) kept that torch does not "
                       "save but the profile cannot recompute (random ops' outputs, which "
                       "inductor regenerates from a seed, and what is computed from them; "
                       "tensors mutated in place)")
        if self.off_profile:
            size = sum(profile.tensors[t].size_bytes for t in self.off_profile)
            kept = sum(profile.tensors[t].size_bytes for t in self.from_off_profile)
            out.append(f"torch also saves {len(self.off_profile)} values ({fmt_bytes(size)}) "
                       "that backward does not read directly (it recomputes from them); a plan "
                       f"cannot keep them, so the {len(self.from_off_profile)} roots "
                       f"({fmt_bytes(kept)}) torch recomputes from them are kept instead")
        return out


def choice_from_saved(profile: Profile, joint, saved_names: list[str], knob: float) -> Choice:
    """Map torch's saved node names onto the profile's saved roots (module docstring)."""
    by_name = {t.name: t.id for t in profile.tensors}
    cands = {t.id for t in profile.saved_activations}
    nodes = {n.name: n for n in joint.gm.graph.nodes}
    outputs_of = {op.name: op.outputs for op in profile.ops}
    keep, stand_in, off = set(), set(), []
    # a multi-output op saved whole (its tuple) saves each of its outputs
    tids = [(name, tid) for name in saved_names
            for tid in ([by_name[name]] if name in by_name else outputs_of.get(name, ()))]
    for name, tid in tids:
        root = profile.root(tid)
        t = profile.tensors[root]
        if t.kind != "activation" or t.producer is None:
            continue                      # a parameter, an input or a view of one: free
        if root in cands:
            keep.add(root)
        elif profile.ops[t.producer].phase == "backward":
            stand_in |= _forward_sources(nodes[name], joint.phase, by_name, profile) & cands
        elif root not in off:
            off.append(root)
    stand_in -= keep
    off_producers = {profile.tensors[r].producer for r in off}
    tab = chain_tables(profile)
    choice = Choice(knob=knob, decisions=[], kept_saved=len(keep), kept_stand_in=len(stand_in),
                    off_profile=off)
    for t in profile.saved_activations:
        chain = None if t.id in keep or t.id in stand_in else candidate_chain(tab, t.id)
        if chain is not None and off_producers.intersection(chain.ops):
            action = Action.KEEP      # torch recomputes it from a value a plan cannot keep
            choice.from_off_profile.add(t.id)
        elif chain is not None:
            action = Action.RECOMPUTE
            choice.recomputed += 1
        else:
            action = Action.KEEP
            if t.id not in keep and t.id not in stand_in:
                choice.fixed.add(t.id)
        choice.decisions.append(Decision(tensor=t.id, action=action))
    return choice


def _forward_sources(node: fx.Node, phase: dict, by_name: dict, profile: Profile) -> set[int]:
    """Roots of the forward values a backward-phase `node` is computed from (walking up through
    backward-phase nodes only)."""
    out, seen, stack = set(), set(), [node]
    while stack:
        n = stack.pop()
        for a in n.all_input_nodes:
            if a.name in seen:
                continue
            seen.add(a.name)
            if phase.get(a.name) == "backward":
                stack.append(a)
            elif phase.get(a.name) == "forward" and a.name in by_name:
                out.add(profile.root(by_name[a.name]))
    return out


# --------------------------------------------------------------------------------------------
# the knob search
# --------------------------------------------------------------------------------------------
@dataclass
class TorchCompileResult:
    plan: Plan
    knob: float                  # the activation_memory_budget of the plan shown
    met_budget: bool             # some knob value made torch's plan fit the budget
    tried: list[tuple[float, bool, float]]   # (knob, fits, peak bytes) in the order tried
    partition_s: float           # seconds spent in torch's partitioner


class TorchCompileBaseline:
    """torch.compile's choice on one profile's joint graph; partitions are cached by knob, so
    several budgets (or hardware) reuse them."""

    def __init__(self, profile: Profile, joint):
        self.profile, self.joint = profile, joint
        self._choices: dict[float, Choice] = {}
        self.partition_s = 0.0

    def choice(self, knob: float) -> Choice:
        if knob not in self._choices:
            t0 = time.perf_counter()
            saved = torch_saved(self.joint, knob)
            self.partition_s += time.perf_counter() - t0
            self._choices[knob] = choice_from_saved(self.profile, self.joint, saved, knob)
        return self._choices[knob]

    def plan(self, hw, budget_bytes: int, budget_fraction: float | None = None, *,
             steps: int = SEARCH_STEPS) -> TorchCompileResult:
        """Search the knob so torch's plan fits `budget_bytes` in the simulator (module docstring)."""
        spent0 = self.partition_s
        tried, plans = [], {}

        def attempt(knob: float):
            c = self.choice(knob)
            p, _ = judge(PLANNER_NAME, self.profile, hw, budget_bytes, c.decisions,
                         c.notes(self.profile), budget_fraction=budget_fraction)
            tried.append((knob, p.feasible, p.predicted.peak_bytes))
            plans[knob] = p
            return p

        if not attempt(1.0).feasible:
            fits = [k for k in GRID if attempt(k).feasible]
            for _ in range(steps if not fits else 0):
                fits = [k for k in _around_lowest_peak(plans) if attempt(k).feasible]
                if fits:
                    break
            if fits:   # bisect between the largest knob that fits and the next one tried above it
                lo = max(fits)
                hi = min(k for k in plans if k > lo)
                for _ in range(steps):
                    mid = (lo + hi) / 2
                    if attempt(mid).feasible:
                        lo = mid
                    else:
                        hi = mid
        feasible = [k for k, fits, _ in tried if fits]
        if feasible:
            knob = max(feasible, key=lambda k: (plans[k].predicted.retention, k))
        else:   # no knob fits: the plan with the lowest simulated peak is the closest
            knob = min(plans, key=lambda k: (plans[k].predicted.peak_bytes, -k))
        spent = self.partition_s - spent0
        p = plans[knob]
        search = (f"{len(tried)} knob values tried ({spent:.1f} s in torch's partitioner, "
                  "partitions made for earlier budgets reused): "
                  + ("met the budget" if feasible else
                     "no activation_memory_budget tried meets the budget"))
        p = dataclasses.replace(p, notes=(*p.notes, search), solve_ms=spent * 1e3)
        return TorchCompileResult(plan=p, knob=knob, met_budget=bool(feasible), tried=tried,
                                  partition_s=spent)


def _around_lowest_peak(plans: dict) -> list[float]:
    """The midpoints between the knob whose plan peaks lowest and its tried neighbours."""
    ks = sorted(plans)
    i = ks.index(min(ks, key=lambda k: (plans[k].predicted.peak_bytes, -k)))
    return [(a + b) / 2 for a, b in ((ks[i - 1] if i else None, ks[i]),
                                     (ks[i], ks[i + 1] if i + 1 < len(ks) else None))
            if a is not None and b is not None and (a + b) / 2 not in plans]


def baseline_for(profile: Profile, profile_path=None, model=None) -> TorchCompileBaseline:
    """Re-trace the profile's workload with fake tensors (checked against its fingerprint)
    and wrap it for the knob search."""
    check_torch_version()
    path = resolve_workload(profile, profile_path, model)
    joint, _, _ = trace_matching(profile, str(path))
    return TorchCompileBaseline(profile, joint)
