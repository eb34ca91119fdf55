"""The memory guard: what a run does with a saved tensor its plan cannot place.

A plan names saved activations by their place in the profiled step. A run that departs from
it (a library branching otherwise in eager than under fake tensors, another routing, an op
the trace does not have) saves tensors the plan does not name, and recomputes it cannot
carry out (an op its chain needs did not line up). Eager would keep them all; on a GPU that
is the out-of-memory error the plan exists to prevent. The guard's rule, one for the runtime
(`run/eager/holding.py`, pack by pack) and for the simulator (`guarded_decisions`):

- the bytes held for backward are counted in forward order: every saved storage kept (by
  the plan or by the guard) counts once, from the moment autograd saves it; swapped and
  recomputed ones do not count;
- a saved tensor the plan cannot place is **kept if holding it leaves the count, plus what
  the plan keeps later in forward (the reserve), at or under the limit** (the plan's budget),
  **else swapped** to host memory (a copy of its storage, brought back in backward: bit for
  bit, so training is unchanged);
- what the plan places (keep, swap, recompute as planned) is never changed: the guard only
  decides what the plan left undecided. Swapping is the fallback because it needs nothing of
  the profile: a recompute needs the ops before it lined up, which is exactly what failed.

Assumption (as eager's autograd makes it): a saved tensor is not written in place after it
was saved, except roots the profile knows are written later (`last_write`), which the
runtime keeps and counts.

At input shapes the plan was not made for, the first call follows the plan of a call at
other shapes (`run/eager/new_shape.py`) and the guard holds it to the budget at these shapes: the
plan's fraction of what a keep-all run holds at them, which `Scale` predicts pack by pack
before the call has seen it all. The run's first call, when it is at such shapes, has no call
to follow: it is recorded on the profiled plan, the guard's limit guessed with `Scale` from
the saved bytes the profile names per shape, then settled by the call
(`run/eager/signatures.py`, `first_guess`).

This module is the torch-free core's; `run/eager/holding.py` applies it on the torch side (`guard_decision`).
"""
from __future__ import annotations

from .schema import Action, Decision, Profile

__all__ = ["Guard", "Scale", "guarded_decisions"]


class Guard:
    """The running count of one forward and the rule applied to it. `limit`: the byte count
    held for backward may reach (None: no limit, everything is kept)."""
    __slots__ = ("limit", "held", "seen", "swaps", "swapped_bytes", "kept_over")

    def __init__(self, limit: int | None):
        self.limit = limit
        self.held = 0
        self.seen: set = set()
        self.swaps = 0              # saved tensors the guard swapped
        self.swapped_bytes = 0
        self.kept_over = 0          # bytes the plan itself keeps beyond the limit

    def hold(self, key, nbytes: int) -> None:
        """Count a storage the plan holds (kept as planned): once per storage."""
        if key not in self.seen:
            self.seen.add(key)
            self.held += nbytes
            if self.limit is not None and self.held > self.limit:
                self.kept_over = self.held - self.limit

    def drop(self, key, nbytes: int) -> None:
        """A counted storage is no longer held (the plan swapped a root it held for a chain)."""
        if key in self.seen:
            self.seen.discard(key)
            self.held -= nbytes

    def admit(self, key, nbytes: int, reserve: int = 0) -> bool:
        """May the run keep a saved storage the plan cannot place, leaving `reserve` bytes for
        what the plan keeps later in forward? True: keep it (counted); False: swap it (counted
        among the guard's swaps, not as held)."""
        if key in self.seen:
            return True                 # already held: keeping another view costs nothing
        if self.limit is None or self.held + nbytes + reserve <= self.limit:
            self.seen.add(key)
            self.held += nbytes
            return True
        self.swaps += 1
        self.swapped_bytes += nbytes
        return False


class Scale:
    """Predicts a saved tensor's shape at new input shapes from its shape at the ones a plan
    was made for. Each input dimension that changed maps its old size to its new one (the
    first input that changes a size decides); a shape is predicted by mapping each of its
    dimensions, and once a tensor of an old shape was seen at the new inputs
    (`observe`), what it became is the prediction for that old shape from then on (a
    flattened batch times sequence, or a size equal to a changed one by chance, is learned
    from the first tensor of that shape). Assumption: tensors of one old shape have one new
    shape."""
    __slots__ = ("dims", "seen")

    def __init__(self, old: list[tuple[int, ...]], new: list[tuple[int, ...]]):
        self.dims: dict[int, int] = {}
        for a, b in zip(old, new):
            for x, y in zip(a, b):
                if x != y:
                    self.dims.setdefault(x, y)
        self.seen: dict[tuple, tuple] = {}

    def shape(self, old: tuple[int, ...]) -> tuple[int, ...]:
        got = self.seen.get(old)
        if got is None:
            got = tuple(self.dims.get(d, d) for d in old)
        return got

    def ratio(self, old: tuple[int, ...]) -> float:
        """Predicted element count at the new inputs over the old one (1.0 for no elements)."""
        a, b = 1, 1
        for x, y in zip(old, self.shape(old)):
            a, b = a * x, b * y
        return b / a if a else 1.0

    def observe(self, old: tuple[int, ...], new: tuple[int, ...]) -> bool:
        """Note what a tensor of shape `old` became; True when that changed the prediction."""
        if old in self.seen:
            return False
        before = self.shape(old)
        self.seen[old] = new
        return before != new


def guarded_decisions(profile: Profile, decisions, limit: int,
                      unplaced: set[int]) -> tuple[Decision, ...]:
    """The decisions a run carries out when the saved roots `unplaced` cannot be placed as
    decided (the plan's decision for them does not hold): each of them, in production order,
    is kept while the bytes held for backward so far (kept roots produced before it, plan's
    and guard's alike, each counted once) plus its own plus the plan's kept roots produced
    after it stay within `limit`, else swapped. The simulator then judges the result like
    any plan."""
    by_id = {d.tensor: d for d in decisions}
    guard = Guard(limit)
    saved = profile.saved_activations
    planned = [t.size_bytes if t.id not in unplaced and by_id.get(
        t.id, Decision(t.id, Action.KEEP.value)).action == Action.KEEP.value else 0 for t in saved]
    reserve = [0] * (len(saved) + 1)          # what the plan keeps later: left room for
    for i in range(len(saved) - 1, -1, -1):
        reserve[i] = reserve[i + 1] + planned[i]
    out = []
    for i, t in enumerate(saved):
        d = by_id.get(t.id, Decision(t.id, Action.KEEP.value))
        if t.id in unplaced:
            keep = guard.admit(t.id, t.size_bytes, reserve[i + 1])
            d = Decision(t.id, Action.KEEP.value if keep else Action.SWAP.value)
        elif d.action == Action.KEEP.value:
            guard.hold(t.id, t.size_bytes)
        out.append(d)
    return tuple(out)
