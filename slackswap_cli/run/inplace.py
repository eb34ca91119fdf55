"""Patch a model in place: the plan runs inside the model's own forward and autograd's backward.

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
  host copy of the tensor's whole storage (`runtime.offload`, on a side stream on CUDA), one
  per storage, brought back once (`runtime.prefetch`/`wait`) and shared by every view saved of
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
"""
from __future__ import annotations

import threading
import weakref

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakTensorKeyDictionary

from . import swap as rt
from ..trace.aten import aliases_input, writes_first, written_positions, written_returns

__all__ = ["patch", "unpatch", "is_patched", "PlanRun"]

WINDOW = 256            # how far ahead an op may match an expected op
ALIGN_WARN = 0.5        # warn when fewer of the profile's forward ops than this line up
_STATE = threading.local()


def _is_random(rec: "_Record") -> bool:
    from ..trace.costs import is_random_call
    return is_random_call(rec.func, rec.args, rec.kwargs)


class _Ref:
    """A tensor argument produced by recorded op `rec`, output `out`."""
    __slots__ = ("rec", "out")

    def __init__(self, rec: int, out: int):
        self.rec, self.out = rec, out


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


class _Record:
    __slots__ = ("func", "args", "kwargs", "outs", "versions", "op", "in_locs", "prep")

    def __init__(self, func, args, kwargs, outs, versions, op, in_locs):
        self.func, self.args, self.kwargs = func, args, kwargs
        self.outs, self.versions, self.op, self.in_locs = outs, versions, op, in_locs
        self.prep = None


def _prepare(rec: _Record) -> tuple:
    """What replaying `rec` needs, worked out once: the flat arguments, their structure (None
    for a flat call), the positions to resolve, the positions of side-effect writes."""
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
    rec.prep = (tuple(flat), spec, todo, written)
    return rec.prep


