"""Recompute chains: what backward re-runs, and when each saved value must be resident.

This module is the one owner of that question. The simulator (`simulate`) lays its compute
tasks out with `lay_out`, the planners (`planners.common`) cost each candidate with
`candidate_chain`, and `run/written/code.py`'s `partition` writes the patched module's backward
from the same `Layout`, so what runs is what was simulated. Torch-free.

Everything here works on storage *roots* (`Tables`): a view or an in-place result is read
through its root, and one decision covers a root and all its aliases.

**The rules** (per saved activation root, given the plan's actions):

- A backward op that reads a root whose action is *recompute*, and which is not resident yet,
  is preceded by a *chain*: the producer of that root is re-run, and before it, recursively,
  the producer of every input root that is not at hand, in forward order.
- An input root is *at hand* when it is resident at that point: kept and not past its last
  reader, produced in backward, or already made resident by an earlier chain or fetch.
- A swapped root that is not at hand is *fetched* for the chain: it becomes resident from the
  chain on (its `need_task` is the chain's first task that reads it) and is never recomputed.
- A kept root is always at hand: if its last reader already ran, its life is extended to the
  chain (`ext`), never re-run (so a chain never walks through a kept value, as the planners'
  static view assumes).
- Any other root that is not at hand is re-run (its producer joins the chain); one that
  cannot be re-run and that backward does not save (a random op's output, such as a dropout
  mask nobody kept, or what an op made from a value a later op overwrote in place: the
  profile's `recomputable`) makes the plan impossible (`InputError`).
- Roots a chain produces that are themselves to be recomputed stay resident until their own
  last reader (`made`): each op is re-run once per step, as torch's partitioner does. Every
  other value a chain produces is a *temporary* (`temps`), freed after the last chain task
  that reads it, and re-run again if a later chain needs it.
- A re-run op's other outputs exist for the op's duration, except those already resident
  (not made again).

The planners' static view (`candidate_chain`) applies the same rules to one candidate with
every other candidate at hand, which is what makes a candidate's chain time independent of the
other actions.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from .errors import InputError
from .schema import Action
from .table_rows import OpRow

# Int codes of the actions for the hot loops (the simulator's, the layout's); the one place
# they are derived from `schema.Action`. NOT_SAVED marks a root that takes no decision.
ACTION_CODES: dict[str, int] = {a: i for i, a in enumerate(Action)}
ACTION_OF_CODE: tuple[Action, ...] = tuple(Action)
KEEP_CODE, SWAP_CODE, RECOMPUTE_CODE = (ACTION_CODES[a]
                                         for a in (Action.KEEP, Action.SWAP, Action.RECOMPUTE))
NOT_SAVED = len(ACTION_CODES)


# --------------------------------------------------------------------------------------------
# Root-level tables of a profile (decision independent, cached on the profile)
# --------------------------------------------------------------------------------------------
class Tables:
    """Plain-list views of a profile: roots, sizes, readers, first/last uses."""

    def __init__(self, prof):
        ops, tensors = prof.ops, prof.tensors
        n_ops, n_t = len(ops), len(tensors)
        self.n_ops, self.n_t = n_ops, n_t
        self.n_fwd = nf = prof.n_forward
        self.time = [float(o.time_us) for o in ops]
        root = [t.id if t.alias_of is None else t.alias_of for t in tensors]
        is_root = [t.kind == "activation" and t.alias_of is None and t.producer is not None
                   for t in tensors]
        self.root = root
        self.is_root = is_root
        self.size = [t.size_bytes for t in tensors]
        self.producer = [-1 if t.producer is None else t.producer for t in tensors]
        self.recomputable = [t.recomputable for t in tensors]
        self.out_roots = [tuple(j for j in o.outputs if is_root[j]) for o in ops]
        in_roots = []
        for o in ops:
            seen = []
            for j in o.inputs:
                r = root[j]
                if is_root[r] and r not in seen:
                    seen.append(r)
            in_roots.append(tuple(seen))
        self.in_roots = in_roots
        last = list(self.producer)
        lfu = list(self.producer)
        fbu = [-1] * n_t
        for i, rs in enumerate(in_roots):
            for r in rs:
                last[r] = i
                if i < nf:
                    lfu[r] = i
                elif fbu[r] < 0:
                    fbu[r] = i
        self.last_use, self.last_fwd_use, self.first_bwd_use = last, lfu, fbu
        self.roots = [j for j in range(n_t) if is_root[j]]
        # the saved activation roots: the planner's candidates (`Profile.saved_activations`)
        saved_ids = {t.id for t in prof.saved_activations}
        self.saved = [j in saved_ids for j in range(n_t)]
        self.default_action = [KEEP_CODE if s else NOT_SAVED for s in self.saved]
        self.saved_roots = [j for j in self.roots if self.saved[j]]
        saved = self.saved
        self.bwd_saved_in = [()] * nf + [tuple(r for r in in_roots[i] if saved[r])
                                         for i in range(nf, n_ops)]
        self.bwd_readers = [i for i in range(nf, n_ops) if self.bwd_saved_in[i]]
        readers_of: dict[int, list[int]] = {}
        for i in self.bwd_readers:
            for r in self.bwd_saved_in[i]:
                readers_of.setdefault(r, []).append(i)
        self.bwd_readers_of = readers_of   # saved root -> backward ops that read it
        # bytes every plan allocates at each op's start / frees at its end: values that are
        # not saved activations (forward transients, backward values)
        base_alloc = [0] * n_ops
        base_free = [0] * n_ops
        for j in self.roots:
            if not saved[j]:
                base_alloc[self.producer[j]] += self.size[j]
                base_free[last[j]] += self.size[j]
        self.base_alloc, self.base_free = base_alloc, base_free
        ideal = 0.0
        for x in self.time:   # same summation order as the simulator's loop: keep-all is exact
            ideal += x
        self.ideal_us = ideal
        self.floor_bytes: int | None = None     # simulate.budget_floor_bytes, on demand


def tables(prof) -> Tables:
    """The profile's `Tables`, built once (profiles are immutable, so the cache is safe)."""
    tab = prof.__dict__.get("_slackswap_chain_tables")
    if tab is None:
        tab = Tables(prof)
        prof.__dict__["_slackswap_chain_tables"] = tab
    return tab


