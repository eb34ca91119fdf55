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

All of the above runs on the first call at a signature (`PlanRun`). Later calls at it run the
steady state (`run/steady.py`, whose `SteadyRun` extends `PlanRun`): the first call's decisions
followed pack by pack on saved-tensor hooks alone, no recorder, no module hooks. `patch` itself
(`run/inplace.py`) decides which of the two a call runs.
"""
from __future__ import annotations

import functools
import threading
import weakref

import torch
import torch.utils._pytree as pytree
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakTensorKeyDictionary

from ..guard import Guard
from ..schema import Action
from ..trace.aten import (
    aliases_input,
    is_view_target,
    writes_first,
    written_positions,
    written_returns,
)
from . import swap

__all__ = ["PlanRun"]

WINDOW = 256            # how far ahead an op may match an expected op
ALIGN_WARN = 0.99       # say so when fewer of the profile's forward ops than this line up
# ops a trace has that eager never runs: make_fx writes a `detach` of each value autograd
# saves of an op's output; eager's autograd saves it without an op. Not counted as missed.
TRACE_ONLY = frozenset({"aten.detach.default"})
# the name eager runs an op under -> the name the profile's trace gives it
_TRACED_AS = {"aten.lift_fresh.default": "aten.lift_fresh_copy.default"}
_STATE = threading.local()
_LOCAL_SCALAR = torch.ops.aten._local_scalar_dense.default   # a value Python reads


def _is_random(rec: "_Record") -> bool:
    from ..trace.costs import is_random_call
    return is_random_call(rec.func, rec.args, rec.kwargs)


def trace_only_ops(ops: list) -> frozenset[int]:
    """The positions of the profile's forward ops (`table["ops"]`) that eager does not run as
    ops: make_fx's `detach` of each saved output (`TRACE_ONLY`), and a view no later forward op
    reads (autograd re-creating a view after an in-place write to it, which a trace replays
    as an op and eager does inside the autograd node)."""
    read = {t for o in ops for t in o.acts}
    only = set()
    for i, o in enumerate(ops):
        if o.target in TRACE_ONLY or (is_view_target(o.target)
                                      and not any(t in read for t in o.outputs)):
            only.add(i)
    return frozenset(only)


class _Ref:
    """A tensor argument produced by recorded op `rec`, output `out` (`loc`: both)."""
    __slots__ = ("rec", "out", "loc")

    def __init__(self, rec: int, out: int):
        self.rec, self.out, self.loc = rec, out, (rec, out)


class _Ext:
    """A tensor argument from outside the recorded forward that is neither a parameter nor
    one of the call's inputs (a wrapper's view of a block's input, say): held weakly."""
    __slots__ = ("ref",)

    def __init__(self, x: torch.Tensor):
        self.ref = weakref.ref(x)


class _In:
    """A tensor argument that is the call's own input number `i` (in a steady-state template,
    where each call brings its own inputs)."""
    __slots__ = ("i",)

    def __init__(self, i: int):
        self.i = i


@functools.lru_cache(maxsize=None)
def _alias_flags(func) -> tuple[bool, bool]:
    """(a view or in-place op, an in-place op writing its first argument): read from the
    schema once per op (building `schema.returns` costs microseconds a call)."""
    return aliases_input(func), writes_first(func)


class _Record:
    __slots__ = ("func", "args", "kwargs", "outs", "versions", "op", "in_locs", "prep",
                 "alias", "wfirst", "geom")

    def __init__(self, func, args, kwargs, outs, versions, op, in_locs):
        self.func, self.args, self.kwargs = func, args, kwargs
        self.outs, self.versions, self.op, self.in_locs = outs, versions, op, in_locs
        self.prep = None
        self.alias, self.wfirst = _alias_flags(func)
        self.geom = None        # a view: None (not replayed yet), False, or `_view_geometry`


