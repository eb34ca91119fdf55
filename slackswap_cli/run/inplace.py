"""Patch a model in place: the plan runs inside the model's own forward and autograd's backward.

`patch(model, meta, table)` replaces `model.forward` (an instance attribute, so `unpatch`
restores the class's) with a wrapper. In eval mode or with grad disabled the wrapper calls the
original forward and does nothing else. In training, the first call at an input signature runs
the original forward under a recorder and saved-tensor hooks (`run/record.py`: `PlanRun`, which
lines the step up with the profile and carries the plan out: keep, swap to host, recompute in
backward); later calls at that signature run on saved-tensor hooks alone (`run/steady.py`:
`SteadyRun`, following the first call's decisions).

Each input signature (device type, shapes and dtypes) gets its own plan: the profiled one, or
one made at other shapes, borrowed without a trace (`_Patched._borrow`, `run/shape_run.py`), or
one made on the fly from a fake trace (`run/replan.py`: another device or dtype, or where the
plan borrowed does not line up), or, with `strict`, a refusal. A deep copy or a pickled
copy of a patched model is patched too, for its own parameters.
"""
from __future__ import annotations

import copy
import math

import torch
import torch.utils._pytree as pytree

from ..guard import Scale
from ..schema import Action
from . import steady as _steady
from .generated import check_generated
from .record import (
    ALIGN_WARN,
    STATE,
    PlanRun,
    Recorder,
    body_hook,
    leave_hook,
    trace_only_ops,
)
from .shape_run import ShapeRun

__all__ = ["patch", "unpatch", "is_patched", "PlanRun"]

SAY_MAX = 3             # signatures a kind of note is printed for (`_Patched._say_capped`)


class _Table:
    """One plan's table (`chains.runtime_table`) and the lookups derived from it. A table
    `borrow`ed for other input shapes (`shape_run.py`) has its own byte figures: the guard's
    limit, what the plan keeps after each pack (`pack_reserve`, once a call at those shapes
    saw them) or the factor `keep_after` is scaled by."""
    borrowed = False
    pack_reserve: list[int] | None = None
    scale = 1.0
    fraction: float | None = None   # borrowed, limit not settled: of the keep-all bytes
    limit_made_at = 0               # (then: the limit at the shapes it was made for)

    def __init__(self, table: dict, budget_bytes: int | None = None):
        self.table = table
        # what the guard holds a call to (`guard.py`): the plan's budget (none: no limit)
        limit = table.get("budget_bytes", budget_bytes)
        self.limit = limit if limit and limit > 0 else None
        self.op_inputs = table["op_inputs"]
        self.non_activation = set(table["non_activation"])
        self.last_write = {int(k): v for k, v in table.get("last_write", {}).items()}
        # roots chains read: `chain_uses` counts the chains that read each one. Kept (and
        # not yet offloaded) ones are held from production (`pin_roots`) until those chains
        # ran; recomputed or fetched ones stay after autograd took them until then too.
        self.chain_uses: dict[int, int] = {}
        for ins in table["chain_inputs"].values():
            for r in ins:
                self.chain_uses[r] = self.chain_uses.get(r, 0) + 1
        self.pin_roots = {r for r in self.chain_uses
                          if table["action"].get(r) != Action.RECOMPUTE}
        self.trace_only = trace_only_ops(table["ops"])      # not counted as missed

    def borrow(self) -> "_Table":
        """This plan for other input shapes: the same table, its byte figures its own."""
        got = copy.copy(self)
        got.borrowed, got.pack_reserve = True, None
        return got


def _signature(device_type: str, param_dtype: str, args, kwargs) -> tuple:
    """The device type, the parameters' dtype, then shapes and dtypes of a call's tensors in
    order: what a plan is made for (another device runs other kernels: a fake CPU profile's
    plan on a GPU; `.to(torch.float64)` is another graph at twice the bytes)."""
    return (device_type, param_dtype.removeprefix("torch."),
            *((tuple(x.shape), str(x.dtype).removeprefix("torch."))
              for x in _leaves(args, kwargs) if isinstance(x, torch.Tensor)))


