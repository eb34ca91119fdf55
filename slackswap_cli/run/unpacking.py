"""The backward side of a recorded call's saved-tensor hooks: handing each saved tensor back.

`Unpacking.unpack` gives autograd what a pack stood in for: a kept tensor as it is; a swapped
one viewed from its storage fetched back (`swap.wait`), its copy back issued ahead of need as
backward progresses (the plan's prefetch points: `_issue_prefetches`); a recomputed one after
its chain ran (`_run_chain`: the records the chain needs replayed under `no_grad` with autocast
off, chains laid out earlier first, as simulated). What the run holds for a root (made by a
chain, fetched back) is let go once autograd took every saved reference to it and no later
chain reads it (`_release`).

`Unpacking` is a part of `record.PlanRun` (its state is the run's: see `PlanRun.__init__`).
"""
from __future__ import annotations

import torch

from ..errors import InputError
from . import swap
from .packs import SwappedRef
from .recorded import STATE, view_of

__all__ = ["Unpacking"]


class Unpacking:
    """Backward's side of a recorded call (see the module docstring)."""

    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        if packed.taken:
            raise InputError("a second backward through a step whose saved tensors slackswap "
                             "swapped or recomputed: they were handed to the first one "
                             "(backward(retain_graph=True) twice, or double backward)",
                             hint="run one backward per forward, or unpatch(model) for this "
                                  "step")
        packed.taken = True                   # a saved tensor is handed out once
        r = packed.root
        first = self.table.bwd_use.get(r)
        if first is not None and first > self.progress:
            self.progress = first
        self._issue_prefetches()
        if type(packed) is SwappedRef:
            sw = packed.copy
            out = view_of(sw.fetch(), packed.dtype, packed.shape, packed.stride, packed.offset)
            sw.packs -= 1
            if sw.packs <= 0 and self.chain_uses.get(r, 0) <= 0:
                sw.dev = None                 # autograd holds what it took

        else:
            owner = self.table.made_by[r]
            if owner not in self.done_chains:
                # autograd unpacks a node's saved tensors in its own order: chains laid out
                # before this one (whose roots it may read) run first, as simulated
                for o in sorted(x for x in self.deferred
                                if x < owner and x not in self.done_chains):
                    self._run_chain(o)
                self._run_chain(owner)
            out = self._resolve(packed.loc, {})
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
        order, pf = self.prefetch_order, self.table.prefetch_at
        while self.next_prefetch < len(order) and pf[order[self.next_prefetch]] <= self.progress:
            r = order[self.next_prefetch]
            self.next_prefetch += 1
            sw = self.root_swap.get(r)
            if sw is not None and sw.handle is not None:
                swap.prefetch(sw.handle)

    def _run_chain(self, owner: int) -> None:
        local: dict[tuple[int, int], torch.Tensor] = {}
        ks = self._chain_records(owner)
        self.chain = owner
        grad = torch.is_grad_enabled()
        torch.set_grad_enabled(False)
        prev, STATE.run = getattr(STATE, "run", None), None      # (no recording)
        autocast = AutocastOff(self.device)
        try:
            with autocast:
                for k in ks:
                    self._replay(k, local)
            self.rerun_ops += len(ks)
        finally:
            torch.set_grad_enabled(grad)
            STATE.run = prev
            self.chain = None
        self.done_chains.add(owner)
        self._chain_ran(owner)
        for loc, tid in self._chain_made(owner, local):
            t = local.get(loc)
            if t is not None:
                self.made[tid] = t
        for r in self.table.chain_inputs.get(owner, ()):
            self.chain_uses[r] = self.chain_uses.get(r, 0) - 1
            if self.chain_uses[r] <= 0:
                self.pinned.pop(r, None)
                self._release(r)


class AutocastOff:
    """Autocast off on the devices where it is on, for a replay (the records carry every cast)."""
    __slots__ = ("types", "ctx")

    def __init__(self, device):
        self.types = ("cpu",) if device is None or device.type == "cpu" else ("cpu", device.type)
        self.ctx = ()

    def __enter__(self):
        if not any(map(torch.is_autocast_enabled, self.types)):
            return                                       # (the common case: nothing to do)
        self.ctx = [torch.autocast(t, enabled=False) for t in self.types
                    if torch.is_autocast_enabled(t)]     # (making one costs: not per replay)
        for c in self.ctx:
            c.__enter__()

    def __exit__(self, *exc):
        for c in reversed(self.ctx):
            c.__exit__(*exc)