def _prepare(rec: _Record) -> tuple:
    """What replaying `rec` needs, worked out once: the flat arguments, their structure (None
    for a flat call), the positions to resolve, the positions of side-effect writes, the
    number of positional arguments and the keyword names."""
    marker = (_Ref, _Ext, _In)
    if _is_random(rec):
        raise RuntimeError(f"slackswap: a recompute chain would re-run the random op "
                           f"{rec.func}; this is a bug in slackswap, please report it")
    top = [*rec.args, *rec.kwargs.values()]
    if any(isinstance(a, (list, tuple, dict)) and
           any(isinstance(x, marker) for x in pytree.tree_leaves(a, is_leaf=lambda y: isinstance(y, marker)))
           for a in top):     # (a list of sizes is one argument; a list of tensors is not)
        flat, spec = pytree.tree_flatten((rec.args, rec.kwargs),
                                         is_leaf=lambda a: isinstance(a, marker))
    else:
        flat, spec = top, None
    todo = tuple(i for i, a in enumerate(flat) if isinstance(a, marker))
    written = tuple(written_positions(rec.func, list(rec.args),
                                      lambda a: isinstance(a, (torch.Tensor, *marker))))
    rec.prep = (tuple(flat), spec, todo, written, len(rec.args), tuple(rec.kwargs))
    return rec.prep