class PlanRun:
    """One training step's recorded forward and the state its backward needs."""

    def __init__(self, patched: "_Patched", plan: "_Table"):
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
        self.modules: list[list] = [["", True]]    # [module path, in its forward body?]
        self.inputs: set[int] = set()              # ids of the call's own tensors (held)
        self.kept_refs: list = []                  # what autograd holds as it is (weak)
        self.external: set = set()                 # storages the forward read but did not make
        self.call_inputs: list = []                # the call's own tensors, in order
        # for a steady-state template (`_Template`): each pack's decision, in order, and the
        # values each chain read that were alive (held by autograd or pinned) when it ran
        self.seq: list[tuple] = []
        self.live_reads: dict[int, set] = {}
        self.chain = None                          # the chain replaying now
        self.bound: dict[tuple[int, int], torch.Tensor] = {}   # steady state: loc -> value

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
                    self.external.add(rt.storage_key(x))   # a parameter, buffer or input
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
            tids = self.table["ops"][op][3]
            for j, tid in enumerate(tids):
                if j < len(leaves) and isinstance(leaves[j], torch.Tensor):
                    self.tid_of[(k, j)] = tid
                    self.loc_of_tid[tid] = (k, j)
                    r = self.root(tid)
                    if r == tid and r in self.t.pin_roots:
                        self.pinned[r] = leaves[j]
                    if r == tid and self.table["action"].get(r) == "swap":
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
        """The next expected op with this op's target, first output shape and module, that
        reads activations exactly when this op does, and reads no profile value it does not
        (so an op of a wrapper's hook, such as FSDP2's views of gathered weights or of a
        block's input, cannot pass for a model's op)."""
        ops = self.table["ops"]
        name = str(func)
        first = next((list(x.shape) for x in leaves if isinstance(x, torch.Tensor)), None)
        module = self.modules[-1][0]
        end = min(len(ops), self.ptr + WINDOW)
        for i in range(self.ptr, end):
            o = ops[i]
            if (o[1] == name and o[4] == module and (o[2][0] if o[2] else None) == first
                    and o[5] == reads_act and known.issubset(o[6])):
                self.ptr = i + 1
                return i
        self.unmatched += 1
        return None

    # Which module runs, as the profile's trace attributes ops (the innermost module), and
    # whether in its forward body or in its hooks: a global pre-hook (called before every
    # module's own pre-hooks) enters a module's hooks; our own pre-hook, kept last in each
    # module's pre-hooks, enters its body; our own forward hook, kept last, leaves it. Ops in
    # hooks (FSDP2's unshard and reshard, a wrapper's input casts) are not the model's: they
    # are not recorded, and their results are outside values to the ops that read them.
    def _enter(self, mod, args) -> None:
        name = self.p.names.get(id(mod))
        self.modules.append([self.modules[-1][0] if name is None else name, False])

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
        # what a later call at these shapes checks and does at this pack (`_Template`)
        note = [x.shape, x.dtype, "keep", None, loc, loc is not None,
                None if base is None else self.where.get(base), None, type(x.grad_fn)]
        self.seq.append(note)
        tid = None if loc is None else self.tid_of.get(loc)
        if tid is None:
            if loc is not None:
                self.kept_refs.append(weakref.ref(x))
            return x
        r = self.root(tid)
        act = self.table["action"].get(r)
        if act == "swap" and self.t.last_write.get(r, -1) >= self.ptr:
            act = None    # still to be written in place (a GRU cell's gates): a copy made
            #               now would miss those writes, so it is kept as eager keeps it
        if act == "swap":
            note[2:4] = "swap", r
            return self._swap(x, r, note)
        if act == "recompute" and self._usable(r):
            note[2:4] = "recompute", r
            self.packs[r] = self.packs.get(r, 0) + 1
            self.deferred.setdefault(self.table["made_by"][r], set()).add(r)
            return [False, "recompute", r, loc]
        self.kept_refs.append(weakref.ref(x))
        return x

    def _swap(self, x: torch.Tensor, r: int, note) -> list:
        """Pack `x` (root `r` or a view of it) as a host copy of its storage. `note`: this
        pack's entry of `seq`, whose last item says whether x's storage is root r's own (so
        a chain reading r fetches this copy): found out on the first call, followed later."""
        # one copy per storage (a root and its views), found by the storage itself: an
        # address alone may be a new tensor's, once a swapped one's memory was freed
        key, ref = _storage_id(x)
        sw = self.by_storage.get(key)
        if sw is None or sw.ref.expired() or sw.version != x._version:
            # (a storage written since its copy, say a buffer filled step by step, is
            # copied again: a copy serves only the contents it saw)
            sw = self.by_storage[key] = _Swap(ref, rt.offload(_bytes_of(x)), x._version)
            self.swaps.append(sw)
        if note[7] is None:
            mine = self.root_storage.get(r)
            note[7] = mine is not None and mine[0] == key and not mine[1].expired()
        if note[7]:
            self.root_swap[r] = sw
            self.pinned.pop(r, None)      # the host copy serves a chain that reads it
        sw.packs += 1
        self.packs[r] = self.packs.get(r, 0) + 1
        return [False, "swap", r, sw, x.dtype, tuple(x.shape), tuple(x.stride()),
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
        if not aliases_input(rec.func):
            return True
        src = rec.args[0] if rec.args else None
        if not isinstance(src, _Ref):
            return self.root(tid) in self.t.non_activation or not rec.in_locs
        return (self._known((src.rec, src.out))
                and self.root(self.tid_of[(src.rec, src.out)]) == self.root(tid))

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
            key = rt.storage_key(t)
            if key not in seen and key not in self.external:
                seen.add(key)
                total += rt.storage_bytes(t)
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
        if kind == "swap":
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
                rt.prefetch(sw.handle)

    # -- chains ----------------------------------------------------------------------------
    def _run_chain(self, owner: int) -> None:
        local: dict[tuple[int, int], torch.Tensor] = {}
        needs = self.table["needs"]
        ops = sorted({p for r in self.deferred.get(owner, ()) for p in needs[r]})
        self.chain = owner
        try:
            with torch.no_grad(), _autocast_off(self.device), _paused():
                for p in ops:
                    k = self.rec_of_op[p]
                    self._replay(k, local)
                    self.rerun_ops += 1
        finally:
            self.chain = None
        self.done_chains.add(owner)
        self._chain_ran(owner)
        for (k, j), t in local.items():
            tid = self.tid_of.get((k, j))
            if tid is not None and self.table["made_by"].get(tid) == owner:
                self.made[tid] = t
        for r in self.table["chain_inputs"].get(owner, ()):
            self.chain_uses[r] = self.chain_uses.get(r, 0) - 1
            if self.chain_uses[r] <= 0:
                self.pinned.pop(r, None)
                self._release(r)

    def _live(self, loc: tuple[int, int]):
        """Output `loc` of this forward if it is still alive (it may since have changed)."""
        ref = self.records[loc[0]].outs[loc[1]]
        return ref() if ref is not None else None

    def _replay(self, k: int, local: dict) -> None:
        rec = self.records[k]
        prep = rec.prep or _prepare(rec)
        flat = list(prep[0])
        for i in prep[2]:
            a = flat[i]
            if isinstance(a, _Ref):
                flat[i] = self._resolve((a.rec, a.out), local)
            elif isinstance(a, _In):
                flat[i] = self.call_inputs[a.i]
            else:
                x = flat[i] = a.ref()
                if x is None:
                    raise RuntimeError(f"slackswap: replaying {rec.func} needs a value from "
                                       "outside the model's forward that is gone; this is a "
                                       "bug in slackswap, please report it")
        if prep[1] is None:           # a flat call: positional arguments, then keywords
            n = len(rec.args)
            args, kwargs = flat[:n], dict(zip(rec.kwargs, flat[n:]))
        else:
            args, kwargs = pytree.tree_unflatten(flat, prep[1])
            args = list(args)
        for i in prep[3]:
            if isinstance(args[i], torch.Tensor):
                args[i] = args[i].clone()   # a side-effect write goes to a throwaway copy
        out = rec.func(*args, **kwargs)
        if isinstance(out, torch.Tensor):
            local[(k, 0)] = out
            return
        leaves = out if isinstance(out, (tuple, list)) and not any(
            isinstance(x, (tuple, list, dict)) for x in out) else pytree.tree_leaves(out)
        for j, x in enumerate(leaves):
            if isinstance(x, torch.Tensor):
                local[(k, j)] = x

    def _resolve(self, loc: tuple[int, int], local: dict) -> torch.Tensor:
        """The value recorded output `loc` had when the forward produced it."""
        if loc in local:
            return local[loc]
        tid = self.tid_of.get(loc)
        if tid is not None and tid in self.made:
            return self.made[tid]
        k, j = loc
        rec = self.records[k]
        x = self._live(loc)
        if x is not None and x._version == rec.versions[j]:
            if self.chain is not None:
                self.live_reads.setdefault(self.chain, set()).add(loc)
            return x                      # still alive (held by autograd or pinned), unchanged
        if tid is not None and tid in self.metas and tid in self.root_swap:
            out = local[loc] = _view_of(self.root_swap[tid].fetch(), *self.metas[tid])
            return out
        if aliases_input(rec.func):
            if writes_first(rec.func):
                src = rec.args[0]      # in place: its effect is already in the data
                out = self._resolve((src.rec, src.out), local)
            else:
                self._replay(k, local)  # a view: re-derived from its (resident) input
                out = local[loc]
            local[loc] = out
            return out
        raise RuntimeError(
            f"slackswap: backward needs output {j} of {rec.func} (recorded op {k}, profile "
            f"tensor {tid}), which the plan neither kept "
            "nor can recompute here; this is a bug in slackswap, please report it")


class _Template:
    """What a later call at the same input signature needs from the first one's full record
    (`PlanRun`) to run the plan with saved-tensor hooks alone (`SteadyRun`): each pack's
    expected shape and dtype and its decision, the records of the ops (with the call's inputs
    as `_In` markers, so later calls' inputs take their place), and, for each value a chain read
    while it was alive, the pack that hands it over."""

    def __init__(self, run: PlanRun, fingerprint: tuple):
        self.fingerprint = fingerprint
        self.n = len(run.seq)
        pos = {id(x): i for i, x in enumerate(run.call_inputs)}

        def sub(a):
            return _In(pos[id(a)]) if isinstance(a, torch.Tensor) and id(a) in pos else a
        self.records = [_Record(r.func, pytree.tree_map(sub, r.args),
                                pytree.tree_map(sub, r.kwargs), None, r.versions, r.op,
                                r.in_locs) for r in run.records]
        self.shared = {name: getattr(run, name) for name in (
            "reads_act", "rec_of_op", "tid_of", "loc_of_tid", "usable", "metas", "device",
            "prefetch_order", "unmatched", "ptr")}
        inputs = {rt.storage_key(x) for x in run.call_inputs if x.device.type != "meta"}
        self.external = run.external - inputs
        first_self, first_base = {}, {}
        for i, n in enumerate(run.seq):
            first_self.setdefault(n[4], i)
            first_base.setdefault(n[6], i)
        self.binds: dict[int, list] = {}          # pack -> [(loc, via its _base?)]
        self.uses: dict[tuple, int] = {}          # loc -> chains that read it
        self.chain_reads = {o: tuple(locs) for o, locs in run.live_reads.items()}
        self.ok = True
        for locs in self.chain_reads.values():
            for loc in locs:
                self.uses[loc] = self.uses.get(loc, 0) + 1
        for loc in self.uses:
            if loc in first_self:
                self.binds.setdefault(first_self[loc], []).append((loc, False))
            elif loc in first_base:
                self.binds.setdefault(first_base[loc], []).append((loc, True))
            else:
                self.ok = False     # a chain read a value autograd does not save: no hand-over
        # each pack: (shape, dtype, kind, root, loc, weakly tracked?, base's loc, swap of the
        # root's own storage?, type of its grad_fn, [(loc to hand over, via its _base?)], ...)
        self.seq = [(*n, self.binds.get(i)) for i, n in enumerate(run.seq)]
        # a keep-all plan: nothing depends on which tensor is which, nothing to check
        self.keep_only = all(a == "keep" for a in run.table["action"].values())


def _autocast_state() -> tuple:
    return tuple(torch.is_autocast_enabled(d) and torch.get_autocast_dtype(d)
                 for d in ("cpu", "cuda"))


class _Fingerprint:
    """What a template is valid for besides the signature: the very parameter and buffer
    tensors in each module's slots (its records hold them) and the autocast state. `holds()`
    checks it without walking the module tree."""

    def __init__(self, model: torch.nn.Module):
        self.autocast = _autocast_state()
        self.slots = [(d, name, t) for m in model.modules()
                      for d in (m._parameters, m._buffers) for name, t in d.items()]

    def holds(self) -> bool:
        if _autocast_state() != self.autocast:
            return False
        for d, name, t in self.slots:
            if d.get(name) is not t:
                return False
        return True


class SteadyRun(PlanRun):
    """A later call at a signature whose first call made a `_Template`: no recorder, no module
    hooks; the pack hook follows the template's decisions by position, checking each saved
    tensor's shape, dtype and the type of the autograd node that made it. On the first difference (other control flow) it keeps every
    tensor from there on, as eager does, and the next call records in full again. Chains
    replay the template's records on the values this call's packs handed over."""

    def __init__(self, patched: "_Patched", plan: "_Table", tpl: _Template, inputs: list):
        # (PlanRun's per-call state, without what only recording needs)
        self.p, self.t, self.table = patched, plan, plan.table
        self.__dict__.update(tpl.shared)
        self.tpl, self.records, self.seq = tpl, tpl.records, tpl.seq
        self.pinned, self.by_storage, self.root_swap, self.made = {}, {}, {}, {}
        self.swaps, self.kept_refs = [], []
        self.chain_uses = dict(plan.chain_uses)
        self.packs, self.deferred, self.done_chains = {}, {}, set()
        self.progress, self.next_prefetch, self.rerun_ops = self.table["n_forward"], 0, 0
        self.call_inputs = inputs
        self.external = tpl.external | {rt.storage_key(x) for x in inputs
                                        if x.device.type != "meta"}
        self.live_reads, self.chain, self.bound = {}, None, {}
        self.bound_uses = dict(tpl.uses)
        self.i = 0
        self.broken = False
        if tpl.keep_only:          # nothing depends on which tensor is which: no checks
            self.pack = self._keep

    def _keep(self, x: torch.Tensor):
        i = self.i
        self.i = i + 1
        if i >= self.tpl.n or self.seq[i][5]:     # (a value the forward made: counted)
            self.kept_refs.append(weakref.ref(x))
        return x

    def pack(self, x: torch.Tensor):
        i = self.i
        self.i = i + 1
        if i >= self.tpl.n or self.broken:
            return self._differs(x)
        n = self.seq[i]
        if x.shape != n[0] or x.dtype is not n[1] or type(x.grad_fn) is not n[8]:
            return self._differs(x)
        if n[9] is not None:
            for loc, via_base in n[9]:
                v = x._base if via_base else x
                if v is None:
                    return self._differs(x)
                self.bound[loc] = v
        kind = n[2]
        if kind == "keep":
            if n[5]:
                self.kept_refs.append(weakref.ref(x))
            return x
        r = n[3]
        if kind == "swap":
            return self._swap(x, r, n)
        self.packs[r] = self.packs.get(r, 0) + 1
        self.deferred.setdefault(self.table["made_by"][r], set()).add(r)
        return [False, "recompute", r, n[4]]

    def _differs(self, x: torch.Tensor):
        self.broken = True
        self.kept_refs.append(weakref.ref(x))
        return x

    def finish(self) -> bool:
        """After forward: did every pack line up with the template?"""
        if self.i != self.tpl.n and not self.tpl.keep_only:
            self.broken = True
        return not self.broken

    def _live(self, loc: tuple[int, int]):
        return self.bound.get(loc)

    def _chain_ran(self, owner: int) -> None:
        for loc in self.tpl.chain_reads.get(owner, ()):
            self.bound_uses[loc] -= 1
            if self.bound_uses[loc] <= 0:
                self.bound.pop(loc, None)


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
            self.dev = rt.wait(self.handle)
            self.handle = None
        return self.dev


def _storage_id(x: torch.Tensor) -> tuple:
    """(address key, weak reference) of x's storage: the key finds it, the reference tells
    whether it is still the same storage."""
    from torch.multiprocessing.reductions import StorageWeakRef
    s = x.untyped_storage()
    return (x.device.type, x.device.index, s.data_ptr()), StorageWeakRef(s)


def _bytes_of(x: torch.Tensor) -> torch.Tensor:
    """A flat uint8 tensor over all of x's storage (a swap moves the whole root)."""
    s = x.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=x.device).set_(s, 0, (s.nbytes(),), (1,))