def _leaves(args, kwargs) -> list:
    """pytree's leaves of (args, kwargs), without pytree for flat calls (the common case)."""
    flat = [*args, *kwargs.values()]
    for a in flat:
        if isinstance(a, _NESTED):
            return pytree.tree_leaves((args, kwargs))
    return flat


_NESTED = (list, tuple, dict)


def _tensors(args, kwargs) -> list:
    """The call's tensors, in `_leaves` order."""
    return [x for x in _leaves(args, kwargs) if isinstance(x, torch.Tensor)]


class _Patched:
    """What `patch` attaches to a model: its plans (one per input signature), the first call's
    record at each signature (`steady.Template`, for the calls after it) and state. Nothing of the
    model is read before its first call (a model being unpickled or deep-copied is empty when
    this is made)."""

    def __init__(self, model, meta: dict, table: dict, original_forward, had_instance_forward,
                 replan: bool = True, strict: bool = False, plans: dict | None = None):
        self.model, self.meta, self.table = model, meta, table
        self._forward = original_forward       # None: the class's forward
        self.had_instance_forward = had_instance_forward
        self.last_run: PlanRun | None = None
        self.said: set[str] = set()             # notes already given on stderr
        self.said_count: dict[str, int] = {}    # notes given per kind (`_say_capped`)
        self.module_hooks: dict[int, tuple] = {}
        self._names: dict | None = None
        self._first = None
        self.buffer_ids: set[int] = set()
        self.replan = replan
        self.branchy = False                    # a call planned again along its branches
        self.strict = strict
        self.steady = True                      # later calls at a signature: hooks alone
        self.measure_held = False               # later calls note what autograd holds
        self.templates: dict[tuple, object] = {}
        self.fast_plans: dict[tuple, tuple] = {}    # shapes, dtypes, device -> (plan, sig)
        self.hot: dict[tuple, tuple] = {}           # the same key -> (plan, sig, template)
        self.first_at: dict[tuple, tuple] = {}      # new shapes -> (template, Scale, its
        #                                             plan: None, the one borrowed) to follow
        self.superseded: dict[tuple, object] = {}   # signature -> its first call's record, on
        #                                             a plan since made again (`_follow_branches`)
        self.keep_all: dict[tuple, int] = {}        # signature -> bytes a keep-all run holds
        params = meta.get("params") or [[None, None, "torch.float32"]]
        profiled = (meta.get("device_type", "cpu"), params[0][2].removeprefix("torch."),
                    *((tuple(shape), dtype.removeprefix("torch."))
                      for shape, dtype in meta.get("input_tensors", [])))
        self.plans: dict[tuple, _Table | None] = plans or {
            profiled: _Table(table, meta.get("budget_bytes"))}
        self.default = next(iter(self.plans.values()))

    @property
    def original_forward(self):
        if self._forward is None:
            return type(self.model).forward.__get__(self.model)
        return self._forward

    @property
    def names(self) -> dict:
        if self._names is None:
            self._names = {id(m): name for name, m in self.model.named_modules()}
        return self._names

    def _first_param(self):
        """The model's first parameter (found once, then checked in its slot: walking the
        module tree costs tens of microseconds a call)."""
        slot = self._first
        if slot is not None and slot[0].get(slot[1]) is slot[2]:
            return slot[2]
        for m in self.model.modules():
            for name, p in m._parameters.items():
                if p is not None:
                    self._first = (m._parameters, name, p)
                    return p
        return None

    def copy_for(self, model, memo: dict) -> "_Patched":
        """This patch for `model`, a deep copy of the patched one: its own parameters, the
        same plans; the first call at each signature records again."""
        fwd = None if self._forward is None else copy.deepcopy(self._forward, memo)
        return _Patched(model, self.meta, self.table, fwd, self.had_instance_forward,
                        self.replan, self.strict, dict(self.plans))

    def key(self, args, kwargs) -> tuple[tuple, list]:
        """What a later call finds its plan and template by (without building `_signature`):
        the first parameter's device and dtype, the call's tensors' shapes and dtypes; and
        the call's tensors, in `_leaves` order. (One loop: this runs on every call.)"""
        slot = self._first
        ref = slot[2] if slot is not None and slot[0].get(slot[1]) is slot[2] \
            else self._first_param()
        key = [None, None] if ref is None else [ref.device, ref.dtype]
        inputs = []
        for x in (args if not kwargs else (*args, *kwargs.values())):
            if isinstance(x, torch.Tensor):
                inputs.append(x)
                key += (x.shape, x.dtype)
            elif isinstance(x, _NESTED):
                inputs = _tensors(args, kwargs)
                key = [*key[:2], *(t for y in inputs for t in (y.shape, y.dtype))]
                break
        return tuple(key), inputs

    def plan_for(self, args, kwargs, key: tuple) -> tuple["_Table", tuple]:
        """The plan for this call's signature (device, parameter dtype, input shapes and
        dtypes): the profiled one, or one made for it the first time it is seen (said once
        on stderr), cached; and the signature. `key`: `self.key`'s."""
        got = self.fast_plans.get(key)
        if got is None:
            got = self.fast_plans[key] = self._plan_for(args, kwargs, self._first_param())
        return got

    def _plan_for(self, args, kwargs, ref) -> tuple["_Table", tuple]:
        sig = _signature(ref.device.type if ref is not None else "cpu",
                         str(ref.dtype if ref is not None else torch.float32), args, kwargs)
        if sig in self.plans:
            return self.plans[sig] or self.default, sig
        if self.strict:
            from ..errors import FingerprintMismatch
            profiled = next(iter(self.plans))
            raise FingerprintMismatch(
                f"the model was called with {_shapes(sig)}, the plan was made for "
                f"{_shapes(profiled)} (patched with strict=True)",
                hint="re-profile at these shapes, or patch without strict=True to plan for "
                     "them on the fly")
        plan = None
        if self.replan and self.steady:
            got = self._borrow(sig)
            if got is not None:
                return got, sig
        if self.replan and self.branchy:
            # this model's calls read values its fake trace cannot (`branches.py`): the first
            # call at these shapes runs held by the guard, then one trace along its branches
            # plans for the calls after it (`_follow_branches`), instead of two traces
            self.plans[sig] = None
            return self.default, sig
        if self.replan:
            import sys
            import time

            from .replan import replan_table
            t0 = time.perf_counter()
            try:
                table, what = replan_table(self.model, self.original_forward, args, kwargs,
                                           self.meta)
                plan = _Table(table)
                print(f"slackswap: new inputs {_shapes(sig)}: planned for them in "
                      f"{time.perf_counter() - t0:.1f} s ({what})", file=sys.stderr)
            except Exception as exc:
                print(f"slackswap: new inputs {_shapes(sig)}: could not plan for them "
                      f"({_brief(exc)}); "
                      "running with the profiled plan", file=sys.stderr)
        self.plans[sig] = plan
        return plan or self.default, sig

    def _borrow(self, sig) -> "_Table | None":
        """A plan for new input shapes without a trace (`shape_run.py`): the plan of a
        signature that differs from `sig` only in its shapes (same device, dtypes and ranks)
        and whose first call made a template, borrowed; the first call at `sig` follows that
        template (`self.first_at`). Where none has a template of its plan, but one had its
        first call recorded on a plan since made again (along its branches), the first call
        at `sig` follows that call's template, on that plan, held by the guard to the new
        plan's fraction of the keep-all bytes (the packs are eager's, whatever the plan: the
        template's keep-all bytes are the new plan's too), and the new plan is borrowed for
        the calls after it (`_superseded`). Where no such signature has a template yet but
        one has a plan and a recorded call, that plan, recorded at `sig`; where none has had
        a call yet (the run's first call, at other shapes than the profiled ones), the plan,
        recorded at `sig`, its limit first guessed from its profile (`_first_guess`). None
        when neither (a table written before it named its saved bytes)."""
        alike = [(other, plan) for other, plan in self.plans.items()
                 if plan is not None and plan.fraction is None and _alike(other, sig)]
        for other, plan in alike:
            tpl = self._template(other)
            if tpl is None:
                continue
            got = self.plans[sig] = plan.borrow()
            if tpl.keep_only:              # keeps everything, at any shape: nothing to scale
                self.templates[sig] = tpl
            else:
                self.first_at[sig] = (tpl, Scale([s for s, _ in other[2:]],
                                                 [s for s, _ in sig[2:]]), None)
            return got
        for other, plan in alike:
            old = self._superseded(other)
            if old is None or plan.limit is None:
                continue
            tpl, ran_on = old
            got = self.plans[sig] = plan.borrow()
            runner = ran_on.borrow()
            runner.limit = plan.limit       # (the new plan's fraction: `ShapeRun.fraction`)
            self.first_at[sig] = (tpl, Scale([s for s, _ in other[2:]],
                                             [s for s, _ in sig[2:]]), runner)
            return got
        for other, plan in alike:
            # no template yet (its plan was just made): the first call at `sig` is recorded
            # on that plan, its limit scaled by the inputs' sizes until the call has counted
            # what a keep-all run holds here (then the plan's fraction of it)
            made_at = self.keep_all.get(other)
            if made_at and plan.limit is not None:
                got = self.plans[sig] = plan.borrow()
                old = [shape for shape, _ in other[2:]]
                big = max(old, key=math.prod, default=())     # (its elements: a first guess)
                ratio = Scale(old, [shape for shape, _ in sig[2:]]).ratio(big)
                got.fraction, got.limit_made_at = plan.limit / made_at, plan.limit
                got.limit, got.scale = int(plan.limit * ratio), ratio
                return got
        for other, plan in alike:
            guess = _first_guess(plan, other, sig)
            if guess is not None:
                got = self.plans[sig] = plan.borrow()
                got.fraction, got.limit_made_at = guess[0], plan.limit
                got.limit, got.scale = int(plan.limit * guess[1]), guess[1]
                return got
        return None

    def forward(self, *args, **kwargs):
        if not (self.model.training and torch.is_grad_enabled()) or \
                getattr(STATE, "run", None) is not None:
            return self.original_forward(*args, **kwargs)
        if torch.compiler.is_compiling():
            self._say("compile", "torch.compile traces the model's own forward: the compiled "
                      "model runs unpatched, without the plan (patch the eager model, or use "
                      "the compiled path)")
            return self.original_forward(*args, **kwargs)
        key, inputs = self.key(args, kwargs)
        hot = self.hot.get(key)        # (a later call at a signature with a template)
        if hot is not None and self.steady:
            plan, sig, tpl = hot
            if tpl.holds():
                return self._steady(tpl.start(self, plan, inputs), args, kwargs, sig)
            self._drop(sig)                     # parameters replaced, or autocast changed
        plan, sig = self.plan_for(args, kwargs, key)
        tpl = self._template(sig) if self.steady else None
        if tpl is not None:
            self.hot[key] = (plan, sig, tpl)
            return self._steady(tpl.start(self, plan, inputs), args, kwargs, sig)
        first = self.first_at.pop(sig, None)
        if first is not None:           # new shapes: another shape's template, no trace
            run = ShapeRun(self, first[2] or plan, first[0], inputs, first[1])
            out = self._steady(run, args, kwargs, sig)
            if first[2] is not None:    # the template's own plan ran: its figures, not its
                plan.limit, plan.scale = first[2].limit, first[2].scale   # packs' keeps
                if not run.guard.swaps:
                    return out          # (its alignment is the superseded call's: no note)
            self._check_run(run, sig)
            return out
        run = PlanRun(self, plan)
        run.inputs = {id(x) for x in inputs}
        run.call_inputs = inputs
        self.buffer_ids = {id(b) for b in self.model.buffers()}
        self._say_checkpointing()
        prev = getattr(STATE, "run", None)
        STATE.run = run
        from torch.nn.modules.module import (
            register_module_forward_hook,
            register_module_forward_pre_hook,
        )
        self._last_hooks()
        hooks = [register_module_forward_pre_hook(run.lineup.enter),
                 register_module_forward_hook(run.lineup.left, always_call=True)]
        try:
            with Recorder(run), torch.autograd.graph.saved_tensors_hooks(run.pack, run.unpack):
                out = self.original_forward(*args, **kwargs)
        finally:
            STATE.run = prev
            for h in hooks:
                h.remove()
            self.remove_hooks()      # off the model until the next full record
        self.last_run = run
        self.templates[sig] = (run, self._fingerprint())
        self.keep_all[sig] = run.saved_bytes
        if plan.fraction is not None:     # borrowed, no template followed: settle its limit
            plan.limit = int(plan.fraction * run.saved_bytes)
            plan.scale = plan.limit / plan.limit_made_at
            plan.fraction = None
        rep = self._check_run(run, sig)
        self._follow_branches(run, sig, args, kwargs, rep)
        return out

    def _follow_branches(self, run: PlanRun, sig, args, kwargs, rep: dict) -> None:
        """After a recorded call at `sig` that lined up less than 99% (`rep`: its report):
        plan again, once, from a fake trace along the branches this call took (`branches.py`:
        a library that branches otherwise under fake tensors), into the same budget; or, for
        a plan borrowed from other shapes that did not line up here (other ops at these
        shapes), from a trace at these shapes. The next call runs that plan."""
        if not self.replan or ("branches", sig) in self.said or rep["fraction"] >= ALIGN_WARN \
                or not (run.values or run.t.borrowed):
            return          # (no value read, own plan: no branch a trace could take otherwise)
        self.said.add(("branches", sig))
        import sys
        import time

        from .replan import replan_table
        t0 = time.perf_counter()
        try:
            # the budget: this signature's plan's bytes; at new shapes (no plan of their own
            # yet) the plan's fraction of the new keep-all peak, as a re-plan for them takes
            own = self.plans.get(sig) is not None and not run.t.borrowed
            table, what = replan_table(self.model, self.original_forward, args, kwargs,
                                       self.meta, values=run.values or None,
                                       budget_bytes=run.t.limit if own else None)
        except Exception as exc:
            print(f"slackswap: could not plan along the branches this call took ({_brief(exc)})"
                  "; the guard holds the plan's budget", file=sys.stderr)
            return
        got = self.templates.get(sig)
        if type(got) is tuple and got[0] is run:
            self.superseded[sig] = got      # (a new length may follow it: `_borrow`)
        self.plans[sig] = _Table(table)
        self.branchy = self.branchy or bool(run.values)
        self.fast_plans = {k: v for k, v in self.fast_plans.items() if v[1] != sig}
        self._drop(sig)
        how = ("along the branches this call took" if run.values else
               "at these shapes, where the plan of other shapes did not line up")
        self._say_capped("re-plan", f"planned again {how} ({what}) in "
                         f"{time.perf_counter() - t0:.1f} s; the next call at {_shapes(sig)} "
                         "runs it")

    def _steady(self, run, args, kwargs, sig):
        STATE.run = run            # (None before: `forward` checked)
        try:
            if run.pack is None:    # (a keep-all plan, not measuring: nothing to do)
                out = self.original_forward(*args, **kwargs)
            else:
                with torch.autograd.graph.saved_tensors_hooks(run.pack, run.unpack):
                    out = self.original_forward(*args, **kwargs)
        finally:
            STATE.run = None
        if not run.finish():
            self._drop(sig)                     # other control flow: the next call records
            self._check_run(run, sig)
        self.last_run = run
        return out

    def _template(self, sig):
        """The steady-state template for `sig`, made from its first call once that call's
        backward ran every chain it deferred (it then knows what each chain reads)."""
        got = self.templates.get(sig)
        if got is None or got is False:
            return None
        if type(got) is not tuple:
            if got.holds():
                return got
            self._drop(sig)                     # parameters replaced, or autocast changed
            return None
        run, made_with = got
        if not made_with.holds() or not set(run.deferred) <= run.done_chains:
            return None                          # (the first call's backward has not run)
        tpl = _steady.Template(run, made_with)
        self.templates[sig] = tpl if tpl.ok else False
        return tpl if tpl.ok else None

    def _superseded(self, sig):
        """(template, the plan it ran) of `sig`'s first call, recorded on a plan since made
        again, once its backward ran; None if there is none, it keeps everything (nothing
        to follow pack by pack) or the parameters were replaced since."""
        got = self.superseded.get(sig)
        if got is None:
            return None
        if type(got[0]) is PlanRun:
            run, made_with = got
            if made_with.holds() and not set(run.deferred) <= run.done_chains:
                return None                     # (its backward has not run yet)
            tpl = _steady.Template(run, made_with) if made_with.holds() else None
            got = (tpl, run.t) if tpl is not None and tpl.ok and not tpl.keep_only else None
        if got is None or not got[0].holds():
            self.superseded.pop(sig, None)      # (nothing to follow: not kept either)
            return None
        self.superseded[sig] = got
        return got

    def _drop(self, sig) -> None:
        """Forget `sig`'s template: the next call at it records again."""
        self.templates.pop(sig, None)
        self.hot = {k: v for k, v in self.hot.items() if v[1] != sig}

    def _fingerprint(self):
        return _steady.Fingerprint(self.model)

    def _say(self, key: str, text: str) -> None:
        if key not in self.said:
            self.said.add(key)
            import sys
            print(f"slackswap: {text}", file=sys.stderr)

    def _say_checkpointing(self) -> None:
        if any(getattr(m, "gradient_checkpointing", False) is True for m in self.model.modules()):
            self._say("checkpointing", "Hugging Face gradient checkpointing is on: its "
                      "checkpointed blocks save their own tensors, so the plan runs only for "
                      "the rest of the model (turn it off with "
                      "model.gradient_checkpointing_disable() to run the whole plan)")

    def _last_hooks(self) -> None:
        """Keep our body-entry pre-hook and body-exit forward hook last on every submodule
        (a wrapper such as FSDP2 may have added its own since)."""
        for mod in self.model.modules():
            if mod is self.model:
                continue
            mine = self.module_hooks.get(id(mod))
            if mine is not None and next(reversed(mod._forward_pre_hooks), None) == mine[0].id \
                    and next(reversed(mod._forward_hooks), None) == mine[1].id:
                continue
            if mine is not None:
                for h in mine:
                    h.remove()
            self.module_hooks[id(mod)] = (mod.register_forward_pre_hook(body_hook),
                                          mod.register_forward_hook(leave_hook, always_call=True))

    def remove_hooks(self) -> None:
        for hooks in self.module_hooks.values():
            for h in hooks:
                h.remove()
        self.module_hooks.clear()

    @property
    def last_report(self) -> dict | None:
        """What the last training call did (`PlanRun.report`): how much of the profile lined
        up, what the guard swapped, bytes held for backward against the plan's budget."""
        return None if self.last_run is None else self.last_run.report()

    def _check_run(self, run: PlanRun, sig) -> dict:
        """Say once per signature, on stderr, when less than 99% of the profile's forward ops
        lined up or the guard swapped what the plan could not place: what, what it cost and
        what to do (correctness is not at stake either way). Returns the call's report."""
        rep = run.report()
        low, acted = rep["fraction"] < ALIGN_WARN, rep["guard_swaps"] > 0
        if not (low or acted) or ("run", sig) in self.said:
            return rep
        self.said.add(("run", sig))
        if self.branchy and self.plans.get(sig) is None and not acted:
            return rep  # a new shape on the profiled plan, planned along its branches next
        from ..units import fmt_bytes
        text = (f"{rep['lined_up']} of the profile's {rep['expected']} forward ops lined up "
                f"({rep['fraction']:.1%}) at {_shapes(sig)}")
        if acted:
            text += (f"; the guard swapped {rep['guard_swaps']} saved tensors the plan could not "
                     f"place ({fmt_bytes(rep['guard_swapped_bytes'])})")
        if rep["budget_bytes"]:
            over = rep["held_bytes"] > rep["budget_bytes"]
            text += (f"; {fmt_bytes(rep['held_bytes'])} held for backward, "
                     f"{rep['held_bytes'] / rep['budget_bytes']:.2f}x the budget of "
                     f"{fmt_bytes(rep['budget_bytes'])}"
                     + (" (what the plan itself keeps is over it)" if over else ""))
        if rep.get("borrowed") and not low:
            self._say_capped("run", f"{text}. The plan was made at other shapes: the guard "
                             "holds it to the budget at these (model.forward.__slackswap__"
                             ".last_report has each call's figures)")
            return rep
        self._say_capped("run", f"{text}. The run took another path than the profiled trace "
                         "(other shapes, routing, device or dtype, or a library that branches "
                         "otherwise under fake tensors than in eager): re-profile at these "
                         "shapes on this device for the whole plan; see docs/training.md, 'When "
                         "the run departs from the plan' (model.forward.__slackswap__"
                         ".last_report has each call's figures)")
        return rep

    def _say_capped(self, kind: str, text: str) -> None:
        """A note on stderr for the first `SAY_MAX` signatures of a kind, then one line saying
        that later ones are not printed (dynamic padding meets hundreds of shapes)."""
        import sys
        n = self.said_count.get(kind, 0)
        self.said_count[kind] = n + 1
        if n < SAY_MAX:
            print(f"slackswap: {text}", file=sys.stderr)
        elif n == SAY_MAX:
            print(f"slackswap: ({kind} notes for further input signatures are not printed; "
                  "model.forward.__slackswap__.last_report has each call's figures)",
                  file=sys.stderr)


