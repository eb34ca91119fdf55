"""The plan as a selective-checkpointing policy, for blocks wrapped in `torch.utils.checkpoint`.

    from torch.utils.checkpoint import checkpoint
    y = checkpoint(block, x, use_reentrant=False, context_fn=context_fn(i))

`context_fn(i)` builds, at each checkpointed call, the policy of repeated block i
(`sac_policy(i)`): every op the block runs is looked up by (op, occurrence of that op in the
block) among the block's forward ops in the profile (in-place ops under their out-of-place
name, as `graph_plan.op_key` does), with a check that its first tensor argument has the
profiled shape. The plan's choice then becomes a `CheckpointPolicy` (`tags.op_policy`, the map compile_planned
reads too), but for the cases below:

- kept root -> MUST_SAVE;  recomputed (an op of a recompute chain) -> MUST_RECOMPUTE;
- swapped root -> MUST_SAVE as well: selective checkpointing cannot offload (torch 2.13's
  `MUST_CPU_OFFLOAD` does not reach the partitioner's `should_offload`, and eager checkpoint
  has no offload at all), so in eager, and compiled through plain `torch.compile`, a swapped
  tensor stays on the device; `compile_planned` is the runtime that offloads it;
- random ops (dropout) and roots written in place after they are made (dropout's mask by
  `bernoulli_`, BatchNorm's output by `relu_`) -> PREFER_RECOMPUTE, as plain checkpoint does:
  checkpoint restores the generator before its recompute, so every random op of the block
  re-draws the same numbers only if all of them re-run (a cached one would shift the draws of
  the rest), and a cached in-place result is not reliable in torch 2.13 (saving dropout's mask
  at its last write, `div_`, gave tiny GPT other gradients than eager: loss 3.87902 against
  3.87987 at step 2; SAC also takes the version bump of the in-place op itself for a mutation
  of its cache). The plan keeps such roots; under SAC they cost their (cheap) re-run;
- anything else (views, temporaries, ops that do not line up) -> PREFER_RECOMPUTE, which is
  what checkpoint does without a policy.

Under torch.compile the same tags reach the joint graph (`node.meta["recompute"]`) and the
min-cut partitioner honours them. `policy.counts` says how many ops lined up in forward and
how many got each policy (by name: MUST_SAVE, MUST_RECOMPUTE, PREFER_RECOMPUTE).
"""
from __future__ import annotations

from collections import defaultdict

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from .graph_plan import block_name, block_rows, op_key
from .tags import op_policy


class PlanPolicy:
    """`policy(ctx, op, *args, **kwargs)` for `create_selective_checkpoint_contexts`; counts
    occurrences separately in forward and in the recompute (`ctx.is_recompute`)."""

    def __init__(self, table: dict, block_index: int):
        self.block = block_name(table, block_index)
        self.rows: dict[str, list[int]] = defaultdict(list)
        self.table = table
        last: dict[int, int] = {}          # root -> the last row that writes it
        for r in block_rows(table, self.block):
            row = table["ops"][r]
            self.rows[op_key(row.target, ())[0]].append(r)
            for root in row.roots:
                if root is not None:
                    last[root] = r
        first: dict[int, int] = {}
        for rows in self.rows.values():
            for r in rows:
                for x in table["ops"][r].roots:
                    if x is not None:
                        first[x] = min(first.get(x, r), r)
        # roots written in place after they are made (dropout's mask, BatchNorm's output
        # under relu_): recomputed, see the module docstring
        self.written = {r for rows in self.rows.values() for r in rows
                        if any(x is not None and first[x] != last[x]
                               for x in table["ops"][r].roots)}
        self.seen: dict[tuple[bool, str], int] = defaultdict(int)
        self.counts = {"lined_up": 0, "not_lined_up": 0}

    def __call__(self, ctx, op, *args, **kwargs) -> CheckpointPolicy:
        name = op_key(str(op), ())[0]
        k = self.seen[(ctx.is_recompute, name)]
        self.seen[(ctx.is_recompute, name)] = k + 1
        rows = self.rows.get(name, ())
        r = rows[k] if k < len(rows) else None
        row = self.table["ops"][r] if r is not None else None
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if row is not None and row.input_shapes and (
                first is None or list(first.shape) != row.input_shapes[0]):
            row = None
        tags = [t for t in (row.tags if row else ()) if t]
        random = torch.Tag.nondeterministic_seeded in getattr(op, "tags", ())
        policy = op_policy(tags)          # tags.py: the one map from tags to policies
        if policy is None or (policy == CheckpointPolicy.MUST_SAVE
                              and (random or r in self.written)):
            policy = CheckpointPolicy.PREFER_RECOMPUTE
        if not ctx.is_recompute:
            self.counts["lined_up" if row is not None else "not_lined_up"] += 1
            self.counts[policy.name] = self.counts.get(policy.name, 0) + 1
        return policy


def sac_policy(table: dict, block_index: int) -> PlanPolicy:
    """A fresh policy for repeated block `block_index` (one per checkpointed call: it counts
    occurrences)."""
    return PlanPolicy(table, block_index)


def context_fn(table: dict, block_index: int):
    """The `context_fn` argument of `torch.utils.checkpoint.checkpoint` for block
    `block_index`: a fresh policy at each call."""
    block_name(table, block_index)        # refuse a block the profile does not have, now

    def make():
        return create_selective_checkpoint_contexts(sac_policy(table, block_index))
    return make