class PlanRun:
    """One training step's recorded forward and the state its backward needs."""
    noting = True       # note what each chain reads (for a steady-state template)
    recorded = True     # (a first call: recorded op by op)

    def __init__(self, patched, plan):
        """`patched`: the model's `inplace._Patched`; `plan`: its `inplace._Table` for this
        call's signature."""
        self.p = patched
        self.t = plan
        t = plan.table
        self.table = t
        self.records: list[_Record] = []
        self.reads_act: list[bool] = []            # per record: does it read activations?
        self.where = WeakTensorKeyDictionary()     # produced tensor -> (record, output)
        self.rec_of_op: dict[int, int] = {}        # profile op id -> record
        self.tid_of: dict[tuple[int, int], int] = {}
        self.loc_of_tid: dict[int, tuple[int, int]] = {}
        self.ptr = 0                               # next expected forward op
        self.unmatched = 0
        self.pinned: dict[int, torch.Tensor] = {}   # root -> tensor held for a chain
        self.by_storage: dict[tuple, _Swap] = {}     # storage key -> its swap (this forward)
        self.root_swap: dict[int, _Swap] = {}       # swapped root -> the swap of its storage
        self.swaps: list[_Swap] = []
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
        # [module path, in its forward body?, id of a module not the model's (else None)]
        self.modules: list[list] = [["", True, None]]
        self.inputs: set[int] = set()              # ids of the call's own tensors (held)
        self.kept_refs: list = []                  # what autograd holds as it is (weak)
        self.kept_alias: dict = {}                 # output loc -> weak ref to what it holds
        self.external = Storages()                  # storages the forward read but did not make
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
        self.saved_keys = Storages()
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
                    return _Ref(*loc)
                if x.device.type != "meta":
                    self.external.add(x)      # a parameter, buffer, input or a hook's value
                if not isinstance(x, torch.nn.Parameter) and id(x) not in self.inputs \
                        and id(x) not in self.p.buffer_ids:
                    return _Ext(x)     # held weakly: a replay may not rely on it
            return x
        rargs = pytree.tree_map(ref, args)
        rkwargs = pytree.tree_map(ref, kwargs)
        # does it read activations (values the forward computed from its inputs), as opposed
        # to parameters only (a wrapper's all-gather and views of weights)?
        reads_act = any(self._activation(loc) for loc in in_locs)
        known = {t for t in (self.tid_of.get(loc) for loc in in_locs)
                 if t is not None and self.root(t) not in self.t.non_activation}
        op = None if alias else self._align(func, leaves, reads_act, known)
        self.records.append(_Record(func, rargs, rkwargs, outs, versions, op, in_locs))
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
                        self.root_storage[r] = _storage_id(x)

    def _activation(self, loc: tuple[int, int]) -> bool:
        tid = self.tid_of.get(loc)
        if tid is not None:
            return self.root(tid) not in self.t.non_activation
        return self.reads_act[loc[0]]

    def _align(self, func, leaves, reads_act: bool, known: set) -> int | None:
        """The next expected op with this op's target, first output shape (its rank, for a
        plan borrowed from other shapes) and module, that
        reads activations exactly when this op does, and reads no profile value it does not
        (so an op of a wrapper's hook, such as FSDP2's views of gathered weights or of a
        block's input, cannot pass for a model's op)."""
        ops = self.table["ops"]
        name = str(func)
        name = _TRACED_AS.get(name, name)
        first = next((list(x.shape) for x in leaves if isinstance(x, torch.Tensor)), None)
        module = self.modules[-1][0]
        end = min(len(ops), self.ptr + WINDOW)
        ranks = self.t.borrowed       # a plan made at other shapes: the same ranks, not sizes
        if ranks and first is not None:
            first = len(first)
        for i in range(self.ptr, end):
            o = ops[i]
            shape = o.shapes[0] if o.shapes else None
            if ranks and shape is not None:
                shape = len(shape)
            if (o.target == name and o.module == module and shape == first
                    and o.reads_act == reads_act and known.issubset(o.acts)):
                self.ptr = i + 1
                return i
        self.unmatched += 1
        return None

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
        """How this call lined up with the profile: `lined_up` of the profile's `expected`
        forward ops matched an op of the run (its trace-only ops, `trace_only_ops`, count only
        when eager ran them too);
        `run_ops` ops of the run were recorded, `run_unmatched` of them matched none."""
        ops = self.table["ops"]
        lined = len(self.rec_of_op)
        expected = len(ops) - sum(1 for i in self.t.trace_only if i not in self.rec_of_op)
        return {"lined_up": lined, "expected": expected,
                "fraction": lined / expected if expected else 1.0,
                "run_ops": len(self.rec_of_op) + self.unmatched,
                "run_unmatched": self.unmatched}

    # Which module runs, as the profile's trace attributes ops (the innermost module), and
    # whether in its forward body or in its hooks: a global pre-hook (called before every
    # module's own pre-hooks) enters a module's hooks; our own pre-hook, kept last in each
    # module's pre-hooks, enters its body; our own forward hook, kept last, leaves it. Ops in
    # hooks (FSDP2's unshard and reshard, a wrapper's input casts) are not the model's: they
    # are not recorded, and their results are outside values to the ops that read them.
    def _enter(self, mod, args) -> None:
        name = self.p.names.get(id(mod))
        if name is None:
            # not one of the model's modules (a loss module made inside forward): it has no
            # hooks of ours, so its body is entered now and left by the global forward hook
            # (`_left`); the profile's trace attributes its ops to the module around it
            self.modules.append([self.modules[-1][0], self.modules[-1][1], id(mod)])
        else:
            self.modules.append([name, False, None])

    def _left(self, mod, args, out) -> None:
        if len(self.modules) > 1 and self.modules[-1][2] == id(mod):
            self.modules.pop()

    def _body(self) -> None:
        if len(self.modules) > 1:
            self.modules[-1][1] = True

    def _leave(self) -> None:
        if len(self.modules) > 1:
            self.modules.pop()

    def in_body(self) -> bool:
        return self.modules[-1][1]

    def root(self, tid: int) -> int:
        return self.table["root"].get(tid, tid)

    # -- pack ------------------------------------------------------------------------------
    def pack(self, x: torch.Tensor):
        self.recording = False
        try:
            return self._pack(x)
        finally:
            self.recording = True

    def _pack(self, x: torch.Tensor):
        loc = self.where.get(x)
        base = x._base
        # what a later call at these shapes checks and does at this pack (`steady.Template`)
        note = [x.shape, x.dtype, Action.KEEP, None, loc, loc is not None,
                None if base is None else self.where.get(base), None, type(x.grad_fn),
                self.guard.held, self._fresh(x, loc)]
        self.seq.append(note)
        tid = None if loc is None else self.tid_of.get(loc)
        if tid is None:       # not the profile's (or not made by this forward: not counted)
            return x.detach() if loc is None else self._unplaced(x, loc, note)
        r = self.root(tid)
        act = self.table["action"].get(r)
        if act is None and r not in self.table["bwd_use"] and r not in self.t.non_activation:
            # a value the profile's backward does not read but eager's autograd saves (a
            # node that saves more than the traced backward needs): not the plan's to place
            return self._unplaced(x, loc, note)
        if act == Action.SWAP and self.t.last_write.get(r, -1) >= self.ptr:
            # still to be written in place (a GRU cell's gates): a copy made now would miss
            # those writes, so it is kept as eager keeps it (and counted)
            return self._kept(x, loc)
        if act == Action.SWAP:
            mine = self.root_storage.get(r)
            note[2:4] = Action.SWAP, r
            note[7] = (mine is not None and mine[0] == swap.storage_key(x)
                       and not mine[1].expired())
            return self._swap(x, r, note[7])
        if act == Action.RECOMPUTE and self._usable(r) and self._known(loc):
            note[2:4] = Action.RECOMPUTE, r
            self.packs[r] = self.packs.get(r, 0) + 1
            self.deferred.setdefault(self.table["made_by"][r], set()).add(r)
            return [False, Action.RECOMPUTE, r, loc]
        if act == Action.RECOMPUTE or self.t.borrowed:
            # its chain did not line up, or a plan made at other shapes: the guard decides
            return self._unplaced(x, loc, note)
        return self._kept(x, loc)

    def _fresh(self, x: torch.Tensor, loc) -> int:
        """The bytes of `x`'s storage if this is the first time autograd saves it and this
        forward made it (parameters, buffers and inputs are not counted), else 0."""
        if loc is None or x.device.type == "meta":
            return 0
        key = swap.storage_key(x)
        if key in self.saved_keys or key in self.external:
            return 0
        self.saved_keys.add(x)
        n = swap.storage_bytes(x)
        self.saved_bytes += n
        return n

    def _unplaced(self, x: torch.Tensor, loc, note: list):
        """A saved tensor the plan cannot place: kept while the guard admits it, else swapped
        (`guard.py`'s rule); the note tells later calls at this signature which."""
        if x.device.type == "meta":
            return self._kept(x, loc)
        key = swap.storage_key(x)
        if key in self.external:           # a parameter, buffer or input: not held for it
            return x.detach()
        if self.guard.admit(key, swap.storage_bytes(x), self._reserve()):
            return self._kept(x, loc)
        note[2:4] = Action.SWAP, None
        note[7] = False
        return self._swap(x, None, False)

    def _reserve(self) -> int:
        """Bytes the plan keeps from the next expected op on (`keep_after`): room the guard
        leaves. (0 for a table written before it was kept, and after the last op.) A plan
        borrowed from other shapes has them per pack, as the first call at these shapes saw
        them (`pack_reserve`), or `keep_after` scaled."""
        t = self.t
        if t.pack_reserve is not None:
            return t.pack_reserve[min(len(self.seq), len(t.pack_reserve) - 1)]
        after = self.table.get("keep_after")
        return int(after[min(self.ptr, len(after) - 1)] * t.scale) if after else 0

    def _count(self, x: torch.Tensor) -> None:
        """Count a storage this forward holds for backward as planned (`Guard.hold`)."""
        guard = self.guard
        if guard is not None and x.device.type != "meta":
            key = swap.storage_key(x)
            if key not in self.external:
                guard.hold(key, swap.storage_bytes(x))

    def _kept(self, x: torch.Tensor, loc=None) -> torch.Tensor:
        """What autograd holds for a kept tensor: `x.detach()` (same storage, same version
        counter), never `x` itself. A node that saves its own output would hold that output,
        whose `grad_fn` is the node: a cycle through C++ that Python's collector cannot see,
        so a graph dropped without backward (a skipped step, an OOM retry) would keep every
        saved tensor alive for good. For the same reason, what a run holds for its chains
        (pinned roots, handed-over values, what a chain reads live) are such aliases: the
        graph holds the run (its unpack hook), so the run must not hold the graph. The weak
        references (for `held_device_bytes`, and for a chain that reads output `loc` while
        autograd holds it: `_live`) are to what autograd holds."""
        kept = x.detach()
        self._count(x)
        ref = weakref.ref(kept)
        self.kept_refs.append(ref)
        if loc is not None:
            self.kept_alias.setdefault(loc, ref)
        return kept

    def _swap(self, x: torch.Tensor, r: int, own: bool) -> list:
        """Pack `x` (root `r` or a view of it) as a host copy of its storage. `own`: x's
        storage is root r's own (so a chain reading r fetches this copy): found out on the
        first call, followed later."""
        # one copy per storage (a root and its views), found by the storage itself: an
        # address alone may be a new tensor's, once a swapped one's memory was freed
        key, ref = _storage_id(x)
        sw = self.by_storage.get(key)
        if sw is None or sw.ref.expired() or sw.version != x._version:
            # (a storage written since its copy, say a buffer filled step by step, is
            # copied again: a copy serves only the contents it saw)
            sw = self.by_storage[key] = _Swap(ref, swap.offload(_bytes_of(x)), x._version)
            self.swaps.append(sw)
        if own:
            self.root_swap[r] = sw
            held = self.pinned.pop(r, None)      # the host copy serves a chain that reads it
            if held is not None and self.guard is not None:
                self.guard.drop(key, swap.storage_bytes(held))
        sw.packs += 1
        self.packs[r] = self.packs.get(r, 0) + 1
        return [False, Action.SWAP, r, sw, x.dtype, tuple(x.shape), tuple(x.stride()),
                x.storage_offset()]

    def _usable(self, r: int) -> bool:
        """Every op root `r` depends on in its chain was matched, reads the roots the profile
        says it reads, and is not random: then replaying them gives what the forward computed.
        (They all ran before `r` was produced, so this is known when autograd saves `r`.)"""
        ok = self.usable.get(r)
        if ok is None:
            ok = r in self.table["made_by"]
            for p in self.table["needs"].get(r, ()) if ok else ():
                ok = self._op_ok(p)
                if not ok:
                    break
            self.usable[r] = ok
        return ok

    def _op_ok(self, p: int) -> bool:
        k = self.rec_of_op.get(p)
        if k is None:
            return False
        rec = self.records[k]
        if _is_random(rec) or not all(self._known(loc) for loc in rec.in_locs):
            return False               # random, or reads a value the profile does not know
        if any(isinstance(a, _Ext) for a in pytree.tree_leaves((rec.args, rec.kwargs))):
            return False               # reads an outside value nobody promises to keep
        got = {self.root(self.tid_of[loc]) for loc in rec.in_locs}
        return (got - self.t.non_activation) <= set(self.t.op_inputs.get(p, ()))

    def _known(self, loc: tuple[int, int]) -> bool:
        """Is `loc` a value of the profile, and, if a view or in-place alias, derived from one
        with the same storage root (so re-deriving it walks only known values)?"""
        tid = self.tid_of.get(loc)
        if tid is None:
            return False
        rec = self.records[loc[0]]
        if not rec.alias:
            return True
        src = rec.args[0] if rec.args else None
        if not isinstance(src, _Ref):
            return self.root(tid) in self.t.non_activation or not rec.in_locs
        return (self._known(src.loc)
                and self.root(self.tid_of[src.loc]) == self.root(tid))

    def held_device_bytes(self) -> int:
        """Activation bytes this step holds on the device for backward right now: storages of
        forward-produced tensors autograd holds as they are, plus what the plan holds (tensors
        kept for a chain, made by one, fetched back, or still being copied to the host).
        Parameters, buffers and inputs are not counted; each storage counts once."""
        seen, total = set(), 0
        tensors = [r() for r in self.kept_refs]
        tensors += [*self.pinned.values(), *self.made.values(), *self.bound.values(),
                    *(sw.dev for sw in self.swaps if sw.dev is not None)]
        for t in tensors:
            if t is None or t.device.type == "meta":
                continue
            key = swap.storage_key(t)
            if key not in seen and key not in self.external:
                seen.add(key)
                total += swap.storage_bytes(t)
        for sw in self.swaps:
            h = sw.handle
            if h is not None and h.d2h_done is not None and not h.d2h_done.query():
                total += h.nbytes
        return total

    # -- unpack ----------------------------------------------------------------------------
    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        if packed[0]:
            from ..errors import InputError
            raise InputError("a second backward through a step whose saved tensors slackswap "
                             "swapped or recomputed: they were handed to the first one "
                             "(backward(retain_graph=True) twice, or double backward)",
                             hint="run one backward per forward, or unpatch(model) for this "
                                  "step")
        packed[0] = True                      # a saved tensor is handed out once
        kind, r = packed[1], packed[2]
        first = self.table["bwd_use"].get(r)
        if first is not None and first > self.progress:
            self.progress = first
        self._issue_prefetches()
        if kind is Action.SWAP:
            _, _, _, sw, dtype, shape, stride, offset = packed
            out = _view_of(sw.fetch(), dtype, shape, stride, offset)
            sw.packs -= 1
            if sw.packs <= 0 and self.chain_uses.get(r, 0) <= 0:
                sw.dev = None                 # autograd holds what it took

        else:
            _, _, _, loc = packed
            owner = self.table["made_by"][r]
            if owner not in self.done_chains:
                # autograd unpacks a node's saved tensors in its own order: chains laid out
                # before this one (whose roots it may read) run first, as simulated
                for o in sorted(x for x in self.deferred if x < owner and x not in self.done_chains):
                    self._run_chain(o)
                self._run_chain(owner)
            out = self._resolve(loc, {})
        self._unpacked(r)
        return out

    def _unpacked(self, r: int) -> None:
        self.packs[r] = self.packs.get(r, 0) - 1
        self._release(r)

    def _release(self, r: int) -> None:
        """Drop our reference to a made or fetched root once autograd took all its saved
        references and no later chain reads it (then it lives as long as autograd holds it)."""
        if self.packs.get(r, 0) <= 0 and self.chain_uses.get(r, 0) <= 0:
            self.made.pop(r, None)
            sw = self.root_swap.get(r)
            if sw is not None and sw.packs <= 0:
                sw.dev = None

    def _chain_ran(self, owner: int) -> None:
        """(Steady state: let go of the values only this chain still needed.)"""

    def _issue_prefetches(self) -> None:
        order, pf = self.prefetch_order, self.table["prefetch_at"]
        while self.next_prefetch < len(order) and pf[order[self.next_prefetch]] <= self.progress:
            r = order[self.next_prefetch]
            self.next_prefetch += 1
            sw = self.root_swap.get(r)
            if sw is not None and sw.handle is not None:
                swap.prefetch(sw.handle)

    # -- chains ----------------------------------------------------------------------------
    def _chain_records(self, owner: int) -> list[int]:
        """The records chain `owner` replays, in order: the ops the roots it deferred need."""
        needs = self.table["needs"]
        return [self.rec_of_op[p]
                for p in sorted({p for r in self.deferred.get(owner, ()) for p in needs[r]})]

    def _chain_made(self, owner: int, local: dict) -> list[tuple[tuple[int, int], int]]:
        """(location, root) of the values chain `owner` made that are its own roots."""
        made_by = self.table["made_by"]
        return [(loc, tid) for loc in local
                if (tid := self.tid_of.get(loc)) is not None and made_by.get(tid) == owner]

    def _run_chain(self, owner: int) -> None:
        local: dict[tuple[int, int], torch.Tensor] = {}
        ks = self._chain_records(owner)
        self.chain = owner
        grad = torch.is_grad_enabled()
        torch.set_grad_enabled(False)
        prev, _STATE.run = getattr(_STATE, "run", None), None      # (no recording)
        autocast = _autocast_off(self.device)
        try:
            with autocast:
                for k in ks:
                    self._replay(k, local)
            self.rerun_ops += len(ks)
        finally:
            torch.set_grad_enabled(grad)
            _STATE.run = prev
            self.chain = None
        self.done_chains.add(owner)
        self._chain_ran(owner)
        for loc, tid in self._chain_made(owner, local):
            t = local.get(loc)
            if t is not None:
                self.made[tid] = t
        for r in self.table["chain_inputs"].get(owner, ()):
            self.chain_uses[r] = self.chain_uses.get(r, 0) - 1
            if self.chain_uses[r] <= 0:
                self.pinned.pop(r, None)
                self._release(r)

    def _live(self, loc: tuple[int, int]):
        """Output `loc` of this forward if it is still alive (it may since have changed):
        the tensor itself, or the alias autograd holds of it."""
        ref = self.records[loc[0]].outs[loc[1]]
        x = ref() if ref is not None else None
        if x is not None:
            return x.detach()          # (a chain's values hold no graph: see `_kept`)
        ref = self.kept_alias.get(loc)
        x = ref() if ref is not None else None
        if x is None:       # a root held for a chain that autograd saves only views of
            tid = self.tid_of.get(loc)
            if tid is not None and self.loc_of_tid.get(tid) == loc:
                x = self.pinned.get(tid)
        return x

    def _replay(self, k: int, local: dict) -> None:
        rec = self.records[k]
        geom = rec.geom
        if geom:                  # a view, re-derived with C calls (see `_view_geometry`)
            if self.chain is None:        # (an unpack's: straight from the value at hand)
                base, want = self._view_base(rec, local)
            else:
                base, want = rec.args[0], geom[0]
                if type(base) is _Ref:
                    base = self._resolve(base.loc, local)
            if (base.shape, base.stride(), base.storage_offset()) == want and not (
                    base.requires_grad and torch.is_grad_enabled()):
                for j, (size, stride, offset) in enumerate(geom[1]):
                    local[(k, j)] = _as_strided(base, size, stride, offset)
                return
        flat, spec, todo, written, n, keys = rec.prep or _prepare(rec)
        flat = list(flat)
        for i in todo:
            a = flat[i]
            cls = type(a)
            if cls is _Ref:
                flat[i] = self._resolve(a.loc, local)
            elif cls is _In:
                flat[i] = self.call_inputs[a.i]
            else:
                x = flat[i] = a.ref()
                if x is None:
                    raise RuntimeError(f"slackswap: replaying {rec.func} needs a value from "
                                       "outside the model's forward that is gone; this is a "
                                       "bug in slackswap, please report it")
        if spec is None:              # a flat call: positional arguments, then keywords
            args, kwargs = (flat[:n], dict(zip(keys, flat[n:]))) if keys else (flat, {})
        else:
            args, kwargs = pytree.tree_unflatten(flat, spec)
            args = list(args)
        for i in written:
            if isinstance(args[i], torch.Tensor):
                args[i] = args[i].clone()   # a side-effect write goes to a throwaway copy
        out = rec.func(*args, **kwargs)
        if geom is None and rec.alias:
            rec.geom = _view_geometry(rec, args, out)
        if isinstance(out, torch.Tensor):
            local[(k, 0)] = out
            return
        leaves = out if isinstance(out, (tuple, list)) and not any(
            isinstance(x, (tuple, list, dict)) for x in out) else pytree.tree_leaves(out)
        for j, x in enumerate(leaves):
            if isinstance(x, torch.Tensor):
                local[(k, j)] = x

    def _view_base(self, rec: _Record, local: dict) -> tuple:
        """For view `rec` re-derived by its geometry outside a chain (in an unpack, whose
        `local` is thrown away after): the nearest value at hand below it through views
        re-derivable by geometry, and the geometry that value must have. The same value
        `_resolve` would reach level by level; one `as_strided` from it gives the same view
        (offsets count in the storage), without making the views between."""
        src, want = rec.args[0], rec.geom[0]
        while type(src) is _Ref:
            loc = src.loc
            x = self._at_hand(loc, local)
            if x is not None:
                return x, want
            below, tid = self.records[loc[0]], self.tid_of.get(loc)
            geom = below.geom
            if not geom or geom[1][loc[1]] != want or (
                    tid is not None and tid in self.metas and tid in self.root_swap):
                return self._resolve(loc, local), want
            src, want = below.args[0], geom[0]
        return src, want

    def _at_hand(self, loc: tuple[int, int], local: dict):
        """Output `loc`'s value if this call holds it: made in `local` or by a chain, or
        still alive (held by autograd or pinned) and unchanged since the forward."""
        x = local.get(loc)
        if x is not None:
            return x
        tid = self.tid_of.get(loc)
        if tid is not None:
            x = self.made.get(tid)
            if x is not None:
                return x
        x = self._live(loc)
        if x is not None and x._version == self.records[loc[0]].versions[loc[1]]:
            if self.noting and self.chain is not None:
                self.live_reads.setdefault(self.chain, set()).add(loc)
            return x
        return None

    def _resolve(self, loc: tuple[int, int], local: dict) -> torch.Tensor:
        """The value recorded output `loc` had when the forward produced it."""
        x = self._at_hand(loc, local)
        if x is not None:
            return x
        k, j = loc
        rec = self.records[k]
        tid = self.tid_of.get(loc)
        if tid is not None and tid in self.metas and tid in self.root_swap:
            out = local[loc] = _view_of(self.root_swap[tid].fetch(), *self.metas[tid])
            return out
        if rec.alias:
            if rec.wfirst:
                src = rec.args[0]      # in place: its effect is already in the data
                out = self._resolve(src.loc, local)
            else:
                self._replay(k, local)  # a view: re-derived from its (resident) input
                out = local[loc]
            local[loc] = out
            return out
        raise RuntimeError(
            f"slackswap: backward needs output {j} of {rec.func} (recorded op {k}, profile "
            f"tensor {tid}), which the plan neither kept "
            "nor can recompute here; this is a bug in slackswap, please report it")