def patch(model: torch.nn.Module, meta: dict, table: dict, *, replan: bool = True,
          strict: bool = False) -> torch.nn.Module:
    """Patch `model` in place to run `table`'s plan in training; returns `model`.

    `replan`: on input shapes other than the profiled ones, borrow the plan of other shapes
    without a trace (the guard holds it to the plan's fraction of the keep-all bytes there),
    and where it does not line up, or on another device or dtype, trace the model at those
    shapes with fake tensors and plan for them (same planner, hardware and budget fraction),
    once per shape; with False the profiled plan is used (and lines up where it can). `strict`: refuse
    (FingerprintMismatch) any call at shapes or on a device other than the profiled ones."""
    check_generated(meta)
    inner = _unwrap(model)
    if inner is not model:
        patch(inner, meta, table, replan=replan, strict=strict)   # the wrapper calls it
        return model
    if is_patched(model):
        raise _error("this model is already patched by slackswap",
                     "call slackswap's unpatch(model) first to patch it with another plan")
    had = "forward" in model.__dict__
    state = _Patched(model, meta, table, model.forward if had else None, had, replan=replan,
                     strict=strict)
    model.forward = _PatchedForward(state)
    return model


class _PatchedForward:
    """The patched model's `forward` (an instance attribute). A deep copy of the model
    (`copy.deepcopy`, `AveragedModel`, an EMA helper) gets a patch of its own, for its own
    parameters; pickling the whole model (`torch.save(model)`) stores the patch's plans and
    patches the loaded model the same way. `inspect.signature` sees the model's own forward."""

    def __init__(self, state: _Patched):
        self.__slackswap__ = state

    def __call__(self, *args, **kwargs):
        return self.__slackswap__.forward(*args, **kwargs)

    @property
    def __wrapped__(self):
        return self.__slackswap__.original_forward

    def __deepcopy__(self, memo):
        state = self.__slackswap__
        model = memo.get(id(state.model))
        if model is None:                   # the forward copied alone: it is the model's
            return self
        return _PatchedForward(state.copy_for(model, memo))

    def __reduce__(self):
        st = self.__slackswap__
        return (_repatch, (st.model, st.meta, st.table, st._forward, st.had_instance_forward,
                           st.replan, st.strict))


