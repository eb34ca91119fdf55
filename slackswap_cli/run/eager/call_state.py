"""One training call's state, for every kind of call of a patched model: one object, one constructor.

A call of `patch(model)` in training is one of four kinds, each a small policy object (what it
does at each saved-tensor pack, and after forward) over this state:

- the first call at a signature (run/eager/first_call.py, `FirstCall`): recorded op by op, lined up
  with the profile, each pack decided and noted;
- a later call at it (run/eager/steady_call.py, `SteadyCall`; `KeepAllCall` for a keep-all plan): the
  first call's template followed pack by pack, hooks alone;
- the first call at new shapes (run/eager/new_shape.py, `NewShapeCall`): another shape's template
  followed, held to the budget at these shapes by the guard.

`CallPolicy` declares what the four share and all the patched forward (run/eager/inplace.py)
reads of them: the state `s`, the `kind`, `pack` and `finish`.

What they share are plain functions over this state: what autograd holds for a kept or swapped
tensor and the guard's decision for one the plan cannot place (run/eager/holding.py), and the one
backward path (run/eager/backward.py: saved tensors handed back, prefetches, chains replayed).
`CallState` declares every field once (`__slots__`); a call that follows a template (`tpl`)
takes the line-up and records from it, a recorded one starts them empty.
"""
from __future__ import annotations

from typing import Any, Callable, ClassVar, Protocol

import torch
from torch.utils.weak import WeakTensorKeyDictionary

from ...guard import Guard
from ..swap import Storages
from .holding import held_device_bytes
from .lineup import LineUp

__all__ = ["CallState", "CallPolicy"]


class CallPolicy(Protocol):
    """The interface of a call kind (`FirstCall`, `SteadyCall`, `KeepAllCall`, `NewShapeCall`):

    - `s`: the call's `CallState`;
    - `kind`: its name (`CallState.kind`, what `last_run.kind` and the reports say);
    - `pack(x)`: the saved-tensor hook's pack, what autograd holds for `x` instead; None where
      no hook needs to run (a keep-all plan's later call, not measuring);
    - `finish()`: after forward; True when every pack lined up (the template holds), False
      when the call left it (the next call at the signature records again)."""
    __slots__ = ()
    s: CallState
    kind: ClassVar[str]
    pack: Callable[[torch.Tensor], Any] | None

    def finish(self) -> bool: ...