class Storages:
    """A set of storages by storage key (`key in storages`), each held weakly: once one is
    freed (a hook's temporary, a swapped activation), a later tensor that reuses its address
    is not taken for it. What a forward read but did not make (parameters, buffers, the call's
    inputs, a hook's values) and what autograd saved are such sets."""
    __slots__ = ("refs",)

    def __init__(self, refs: dict | None = None):
        self.refs: dict = {} if refs is None else refs

    def add(self, x: torch.Tensor) -> None:
        key = swap.storage_key(x)
        ref = self.refs.get(key)
        if ref is None or ref.expired():
            self.refs[key] = StorageWeakRef(x.untyped_storage())

    def __contains__(self, key) -> bool:
        ref = self.refs.get(key)
        return ref is not None and not ref.expired()

    def without(self, keys: set) -> "Storages":
        return Storages({k: r for k, r in self.refs.items() if k not in keys})

    def with_tensors(self, xs: list) -> "Storages":
        got = Storages(dict(self.refs))
        for x in xs:
            if x.device.type != "meta":
                got.add(x)
        return got


class _Swap:
    """One storage copied to host memory: its copy (`handle`) until fetched back, then the
    device bytes (`dev`) while anything may still read them; `packs`: saved references to it
    autograd has not taken yet."""
    __slots__ = ("ref", "handle", "dev", "packs", "version")

    def __init__(self, ref, handle, version: int):
        self.ref, self.handle, self.dev, self.packs = ref, handle, None, 0
        self.version = version

    def fetch(self) -> torch.Tensor:
        if self.dev is None:
            if self.handle is None:
                raise RuntimeError("slackswap: a swapped tensor was read after its last use; "
                                   "this is a bug in slackswap, please report it")
            self.dev = swap.wait(self.handle)
            self.handle = None
        return self.dev