def _repatch(model, meta, table, forward, had, replan, strict) -> _PatchedForward:
    """Unpickling a patched model: the same patch on the loaded one."""
    return _PatchedForward(_Patched(model, meta, table, forward, had, replan, strict))


def _unwrap(model):
    """The model a DDP wrapper holds (its forward calls it); a compiled model is refused."""
    if type(model).__name__ == "OptimizedModule":
        raise _error("this model is compiled with torch.compile; slackswap patches the eager "
                     "model", "call patch(model) before torch.compile(model), or train uncompiled")
    from torch.nn.parallel import DistributedDataParallel
    if isinstance(model, (DistributedDataParallel, torch.nn.DataParallel)):
        return model.module
    return model


def unpatch(model: torch.nn.Module) -> torch.nn.Module:
    """Undo `patch`: the model's forward is its own again."""
    inner = _unwrap(model)
    if inner is not model:
        unpatch(inner)
        return model
    state = getattr(model.__dict__.get("forward"), "__slackswap__", None)
    if state is None:
        raise _error("this model is not patched by slackswap", "nothing to undo")
    state.remove_hooks()
    if state.had_instance_forward:
        model.forward = state.original_forward
    else:
        del model.forward
    return model


def is_patched(model: torch.nn.Module) -> bool:
    return getattr(model.__dict__.get("forward"), "__slackswap__", None) is not None


