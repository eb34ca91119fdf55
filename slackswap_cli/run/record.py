"""The first call at a signature of a patched model: its forward recorded, its backward replayed.

`patch(model, meta, table)` replaces `model.forward` (an instance attribute, so `unpatch`
restores the class's) with a wrapper. In eval mode or with grad disabled the wrapper calls the
original forward and does nothing else. In training it runs the original forward under two
things:

- **a recorder** (a `TorchDispatchMode`): every aten op the model's forward bodies run is
  recorded (its function, its arguments with produced tensors replaced by references, weak
  references to its outputs and their versions) and aligned with the profile's forward ops
  (`table["ops"]`, from `chains.runtime_table`): an op matches the next expected op, within a
  bounded window, with the same target, first output shape and module path that reads
  activations when the profile's does and no profile value it does not. Ops in module hooks
  (FSDP2's unshard and reshard, a wrapper's casts) are not recorded, except a hook's view of a
  recorded value; ops the profile does not have (a mask built another way in eager) stay
  unplanned.
- **saved-tensor hooks**: when autograd saves a tensor for backward, the plan's action for its
  storage root decides what autograd holds instead. *keep*: the tensor. *swap*: a handle to a
  host copy of the tensor's whole storage (`swap.offload`, on a side stream on CUDA), one
  per storage, brought back once (`swap.prefetch`/`wait`) and shared by every view saved of
  it; copies back are issued ahead of need as backward progresses (the plan's prefetch
  points). A root that an in-place op still has to write is kept, not copied. *recompute*: a
  reference; on first use in backward the ops the root needs of its chain (`table["chains"]`,
  `chains.lay_out`'s: the simulator's) are replayed from the records, chains laid out earlier
  first, and the roots they make stay until autograd and later chains have taken them.

Correctness never depends on the alignment being right: a replay runs the very functions and
arguments the forward ran, on the same values (kept tensors are held, swapped ones come back
bit for bit, views are re-derived), under `no_grad` with autocast off (the recorded ops already
carry every cast), with side-effect writes (BatchNorm statistics) sent to copies. A root is
recomputed only when every op it depends on was matched, reads the roots the profile says and
is not random; otherwise it is kept as eager autograd keeps it.

Each input signature (device type, shapes and dtypes) gets its own plan: the profiled one, or
one made on the fly (`run/replan.py`), or, with `strict`, a refusal. Memory follows the plan
as far as the alignment holds; `verify` measures it.

The parts, one job each: the line-up (run/lineup.py, `LineUp`), what the recorder keeps of each
op (run/recorded.py), the pack side (run/packing.py), the unpack side and chains run
(run/unpacking.py), re-running recorded ops (run/rerun.py); `PlanRun` holds one call's state
and the recorder, and is those parts.

All of the above runs on the first call at a signature (`PlanRun`). Later calls at it run the
steady state (`run/steady.py`, whose `SteadyRun` extends `PlanRun`): the first call's decisions
followed pack by pack on saved-tensor hooks alone, no recorder, no module hooks. `patch` itself
(`run/inplace.py`) decides which of the two a call runs.
"""
from __future__ import annotations

import weakref

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakTensorKeyDictionary

from ..guard import Guard
from ..schema import Action
from ..trace.aten import written_returns
from ..trace.storage import storage_id
from . import dtensor, swap
from .lineup import ALIGN_WARN, LineUp, trace_only_ops
from .packing import Packing
from .recorded import STATE, ExtRef, OpRecord, OutRef, alias_flags
from .rerun import Rerun
from .unpacking import Unpacking

__all__ = ["PlanRun", "STATE", "ALIGN_WARN", "trace_only_ops", "Recorder"]

_LOCAL_SCALAR = torch.ops.aten._local_scalar_dense.default   # a value Python reads
_WAIT = torch.ops._c10d_functional.wait_tensor.default        # (tensor parallel: run/dtensor.py)