# --------------------------------------------------------------------------------------------
# The closure: which producers a chain re-runs
# --------------------------------------------------------------------------------------------
class ChainImpossible(Exception):
    """A chain needs root `x`, which cannot be re-run and which backward does not save."""

    def __init__(self, x: int):
        super().__init__(x)
        self.x = x


def closure(tab: Tables, targets: list[int],
            at_hand: Callable[[int], bool]) -> tuple[set[int], set[int]]:
    """(ops, roots) of the chain that produces `targets`: the op ids it re-runs (lay them out
    sorted) and the roots it walked through to do so (`targets` included).

    An input root that is `at_hand` stops the walk; any other is re-run when it can be, is
    left to the caller when it is saved (fetched or held), and raises `ChainImpossible` when
    it is neither.
    """
    producer, in_roots, recomputable, saved = tab.producer, tab.in_roots, tab.recomputable, tab.saved
    produced = set(targets)
    run: set[int] = set()
    stack = list(targets)
    while stack:
        p = producer[stack.pop()]
        if p in run:
            continue
        run.add(p)
        for x in in_roots[p]:
            if x in produced or at_hand(x):
                continue
            if recomputable[x]:
                produced.add(x)
                stack.append(x)
            elif not saved[x]:
                raise ChainImpossible(x)
    return run, produced