def _first_guess(plan: _Table, old: tuple, new: tuple) -> tuple[float, float] | None:
    """For a call at signature `new` recorded on `plan`, made at `old`, before any call ran on
    it: (the plan's fraction of the keep-all bytes, as its profile saved them at `old`; the
    factor those bytes are guessed to grow by at `new`). The guess is the lower of two
    `guard.Scale` predictions, each saved shape's (`saved_by_shape`: it over-predicts where a
    dimension equals a changed size by chance, a head dimension of 16 at length 16) and the
    largest input's (it under-predicts tensors quadratic in the length, such as attention
    scores, where the length grows). The lower one, because the guard holds the call to the
    guessed limit and what it holds is judged against the limit the call settles (the plan's
    fraction of what it saved): a guess too high would let it hold more. None:
    the plan has no limit or its table no saved bytes (written before it named them)."""
    by_shape = plan.table.get("saved_by_shape")
    made_at = sum(b for _, b in by_shape) if by_shape else 0
    if not made_at or plan.limit is None or plan.borrowed:
        return None
    shapes = [shape for shape, _ in old[2:]]
    scale = Scale(shapes, [shape for shape, _ in new[2:]])
    per_shape = sum(b * scale.ratio(tuple(shape)) for shape, b in by_shape) / made_at
    big = scale.ratio(max(shapes, key=math.prod, default=()))
    return plan.limit / made_at, min(per_shape, big)


def _alike(a: tuple, b: tuple) -> bool:
    """Do signatures `a` and `b` differ only in their shapes (device, parameter dtype, each
    input's dtype and rank the same)?"""
    return a[:2] == b[:2] and len(a) == len(b) and all(
        x[1] == y[1] and len(x[0]) == len(y[0]) for x, y in zip(a[2:], b[2:]))


def _shapes(sig: tuple) -> str:
    return ", ".join("x".join(map(str, shape)) or "scalar" for shape, _ in sig[2:]) \
        + f" on {sig[0]}, {sig[1]} parameters"


def _brief(exc: BaseException) -> str:
    """An exception as one line of a note: its type and its message's first line."""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"


def _error(message: str, hint: str):
    from ..errors import InputError
    return InputError(message, hint=hint)