class PlanRun(Packing, Unpacking, Rerun):
    """One training step's recorded forward and the state its backward needs: the recorder's
    records and the line-up (`record`), and the parts that carry the plan out on them (see the
    module docstring)."""
    noting = True       # note what each chain reads (for a steady-state template)
    recorded = True     # (a first call: recorded op by op)

    def __init__(self, patched, plan):
        """`patched`: the model's `inplace._Patched`; `plan`: its `signatures.PlanTable` for this
        call's signature."""
        self.p = patched
        self.t = plan
        t = plan.table
        self.table = t
        self.records: list[OpRecord] = []
        self.reads_act: list[bool] = []            # per record: does it read activations?
        self.where = WeakTensorKeyDictionary()     # produced tensor -> (record, output)
        self.rec_of_op: dict[int, int] = {}        # profile op id -> record
        self.tid_of: dict[tuple[int, int], int] = {}
        self.loc_of_tid: dict[int, tuple[int, int]] = {}
        self.pinned: dict[int, torch.Tensor] = {}   # root -> tensor held for a chain
        self.by_storage: dict[tuple, swap.StorageCopy] = {}  # storage key -> its copy (this
        #                                                      forward)
        self.root_swap: dict[int, swap.StorageCopy] = {}   # swapped root -> its storage's copy
        self.swaps: list[swap.StorageCopy] = []
        self.made: dict[int, torch.Tensor] = {}     # recompute root -> tensor a chain made
        self.chain_uses = dict(plan.chain_uses)     # root -> chains still to read it
        self.metas: dict[int, tuple] = {}          # swapped root -> how to view its bytes
        self.root_storage: dict[int, tuple] = {}   # swapped root -> (storage key, weak ref)
        self.packs: dict[int, int] = {}            # root -> saved references not yet unpacked
        self.usable: dict[int, bool] = {}         # recompute root -> its chain verified
        self.deferred: dict[int, set[int]] = {}     # chain -> roots autograd let go of
        self.done_chains: set[int] = set()
        self.progress = t["n_forward"]
        self.prefetch_order = sorted(t["prefetch_at"], key=lambda r: (t["prefetch_at"][r], r))
        self.next_prefetch = 0
        self.rerun_ops = 0
        self.device = None
        self.recording = True       # off while a hook of ours runs (its copies are not the model's)
        self.lineup = LineUp(t["ops"], patched.names, plan.borrowed)
        self.inputs: set[int] = set()              # ids of the call's own tensors (held)
        self.kept_refs: list = []                  # what autograd holds as it is (weak)
        self.kept_alias: dict = {}                 # output loc -> weak ref to what it holds
        self.external = swap.Storages()            # storages the forward read but did not make
        self.call_inputs: list = []                # the call's own tensors, in order
        # for a steady-state template (`steady.Template`): each pack's decision, in order, and the
        # values each chain read that were alive (held by autograd or pinned) when it ran
        self.seq: list[tuple] = []
        self.live_reads: dict[int, set] = {}
        self.chain = None                          # the chain replaying now
        self.bound: dict[tuple[int, int], torch.Tensor] = {}   # steady state: loc -> value
        self.guard = Guard(plan.limit)              # what the plan cannot place (`guard.py`)
        # what a keep-all run would hold: each storage this forward made that autograd saved,
        # once (a plan at other shapes is scaled by it: `shape_run.py`)
        self.saved_keys = swap.Storages()
        self.saved_bytes = 0
        self.values: list = []      # values Python read of tensors, in order (`branches.py`)

    # -- forward: recording and alignment ------------------------------------------------
    def record(self, func, args, kwargs, out, alias: bool = False) -> None:
        """Record one aten call of the forward. `alias`: a wrapper hook's view of a recorded
        value (FSDP2 views a block's input): not the model's op, but the same value to it."""
        k = len(self.records)
        leaves, _ = pytree.tree_flatten(out)
        outs = [weakref.ref(x) if isinstance(x, torch.Tensor) else None for x in leaves]
        # an in-place op's output has its version bumped after this mode returns (by the
        # ADInplaceOrView kernel above it): record the version it will have
        bump = written_returns(func)
        versions = [x._version + (j in bump) if isinstance(x, torch.Tensor) else 0
                    for j, x in enumerate(leaves)]
        in_locs = []

        def ref(x):
            if isinstance(x, torch.Tensor):
                loc = self.where.get(x)
                if loc is not None:
                    in_locs.append(loc)
                    return OutRef(*loc)
                if x.device.type != "meta":
                    self.external.add(x)      # a parameter, buffer, input or a hook's value
                if not isinstance(x, torch.nn.Parameter) and id(x) not in self.inputs \
                        and id(x) not in self.p.buffer_ids:
                    return ExtRef(x)     # held weakly: a replay may not rely on it
            return x
        rargs = pytree.tree_map(ref, args)
        rkwargs = pytree.tree_map(ref, kwargs)
        # does it read activations (values the forward computed from its inputs), as opposed
        # to parameters only (a wrapper's all-gather and views of weights)?
        reads_act = any(self._activation(loc) for loc in in_locs)
        known = {t for t in (self.tid_of.get(loc) for loc in in_locs)
                 if t is not None and self.root(t) not in self.t.non_activation}
        op = None if alias else self.lineup.align(func, leaves, reads_act, known)
        self.records.append(OpRecord(func, rargs, rkwargs, outs, versions, op, in_locs))
        self.reads_act.append(reads_act)
        for j, x in enumerate(leaves):
            if isinstance(x, torch.Tensor):
                if self.device is None and x.device.type != "meta":
                    self.device = x.device
                self.where[x] = (k, j)       # an in-place op's output: its newest value
        if alias and in_locs and in_locs[0] in self.tid_of and leaves \
                and isinstance(leaves[0], torch.Tensor):
            self.tid_of[(k, 0)] = self.tid_of[in_locs[0]]
        if op is not None:
            self.rec_of_op[op] = k
            tids = self.table["ops"][op].outputs
            for j, tid in enumerate(tids):
                if j < len(leaves) and isinstance(leaves[j], torch.Tensor):
                    self.tid_of[(k, j)] = tid
                    self.loc_of_tid[tid] = (k, j)
                    r = self.root(tid)
                    if r == tid and r in self.t.pin_roots:     # (an alias: see `_kept`)
                        self.pinned[r] = leaves[j].detach()
                        self._count(leaves[j])
                    if r == tid and self.table["action"].get(r) == Action.SWAP:
                        x = leaves[j]
                        self.metas[r] = (x.dtype, tuple(x.shape), tuple(x.stride()),
                                         x.storage_offset())
                        self.root_storage[r] = storage_id(x)

    def _activation(self, loc: tuple[int, int]) -> bool:
        tid = self.tid_of.get(loc)
        if tid is not None:
            return self.root(tid) not in self.t.non_activation
        return self.reads_act[loc[0]]

    def report(self) -> dict:
        """What this call did, for `model.forward.__slackswap__.last_report` and `verify`:
        `alignment()`'s figures (a later call that follows the first one's template reports
        the first one's; `recorded`: this call was recorded; `left_template`: a later call
        whose saved tensors stopped matching the template; `borrowed`: the plan was made at
        other shapes, `shape_run.py`), the guard's swaps (count and
        bytes), the bytes held for
        backward as counted in forward (`guard.py`'s count: kept storages, planned or not)
        against the plan's budget (None: the plan has none)."""
        swaps, swapped = self.guarded()
        return {**self.alignment(), "recorded": self.recorded,
                "left_template": bool(getattr(self, "broken", False)),
                "borrowed": self.t.borrowed,
                "guard_swaps": swaps, "guard_swapped_bytes": swapped,
                "held_bytes": self.held_at_end(), "budget_bytes": self.t.limit}

    def guarded(self) -> tuple[int, int]:
        """(saved tensors, bytes) the guard swapped in this call."""
        return self.guard.swaps, self.guard.swapped_bytes

    def held_at_end(self) -> int:
        """The guard's count of bytes held for backward, as forward left it."""
        return self.guard.held

    def alignment(self) -> dict:
        """How this call lined up with the profile (`LineUp.alignment`)."""
        return self.lineup.alignment(self.rec_of_op, self.t.trace_only)

    def root(self, tid: int) -> int:
        return self.table["root"].get(tid, tid)