def _storage_id(x: torch.Tensor) -> tuple:
    """(address key, weak reference) of x's storage: the key finds it, the reference tells
    whether it is still the same storage."""
    s = x.untyped_storage()
    return (x.device.type, x.device.index, s.data_ptr()), StorageWeakRef(s)


def _bytes_of(x: torch.Tensor) -> torch.Tensor:
    """A flat uint8 tensor over all of x's storage (a swap moves the whole root)."""
    s = x.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=x.device).set_(s, 0, (s.nbytes(),), (1,))


_as_strided = torch.Tensor.as_strided
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _view_geometry(rec: _Record, args: list, out):
    """For a view op replayed as `out = rec.func(*args)` (one tensor, or a list of them:
    `split`): (its input's size, stride and offset; each output's size, stride and offset),
    so a later replay of `rec` on an input of that geometry is `Tensor.as_strided(input, ...)`
    per output, C calls instead of the boxed op (the same storage, sizes, strides and offset:
    the same aliasing and values). Only for a plain, strided, real view of the first argument
    (a chain value, or a tensor held as a constant: a parameter) whose other arguments are
    constants, each output's `_base` the input's own base, with the same dtype (no
    `view.dtype` or complex views) and no conjugate or negative bit; False otherwise."""
    _, spec, todo, written, _, _ = rec.prep
    outs = [out] if type(out) is torch.Tensor else out
    base = args[0] if args else None
    if (rec.wfirst or spec is not None or written or type(base) not in _PLAIN
            or todo != ((0,) if isinstance(rec.args[0], _Ref) else ())
            or type(outs) not in (list, tuple) or not outs
            or any(type(o) is not torch.Tensor for o in outs)):
        return False
    root = base if base._base is None else base._base
    if (base.is_complex() or base.layout != torch.strided or base.is_nested
            or base.is_quantized or base.is_conj() or base.is_neg() or any(
                o._base is not root or o.dtype != base.dtype or o.is_conj() or o.is_neg()
                or o.grad_fn is not None for o in outs)):
        return False
    return ((base.shape, base.stride(), base.storage_offset()),
            tuple((o.shape, o.stride(), o.storage_offset()) for o in outs))