def _view_of(raw: torch.Tensor, dtype, shape, stride, offset) -> torch.Tensor:
    return torch.empty(0, dtype=dtype, device=raw.device).set_(raw.untyped_storage(), offset,
                                                                 shape, stride)


class _autocast_off:
    def __init__(self, device):
        self.types = ["cpu"] + ([device.type] if device is not None and device.type != "cpu" else [])
        self.ctx = []

    def __enter__(self):
        self.ctx = [torch.autocast(t, enabled=False) for t in self.types
                    if torch.is_autocast_enabled(t)]     # (an autocast object costs ~10 us)
        for c in self.ctx:
            c.__enter__()

    def __exit__(self, *exc):
        for c in reversed(self.ctx):
            c.__exit__(*exc)


class _paused:
    """No recording while a chain replays (it runs in backward, outside any recorder)."""

    def __enter__(self):
        self.prev = getattr(_STATE, "run", None)
        _STATE.run = None

    def __exit__(self, *exc):
        _STATE.run = self.prev


class _Recorder(TorchDispatchMode):
    def __init__(self, run: PlanRun):
        super().__init__()
        self.run = run

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        run = self.run
        if run.recording:
            if run.in_body():
                run.record(func, args, kwargs, out)
            elif aliases_input(func) and args and isinstance(args[0], torch.Tensor) \
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