class Recorder(TorchDispatchMode):
    """The mode a recorded call runs under: each aten op of a module's forward body is
    recorded (`PlanRun.record`); a value Python reads is noted (`PlanRun.values`)."""

    def __init__(self, run: PlanRun):
        super().__init__()
        self.run = run
        self.tp = dtensor.uses_dtensor(run.p.model)     # tensor parallel: run/dtensor.py

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.tp and dtensor.distributed_wrapper(types):
            if dtensor.takes_dtensor(types):
                return NotImplemented    # DTensor's dispatch runs it: its local ops come here
            args, kwargs = dtensor.waited(args, kwargs, self._wait)
        out = func(*args, **kwargs)
        run = self.run
        if func is _LOCAL_SCALAR:        # a Python value, not an op of the step's graph
            if run.recording:
                run.values.append(out)
            return out
        if run.recording:
            if run.lineup.in_body():
                run.record(func, args, kwargs, out)
            elif alias_flags(func)[0] and args and isinstance(args[0], torch.Tensor) \
                    and args[0] in run.where:
                run.record(func, args, kwargs, out, alias=True)   # a hook's view of a value
        return out

    def _wait(self, x: torch.Tensor) -> None:
        self.__torch_dispatch__(_WAIT, (), (x,), {})       # recorded as any op