class CallState:
    """The state of one training call (see the module docstring). `kind`: its policy's name
    ("first", "steady", "keep_all", "new_shape"); `p`: the model's `inplace._Patched`; `t`:
    its `signatures.PlanTable` for this call (`table`: its `tables.RunTable`); `tpl`: the
    `templates.Template` followed (None: recorded)."""
    __slots__ = (
        "kind", "p", "t", "table", "tpl", "recorded", "measuring",
        # the records and the line-up (a recorded call's own; a template's otherwise)
        "records", "reads_act", "rec_of_op", "tid_of", "loc_of_tid", "usable", "metas",
        "device", "lineup", "prefetch_order",
        # recording (a first call only)
        "where", "root_storage", "recording", "inputs", "kept_alias", "values", "live_reads",
        "seq", "read_version",
        # what this call holds for backward
        "pinned", "by_storage", "root_swap", "swaps", "made", "chain_uses", "packs",
        "deferred", "done_chains", "kept_refs", "external", "call_inputs",
        # backward's progress
        "progress", "next_prefetch", "rerun_ops", "chain",
        # following a template: the pack counter, values handed over to chains
        "n", "i", "broken", "bound", "bound_version", "bound_uses",
        # a later backward through a retained graph: values handed over, then let go of
        # (weakly: autograd's, while it holds them); making values again (`backward.remake`)
        "gone", "again",
        # the guard's count and what a keep-all run holds (`guard.py`)
        "guard", "followed", "saved_keys", "saved_bytes",
        # a call recorded again at a signature it had recorded on the same plan: why
        "not_steady", "__weakref__")

    def __init__(self, kind: str, patched, plan, tpl=None, inputs: list = ()):
        self.kind, self.p, self.t, self.table, self.tpl = kind, patched, plan, plan.table, tpl
        self.recorded = tpl is None
        self.not_steady: str | None = None
        self.measuring = True if tpl is None else patched.measure_held
        self.call_inputs = list(inputs)
        self.pinned: dict[int, torch.Tensor] = {}   # root -> tensor held for a chain
        self.by_storage: dict = {}                  # storage key -> its copy (this forward)
        self.root_swap: dict = {}                   # swapped root -> its storage's copy
        self.swaps: list = []
        self.made: dict[int, torch.Tensor] = {}     # recompute root -> tensor a chain made
        self.chain_uses = plan.chain_uses.copy()    # root -> chains still to read it
        self.packs: dict[int, int] = {}             # root -> saved references not unpacked
        self.deferred: dict[int, set[int]] = {}     # chain -> roots autograd let go of
        self.done_chains: set[int] = set()
        self.kept_refs: list = []                   # what autograd holds as it is (weak)
        self.progress, self.next_prefetch = self.table.n_forward, 0
        self.rerun_ops = 0
        self.chain = None                           # the chain replaying now
        self.i, self.broken = 0, False
        self.bound: dict = {}                       # a followed call: loc -> handed-over value
        self.bound_version: dict = {}               # loc -> its version when handed over
        self.gone: dict = {}                        # loc -> weak ref to a let-go handed-over value
        self.again = False
        self.saved_keys, self.saved_bytes = Storages(), 0
        self.kept_alias: dict = {}                  # output loc -> weak ref to what it holds
        if tpl is None:
            self._recorded(patched, plan)
        else:
            self._followed(tpl)

    def _recorded(self, patched, plan) -> None:
        """A recorded call's own records and line-up, empty (`first_call.record` fills them)."""
        t = self.table
        self.records, self.reads_act = [], []       # per record: does it read activations?
        self.where = WeakTensorKeyDictionary()      # produced tensor -> (record, output)
        self.read_version: dict = {}    # output loc -> its version at its last read, where a
        # write through another alias changed it after production (`first_call.record`)
        self.rec_of_op: dict[int, int] = {}         # profile op id -> record
        self.tid_of: dict[tuple[int, int], int] = {}
        self.loc_of_tid: dict[int, tuple[int, int]] = {}
        self.usable: dict[int, bool] = {}           # recompute root -> its chain verified
        self.metas: dict[int, tuple] = {}           # swapped root -> how to view its bytes
        self.root_storage: dict[int, tuple] = {}    # swapped root -> (storage key, weak ref)
        self.device = None
        self.lineup = LineUp(t.ops, patched.names, plan.borrowed)
        self.prefetch_order = sorted(t.prefetch_at, key=lambda r: (t.prefetch_at[r], r))
        self.recording = True       # off while a hook of ours runs (its copies are not the model's)
        self.inputs = {id(x) for x in self.call_inputs}   # the call's own tensors (held)
        self.external = Storages()                  # storages the forward read, did not make
        self.values: list = []      # values Python read of tensors, in order (`branches.py`)
        # for a steady-state template (`templates.Template`): each pack's note, in order, and
        # the values each chain read that were alive (held by autograd or pinned) when it ran
        self.seq: list = []
        self.live_reads: dict[int, set] = {}
        self.n, self.bound_uses = 0, {}
        self.guard = Guard(plan.limit)              # what the plan cannot place (`guard.py`)
        self.followed = (0, 0)

    def _followed(self, tpl) -> None:
        """A call that follows template `tpl`: its records and line-up are the template's."""
        self.records, self.reads_act, self.rec_of_op = tpl.records, tpl.reads_act, tpl.rec_of_op
        self.tid_of, self.loc_of_tid, self.usable = tpl.tid_of, tpl.loc_of_tid, tpl.usable
        self.metas, self.device, self.lineup = tpl.metas, tpl.device, tpl.lineup
        self.prefetch_order = tpl.prefetch_order
        self.where = self.root_storage = self.inputs = self.live_reads = None
        self.read_version = None
        self.recording, self.values = False, []
        self.external = None                        # (made on first use: `externals`)
        self.seq = tpl.seq if self.measuring else tpl.seq_quiet
        self.n, self.bound_uses = tpl.n, tpl.uses.copy()
        self.guard = None              # counting starts where a call leaves the template
        self.followed = tpl.guarded    # the first call's guard swaps, followed

    def externals(self) -> Storages:
        """Storages the forward read but did not make (parameters, buffers, inputs, a hook's
        values): a followed call's are the template's and this call's inputs."""
        got = self.external
        if got is None:
            got = self.external = self.tpl.external.with_tensors(self.call_inputs)
        return got

    def root(self, tid: int) -> int:
        return self.table.root.get(tid, tid)

    def held_device_bytes(self) -> int:
        """Activation bytes this call holds on the device for backward right now
        (`holding.held_device_bytes`)."""
        return held_device_bytes(self)

    def guarded(self) -> tuple[int, int]:
        """(saved tensors, bytes) the guard swapped in this call: the ones it followed of
        the first call's, then its own."""
        swaps, swapped = self.followed
        if self.guard is not None:
            return swaps + self.guard.swaps, swapped + self.guard.swapped_bytes
        return swaps, swapped

    def held_at_end(self) -> int:
        """The guard's count of bytes held for backward, as forward left it."""
        return self.tpl.held_at[-1] if self.guard is None else self.guard.held

    def alignment(self) -> dict:
        """How this call lined up with the profile (`LineUp.alignment`)."""
        return self.lineup.alignment(self.rec_of_op, self.t.trace_only)

    def report(self) -> dict:
        """What this call did, for `model.forward.__slackswap__.last_report` and `verify`:
        `alignment()`'s figures (a call that follows a template reports the first call's;
        `recorded`: this call was recorded; `left_template`: a followed call whose saved
        tensors stopped matching the template; `borrowed`: the plan was made at other shapes,
        `new_shape.py`), the guard's swaps (count and bytes), the bytes held for backward as
        counted in forward (`guard.py`'s count: kept storages, planned or not) against the
        plan's budget (None: the plan has none); `not_steady`: a recorded call that was not
        meant to be (the signature had recorded on this plan before), why."""
        swaps, swapped = self.guarded()
        return {**self.alignment(), "recorded": self.recorded, "left_template": self.broken,
                "not_steady": self.not_steady,
                "borrowed": self.t.borrowed,
                "guard_swaps": swaps, "guard_swapped_bytes": swapped,
                "held_bytes": self.held_at_end(), "budget_bytes": self.t.limit}