class _Table:
    """One plan's table (`chains.runtime_table`) and the lookups derived from it."""

    def __init__(self, table: dict):
        self.table = table
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
        self.pin_roots = {r for r in self.chain_uses if table["action"].get(r) != "recompute"}


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
    if any(isinstance(a, (list, tuple, dict)) for a in flat):
        return pytree.tree_leaves((args, kwargs))
    return flat


class _Patched:
    """What `patch` attaches to a model: its plans (one per input signature), the first call's
    record at each signature (`_Template`, for the calls after it) and state. Nothing of the
    model is read before its first call (a model being unpickled or deep-copied is empty when
    this is made)."""

    def __init__(self, model, meta: dict, table: dict, original_forward, had_instance_forward,
                 replan: bool = True, strict: bool = False, plans: dict | None = None):
        self.model, self.meta, self.table = model, meta, table
        self._forward = original_forward       # None: the class's forward
        self.had_instance_forward = had_instance_forward
        self.last_run: PlanRun | None = None
        self.warned = False
        self.said: set[str] = set()             # notes already given on stderr
        self.module_hooks: dict[int, tuple] = {}
        self._names: dict | None = None
        self._first = None
        self.buffer_ids: set[int] = set()
        self.replan = replan
        self.strict = strict
        self.steady = True                      # later calls at a signature: hooks alone
        self.templates: dict[tuple, object] = {}
        params = meta.get("params") or [[None, None, "torch.float32"]]
        profiled = (meta.get("device_type", "cpu"), params[0][2].removeprefix("torch."),
                    *((tuple(shape), dtype.removeprefix("torch."))
                      for shape, dtype in meta.get("input_tensors", [])))
        self.plans: dict[tuple, _Table | None] = plans or {profiled: _Table(table)}
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
        import copy
        fwd = None if self._forward is None else copy.deepcopy(self._forward, memo)
        return _Patched(model, self.meta, self.table, fwd, self.had_instance_forward,
                        self.replan, self.strict, dict(self.plans))

    def plan_for(self, args, kwargs) -> tuple["_Table", tuple]:
        """The plan for this call's signature (device, parameter dtype, input shapes and
        dtypes): the profiled one, or one made for it the first time it is seen (said once
        on stderr), cached; and the signature."""
        ref = self._first_param()
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
            except Exception as exc:  # noqa: BLE001 - the step still runs, with the old plan
                print(f"slackswap: new inputs {_shapes(sig)}: could not plan for them "
                      f"({type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}); "
                      "running with the profiled plan", file=sys.stderr)
        self.plans[sig] = plan
        return plan or self.default, sig

    def forward(self, *args, **kwargs):
        if not (self.model.training and torch.is_grad_enabled()) or \
                getattr(_STATE, "run", None) is not None:
            return self.original_forward(*args, **kwargs)
        if torch.compiler.is_compiling():
            self._say("compile", "torch.compile traces the model's own forward: the compiled "
                      "model runs unpatched, without the plan (patch the eager model, or use "
                      "the compiled path)")
            return self.original_forward(*args, **kwargs)
        plan, sig = self.plan_for(args, kwargs)
        inputs = [x for x in _leaves(args, kwargs) if isinstance(x, torch.Tensor)]
        tpl = self._template(sig) if self.steady else None
        if tpl is not None:
            return self._steady(SteadyRun(self, plan, tpl, inputs), args, kwargs, sig)
        run = PlanRun(self, plan)
        run.inputs = {id(x) for x in inputs}
        run.call_inputs = inputs
        self.buffer_ids = {id(b) for b in self.model.buffers()}
        self._say_checkpointing()
        prev = getattr(_STATE, "run", None)
        _STATE.run = run
        from torch.nn.modules.module import register_module_forward_pre_hook
        self._last_hooks()
        hooks = [register_module_forward_pre_hook(run._enter)]
        try:
            with _Recorder(run), torch.autograd.graph.saved_tensors_hooks(run.pack, run.unpack):
                out = self.original_forward(*args, **kwargs)
        finally:
            _STATE.run = prev
            for h in hooks:
                h.remove()
            self.remove_hooks()      # off the model until the next full record
        self.last_run = run
        self.templates[sig] = (run, self._fingerprint())
        self._check_alignment(run)
        return out

    def _steady(self, run: "SteadyRun", args, kwargs, sig):
        prev = getattr(_STATE, "run", None)
        _STATE.run = run
        try:
            with torch.autograd.graph.saved_tensors_hooks(run.pack, run.unpack):
                out = self.original_forward(*args, **kwargs)
        finally:
            _STATE.run = prev
        if not run.finish():
            self.templates.pop(sig, None)       # other control flow: the next call records
        self.last_run = run
        return out

    def _template(self, sig) -> "_Template | None":
        """The steady-state template for `sig`, made from its first call once that call's
        backward ran every chain it deferred (it then knows what each chain reads)."""
        got = self.templates.get(sig)
        if got is None or got is False:
            return None
        if isinstance(got, _Template):
            if got.fingerprint.holds():
                return got
            self.templates.pop(sig)             # parameters replaced, or autocast changed
            return None
        run, made_with = got
        if not made_with.holds() or not set(run.deferred) <= run.done_chains:
            return None                          # (the first call's backward has not run)
        tpl = _Template(run, made_with)
        self.templates[sig] = tpl if tpl.ok else False
        return tpl if tpl.ok else None

    def _fingerprint(self) -> "_Fingerprint":
        return _Fingerprint(self.model)

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
            self.module_hooks[id(mod)] = (mod.register_forward_pre_hook(_body_hook),
                                          mod.register_forward_hook(_leave_hook, always_call=True))

    def remove_hooks(self) -> None:
        for hooks in self.module_hooks.values():
            for h in hooks:
                h.remove()
        self.module_hooks.clear()

    def _check_alignment(self, run: PlanRun) -> None:
        """Say once, on stderr, when most of the profile's ops did not line up: the plan then
        saves little (correctness is not at stake: unmatched values are kept as eager keeps
        them)."""
        n = len(run.table["ops"])
        matched = len(run.rec_of_op)
        if n and matched < ALIGN_WARN * n and not self.warned:
            self.warned = True
            import sys
            print(f"slackswap: only {matched} of the profile's {n} forward ops lined up with "
                  "this step's (another input shape, device, dtype or model?): the plan ran "
                  "for those alone. Re-profile for this setup to get all of it.", file=sys.stderr)


def patch(model: torch.nn.Module, meta: dict, table: dict, *, replan: bool = True,
          strict: bool = False) -> torch.nn.Module:
    """Patch `model` in place to run `table`'s plan in training; returns `model`.

    `replan`: on input shapes other than the profiled ones, trace the model at those shapes
    with fake tensors and plan for them (same planner, hardware and budget fraction), once per
    shape; with False the profiled plan is used (and lines up where it can). `strict`: refuse
    (FingerprintMismatch) any call at shapes or on a device other than the profiled ones."""
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


def _shapes(sig: tuple) -> str:
    return ", ".join("x".join(map(str, shape)) or "scalar" for shape, _ in sig[2:]) \
        + f" on {sig[0]}, {sig[1]} parameters"


def _error(message: str, hint: str):
    from ..errors import InputError
    return InputError(message, hint=hint)