def _view_of(raw: torch.Tensor, dtype, shape, stride, offset) -> torch.Tensor:
    return torch.empty(0, dtype=dtype, device=raw.device).set_(raw.untyped_storage(), offset,
                                                                 shape, stride)


class _autocast_off:
    __slots__ = ("types", "ctx")

    def __init__(self, device):
        self.types = ("cpu",) if device is None or device.type == "cpu" else ("cpu", device.type)
        self.ctx = ()

    def __enter__(self):
        if not any(map(torch.is_autocast_enabled, self.types)):
            return                                       # (the common case: nothing to do)
        self.ctx = [torch.autocast(t, enabled=False) for t in self.types
                    if torch.is_autocast_enabled(t)]     # (an autocast object costs ~10 us)
        for c in self.ctx:
            c.__enter__()

    def __exit__(self, *exc):
        for c in reversed(self.ctx):
            c.__exit__(*exc)


class _Recorder(TorchDispatchMode):
    def __init__(self, run: PlanRun):
        super().__init__()
        self.run = run

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        run = self.run
        if func is _LOCAL_SCALAR:        # a Python value, not an op of the step's graph
            if run.recording:
                run.values.append(out)
            return out
        if run.recording:
            if run.in_body():
                run.record(func, args, kwargs, out)
            elif _alias_flags(func)[0] and args and isinstance(args[0], torch.Tensor) \
                    and args[0] in run.where:
                run.record(func, args, kwargs, out, alias=True)   # a hook's view of a value
        return out


def _body_hook(mod, args) -> None:
    run = getattr(_STATE, "run", None)
    if run is not None:
        run._body()


def _leave_hook(mod, args, out) -> None:
    run = getattr(_STATE, "run", None)
    if run is not None:
        run._leave()