# --------------------------------------------------------------------------------------------
# The layout of one plan: compute tasks with chains inserted
# --------------------------------------------------------------------------------------------
@dataclass
class Layout:
    """The compute task sequence of one plan and what each chain makes resident.

    Tasks 0..n_fwd-1 are the forward ops; backward tasks follow, each backward op preceded by
    its chain (if any). Task t runs op `task_op[t]` for backward op `task_owner[t]` (equal for
    an op that is not a re-run).
    """
    task_op: list[int]
    task_owner: list[int]
    op_task: list[int]                       # backward op -> its own task
    need_task: dict[int, int] = field(default_factory=dict)   # swapped root -> first task reading it
    made: list[tuple[int, int]] = field(default_factory=list)  # (recompute root, task made)
    temps: list[tuple[int, int, int]] = field(default_factory=list)  # (root, task made, last task reading it)
    ext: dict[int, int] = field(default_factory=dict)   # saved root -> task its life extends to
    chain_alloc: dict[int, int] = field(default_factory=dict)  # chain task -> bytes it allocates
    chain_root: dict[int, int] = field(default_factory=dict)   # chain task -> root it is mainly for

    def chains(self, n_fwd: int) -> dict[int, tuple[int, ...]]:
        """Backward op -> the ops re-run right before it, in order."""
        out: dict[int, list[int]] = {}
        for t in range(n_fwd, len(self.task_op)):
            op, owner = self.task_op[t], self.task_owner[t]
            if op != owner:
                out.setdefault(owner, []).append(op)
        return {k: tuple(v) for k, v in out.items()}


def action_codes(tab: Tables, decisions) -> list[int]:
    """One action code per tensor for a plan's (already checked) decisions."""
    action = list(tab.default_action)
    for d in decisions:
        action[d.tensor] = ACTION_CODES[d.action]
    return action


def lay_out(prof, tab: Tables, action: list[int]) -> Layout:
    """Lay out the compute tasks of `action` (one code per tensor, see `ACTION_CODES`)."""
    nf, n_ops = tab.n_fwd, tab.n_ops
    producer, last_use = tab.producer, tab.last_use
    task_op = list(range(nf))
    task_owner = list(range(nf))
    op_task = list(range(nf)) + [-1] * (n_ops - nf)
    lay = Layout(task_op, task_owner, op_task)
    need_task = lay.need_task
    mat: set[int] = set()              # swap/recompute roots resident in backward

    def resident(x: int, i: int) -> bool:
        a = action[x]
        if a == KEEP_CODE:
            return last_use[x] >= i
        if a == NOT_SAVED:
            return producer[x] >= nf   # produced in backward: alive while read
        return x in mat and last_use[x] >= i

    bwd_saved_in = tab.bwd_saved_in
    nxt = nf                           # next backward op not yet laid out
    T = nf                             # == len(task_op)
    # only backward ops that read an evicted root get a chain or a fetch; the others run as
    # they are, like ops that read no saved activation
    readers_of = tab.bwd_readers_of
    evicted_readers = sorted({i for x in tab.saved_roots if action[x] in (SWAP_CODE, RECOMPUTE_CODE)
                              for i in readers_of.get(x, ())})
    for i in evicted_readers:
        if i > nxt:                    # ops in between read none: they run as they are
            task_op.extend(range(nxt, i))
            task_owner.extend(range(nxt, i))
            op_task[nxt:i] = range(T, T + i - nxt)
            T += i - nxt
        ins = bwd_saved_in[i]
        targets = [r for r in ins if action[r] == RECOMPUTE_CODE and r not in mat]
        if targets:
            _insert_chain(prof, tab, action, lay, mat, resident, i, targets)
            T = len(task_op)
        for r in ins:
            if action[r] == SWAP_CODE and r not in mat:
                mat.add(r)
                need_task[r] = T
        op_task[i] = T
        task_op.append(i)
        task_owner.append(i)
        T += 1
        nxt = i + 1
    if nxt < n_ops:
        task_op.extend(range(nxt, n_ops))
        task_owner.extend(range(nxt, n_ops))
        op_task[nxt:] = range(T, T + n_ops - nxt)
    return lay


