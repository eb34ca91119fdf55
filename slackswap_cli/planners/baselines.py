"""Baselines: what users would do without slackswap, judged by the same simulator.

- `recompute-only`: a knapsack over recompute cost per byte, like torch.compile's activation
  memory budget: recompute the cheapest chains per byte freed, at the moments memory exceeds
  the budget, until it holds everywhere. Outputs of random ops (dropout) cannot be recomputed
  and are kept.
- `swap-all`: offload every saved activation and bring it back before use, like CPU-offload
  hooks (`torch.autograd.graph.save_on_cpu`); prefetches as early as memory allows.
- `checkpoint-layers`: `torch.utils.checkpoint` on every k-th repeated block (found from module
  paths such as `transformer.h.3` by `layers`, as the terminal views group them): in a checkpointed
  block every saved tensor produced inside it is recomputed, except what later blocks read (the
  next block's input) and random ops' outputs; k is the largest step that fits the budget in
  the static model (k = 1 checkpoints every block). `fit` runs it with `k=1` fixed: full
  activation checkpointing, what users reach for when the model does not fit.
"""
from __future__ import annotations

import numpy as np

from ..hardware import HardwareSpec
from ..layers import op_layer_indices
from ..schema import Decision, Profile
from .common import (
    KEEP,
    RECOMPUTE,
    SWAP,
    PlannerOutput,
    State,
    build_chains,
    build_cost_model,
    memory,
    recompute_until_fits,
)


def recompute_only(profile: Profile, hw: HardwareSpec, budget_bytes: int):
    m = build_cost_model(profile, hw)
    state = State(m)
    mem, fits = recompute_until_fits(m, state, budget_bytes, m.live_keep.astype(np.int64))
    notes = [f"recomputed {sum(a == RECOMPUTE for a in state.actions)} tensors, "
             f"{state.recompute_us():.0f} us of recompute"]
    if not fits:
        notes.append("recompute alone cannot reach the budget (random ops' outputs and "
                     "non-recomputable chains stay)")
    return PlannerOutput(state.decisions(), tuple(notes))


def swap_all(profile: Profile, hw: HardwareSpec, budget_bytes: int):
    """Every saved activation swapped, but what the model's own checkpoints hold (kept)."""
    held = set(profile.summary.get("checkpoint_held") or ())
    return [Decision(tensor=t.id, action=KEEP if t.id in held else SWAP)
            for t in profile.saved_activations]


def checkpoint_layers(profile: Profile, hw: HardwareSpec, budget_bytes: int, *,
                      k: int | None = None):
    """Checkpoint every k-th block: the largest k that fits the budget, or the given `k`."""
    m = build_cost_model(profile, hw)
    layers = op_layer_indices(profile)
    blocks = sorted({x for x in layers if x is not None})
    if not blocks:
        return PlannerOutput([Decision(tensor=t, action=KEEP) for t in m.cands],
                             ("no repeated blocks found in module paths; kept everything",))
    # a candidate is recomputed with its block unless a forward op of another block reads it
    block_of = [m.layer[c] for c in range(len(m.cands))]
    crosses = []
    for c, tid in enumerate(m.cands):
        readers = [o for x in (tid, *profile.aliases.get(tid, ()))
                   for o in profile.tensors[x].consumers if o < m.nf]
        crosses.append(any(layers[o] != block_of[c] for o in readers))
    if k is None and int(m.live_keep.max(initial=0)) <= budget_bytes:
        return PlannerOutput([Decision(tensor=t, action=KEEP) for t in m.cands],
                             ("everything fits: no block checkpointed",))
    best = None
    # checkpoint keeps the block's input: a tensor whose recompute chain leaves its block (it
    # is, or derives without a saved value in between from, what the block received) stays
    ch = build_chains(m)
    inside = [np.isfinite(ch.cost[c]) and all(layers[o] == block_of[c] for o in ch.ops[c])
              for c in range(len(m.cands))]
    for step in ([k] if k is not None else range(len(blocks), 0, -1)):
        chosen = set(blocks[::step])
        actions = [RECOMPUTE if (block_of[c] in chosen and not crosses[c] and inside[c])
                   else KEEP for c in range(len(m.cands))]
        state = State(m, actions, ch)
        mem = memory(m, state)
        best = (step, state)
        if int(mem.max(initial=0)) <= budget_bytes:
            break
    k, state = best
    n_ck = len(blocks[::k])
    fits = int(memory(m, state).max(initial=0)) <= budget_bytes
    notes = [f"checkpointed {n_ck} of {len(blocks)} blocks (every {k}"
             f"{'st' if k == 1 else 'th'} block)"]
    if not fits:
        notes.append("checkpointing every block does not reach the budget")
    return PlannerOutput(state.decisions(), tuple(notes))