def _chain_closure(prof, tab: Tables, action: list[int], mat: set[int], resident,
                   i: int, targets: list[int]) -> tuple[set[int], set[int]]:
    """`closure` for the chain before backward op `i`; a chain through a value that cannot be
    re-run (a random op's output, or what an op made from a value a later op overwrote in
    place) and that backward does not save is an InputError naming both."""
    def at_hand(x: int) -> bool:
        return (action[x] == KEEP_CODE or resident(x, i)
                or (action[x] == SWAP_CODE and x not in mat))
    try:
        return closure(tab, targets, at_hand)
    except ChainImpossible as exc:
        t, x = prof.tensors[targets[0]], exc.x
        p = tab.producer[x]
        raise InputError(
            f"tensor {t.id} ({t.name}) cannot be recomputed: its chain needs tensor "
            f"{x} ({prof.tensors[x].name}), the output of op {p} ({prof.ops[p].name}), "
            "which cannot be re-run (a random op, or one that read a value a later op "
            "overwrote in place) and which backward does not save",
            hint="keep or swap that tensor instead") from None


def _insert_chain(prof, tab: Tables, action: list[int], lay: Layout, mat: set[int], resident,
                  i: int, targets: list[int]) -> None:
    """Append to `lay` the chain that re-produces `targets` before backward op `i`: its tasks,
    the swapped roots it fetches early, the roots it makes, its temporaries and the kept
    roots whose life it extends; the roots it makes resident join `mat`."""
    in_roots, out_roots, size = tab.in_roots, tab.out_roots, tab.size
    task_op, task_owner, temps = lay.task_op, lay.task_owner, lay.temps
    need_task, made_at, ext = lay.need_task, lay.made, lay.ext
    run, produced = _chain_closure(prof, tab, action, mat, resident, i, targets)
    T = len(task_op)
    fetched: list[int] = []
    last_reader: dict[int, int] = {}
    made: list[int] = []
    first_temp = len(temps)
    for p in sorted(run):
        task_op.append(p)
        task_owner.append(i)
        for x in in_roots[p]:
            if x in produced:
                last_reader[x] = T
            elif action[x] == SWAP_CODE and x not in mat:
                if x not in need_task:
                    need_task[x] = T
                    fetched.append(x)
            elif not resident(x, i):
                ext[x] = T                     # dead, not recomputable: held on
        nbytes = 0
        main = -1
        for o in out_roots[p]:
            if o not in produced and resident(o, i):
                continue                       # already there: not made again
            nbytes += size[o]
            if action[o] == RECOMPUTE_CODE and o not in mat:
                made_at.append((o, T))
                made.append(o)
                if main < 0 or o in targets:
                    main = o
            else:
                temps.append((o, T, T))        # end fixed below
                if main < 0:
                    main = o
        lay.chain_alloc[T] = nbytes
        lay.chain_root[T] = main
        T += 1
    for k in range(first_temp, len(temps)):
        o, start, _ = temps[k]
        temps[k] = (o, start, max(start, last_reader.get(o, start)))
    mat.update(fetched)
    mat.update(made)


# --------------------------------------------------------------------------------------------
# The planners' static view: one candidate's chain, every other candidate at hand
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CandidateChain:
    """What recomputing one saved root costs when every other saved root is at hand."""
    ops: tuple[int, ...]        # ops re-run, the root's producer first
    inputs: tuple[int, ...]     # other saved roots those ops read (resident when it runs)
    temps: tuple[int, ...]      # non-saved roots the chain allocates for a moment


def candidate_chain(tab: Tables, r: int) -> CandidateChain | None:
    """The chain of saved root `r` under the static view, or None when it cannot be re-run."""
    if not tab.recomputable[r]:
        return None
    nf, producer, saved = tab.n_fwd, tab.producer, tab.saved
    try:
        run, _ = closure(tab, [r], lambda x: saved[x] or producer[x] >= nf)
    except ChainImpossible:
        return None
    p = producer[r]
    siblings = set(tab.out_roots[p])
    inputs = sorted({x for o in run for x in tab.in_roots[o]
                     if saved[x] and x not in siblings})
    temps = sorted({o for q in run for o in tab.out_roots[q] if not saved[o]})
    return CandidateChain((p, *sorted(run - {p})), tuple(inputs), tuple(temps))


def _last_writes(prof, writes_in_place: Callable[[str], bool]) -> dict[int, int]:
    out: dict[int, int] = {}
    for t in prof.tensors:
        p = t.producer
        if t.alias_of is not None and p is not None and p < prof.n_forward \
                and writes_in_place(prof.ops[p].target):
            out[t.alias_of] = max(out.get(t.alias_of, -1), p)
    return out


# --------------------------------------------------------------------------------------------
# What the in-place runtime needs from a layout
# --------------------------------------------------------------------------------------------
def copy_back_pins(decisions, schedule=()) -> dict[int, int]:
    """Swapped root -> the backward op from which its copy back may be issued: where the
    plan's schedule issued it (the simulator issues a prefetch as late as memory needs), else
    the decision's own `prefetch_at`. The emitted step takes the same rule
    (`run/written/code.py`); a swap with neither is fetched as backward begins, every one of
    them at once, which holds all swapped bytes through the start of backward."""
    pins = {d.tensor: d.prefetch_at for d in decisions
            if d.action == Action.SWAP and d.prefetch_at is not None}
    swapped = {d.tensor for d in decisions if d.action == Action.SWAP}
    pins.update({e.tensor: e.issue_op for e in schedule
                 if e.kind == "prefetch" and e.tensor in swapped})
    return pins


def runtime_table(prof, decisions, writes_in_place: Callable[[str], bool],
                  schedule=()) -> dict:
    """The plan as the in-place runtime (`run/eager/first_call.py`) carries it out, in plain Python
    values and `OpRow`s.

    - `ops`: the forward ops in order, each a `table_rows.OpRow` (the runtime aligns the ops
      it sees with these);
    - `root`: activation tensor id -> its storage root (aliases only);
    - `action`: root -> "swap" | "recompute" (every other root is kept);
    - `chains`: backward op -> the forward ops re-run before it (`Layout.chains`);
    - `made_by`: recompute root -> the backward op whose chain makes it;
    - `chain_inputs`: backward op -> roots its chain reads that it does not make (they must be
      at hand: the runtime holds kept ones until the chain ran, fetches swapped ones);
    - `op_inputs`: chain op -> the activation roots it reads (the runtime checks them);
    - `needs`: recompute root -> the ops of its chain it depends on (all before it);
    - `bwd_use`: saved root -> its first backward reader (how far backward has got);
    - `non_activation`: parameters, buffers and inputs (roots outside activation memory);
    - `last_write`: root -> the last forward op that writes into it in place, for roots
      written after they are made (`writes_in_place(op target)`: aten's rule, which lives
      on the torch side, `trace.aten.is_inplace_target`);
    - `first_use`: swapped root -> the backward op that first needs it (a chain or a reader);
    - `prefetch_at`: swapped root -> the backward op from which its copy back may be issued
      (`copy_back_pins` of the decisions and the plan's `schedule`; at the latest its first
      use);
    - `keep_after`: per forward op, the bytes of kept saved roots it and later ops produce;
    - `saved_by_shape`: `[shape, bytes]` of the saved roots, summed per shape (what a keep-all
      run saves at the profiled shapes: a plan borrowed at other shapes before any call ran
      scales it, `run/eager/inplace.py`).
    """
    tab = tables(prof)
    action = action_codes(tab, decisions)
    pin_at = copy_back_pins(decisions, schedule)
    lay = lay_out(prof, tab, action)
    nf = tab.n_fwd
    chains = lay.chains(nf)
    made_by = {r: lay.task_owner[t] for r, t in lay.made}
    chain_inputs: dict[int, list[int]] = {}
    for owner, ops in chains.items():
        run = set(ops)
        made_here = {o for p in ops for o in tab.out_roots[p]}
        ins = sorted({x for p in run for x in tab.in_roots[p] if x not in made_here})
        chain_inputs[owner] = ins
    first_use = {r: lay.task_owner[t] for r, t in lay.need_task.items()}
    op_inputs = {p: list(tab.in_roots[p]) for ops_ in chains.values() for p in ops_}
    needs: dict[int, list[int]] = {}
    for owner, ops_ in chains.items():
        in_chain = set(ops_)
        for r in (r for r, o in made_by.items() if o == owner):
            todo, seen = [tab.producer[r]], set()
            while todo:
                p = todo.pop()
                if p in seen:
                    continue
                seen.add(p)
                todo += [tab.producer[x] for x in tab.in_roots[p] if tab.producer[x] in in_chain]
            needs[r] = sorted(seen)
    return {
        "n_forward": nf,
        "ops": _op_rows(prof, tab, nf),
        "root": {t.id: t.alias_of for t in prof.tensors if t.alias_of is not None},
        "non_activation": [t.id for t in prof.tensors
                           if t.kind != "activation" and t.alias_of is None],
        "action": {r: ACTION_OF_CODE[action[r]].value      # plain strings: pformat-ed
                   for r in tab.saved_roots if action[r] in (SWAP_CODE, RECOMPUTE_CODE)},
        "chains": {k: list(v) for k, v in chains.items()},
        "made_by": made_by,
        "chain_inputs": chain_inputs,
        "op_inputs": op_inputs,
        "needs": needs,
        "bwd_use": {r: tab.first_bwd_use[r] for r in tab.saved_roots},
        "last_write": _last_writes(prof, writes_in_place),
        "first_use": first_use,
        "prefetch_at": {r: min(pin_at.get(r, nf), first_use.get(r, nf)) for r in first_use},
        "keep_after": _keep_after(tab, action, nf),
        "saved_by_shape": _saved_by_shape(prof, tab),
    }


def _saved_by_shape(prof, tab) -> list[list]:
    """`[shape, bytes]` of the saved roots, summed per shape (in the order of the roots' ids)."""
    got: dict[tuple, int] = {}
    for r in tab.saved_roots:
        key = tuple(prof.tensors[r].shape)
        got[key] = got.get(key, 0) + tab.size[r]
    return [[list(k), b] for k, b in got.items()]


def _op_rows(prof, tab, nf: int) -> list[OpRow]:
    """The forward ops as the in-place runtime lines them up (`OpRow`)."""
    ops = []
    for o in prof.ops[:nf]:
        acts = [t for t in o.inputs if prof.tensors[tab.root[t]].kind == "activation"]
        ops.append(OpRow(name=o.name, target=o.target, module=o.module,
                         shapes=[list(prof.tensors[t].shape) for t in o.outputs],
                         outputs=list(o.outputs), reads_act=bool(acts), acts=acts))
    return ops


def _keep_after(tab, action, nf: int) -> list[int]:
    """Per forward op i (and one past the last): the bytes of saved roots the plan keeps that
    ops i.. produce: what the guard leaves room for (`guard.py`)."""
    per_op = [0] * (nf + 1)
    for r in tab.saved_roots:
        p = tab.producer[r]
        if action[r] not in (SWAP_CODE, RECOMPUTE_CODE) and p is not None and p < nf:
            per_op[p] += tab.size[r]
    for i in range(nf - 1, -1, -1):
        per_op[i] += per_op[i + 1]
    return per_op
